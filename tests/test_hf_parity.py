"""Patched vs unpatched: same weights, same prompts, same last-token logits and greedy tokens.

Every family runs on a tiny random config (CPU, float32, reference backend). The twin is a
``copy.deepcopy`` taken before patching, running HF eager attention with its own dense cache.
Sliding windows (6 tokens) are shorter than the prompts (11-17 tokens), so they bite.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import FAMILIES, build_model, make_prompts, paged_greedy  # noqa: E402
from paged_ops.integrations.transformers import patch_model  # noqa: E402

PROMPT_LENGTHS = (11, 17, 14)
STEPS = 16
RTOL = 1e-4


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _eager_last_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt]), use_cache=False).logits[0, -1]  # [V]


def _eager_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """HF generate, one prompt at a time (padding in a batch changes the numerics)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_patched_model_matches_eager_logits_and_greedy_tokens(family: str) -> None:
    model = build_model(family)
    assert model.config.model_type == family
    twin = copy.deepcopy(model)
    pa = patch_model(model, backend="reference", max_model_len=64)
    assert pa is not None
    prompts = make_prompts(PROMPT_LENGTHS)
    logits, tokens = paged_greedy(model, pa, prompts, STEPS)
    for i, prompt in enumerate(prompts):
        err = _rel_err(logits[i], _eager_last_logits(twin, prompt))
        assert err <= RTOL, f"{family} prompt {i}: relative error {err:.2e}"
        assert tokens[i] == _eager_greedy(twin, prompt, STEPS), f"{family} prompt {i}"
    assert pa.allocator.num_free == pa.kv_cache.num_blocks  # every sequence released


# (family, config overrides that turn the feature off): the feature-off model must disagree, which
# shows the parity test above would catch a dropped window / softcap / sink.
FEATURES = [
    ("mistral", {"sliding_window": None}),
    ("qwen2", {"use_sliding_window": False}),
    ("qwen2_moe", {"use_sliding_window": False}),
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"query_pre_attn_scalar": 16}),
    ("gemma3_text", {"sliding_window": 64}),
    ("gpt_oss", {"layer_types": ["full_attention", "full_attention"]}),
]


@pytest.mark.parametrize(
    ("family", "off"), FEATURES, ids=[f"{f}-{next(iter(o))}" for f, o in FEATURES]
)
@torch.no_grad()
def test_feature_changes_the_logits(family: str, off: dict) -> None:
    model = build_model(family)
    plain = build_model(family, **off)
    plain.load_state_dict(model.state_dict())
    pa = patch_model(model, backend="reference", max_model_len=64)
    prompts = make_prompts(PROMPT_LENGTHS)
    logits, _ = paged_greedy(model, pa, prompts, 1)
    errs = [_rel_err(logits[i], _eager_last_logits(plain, p)) for i, p in enumerate(prompts)]
    assert max(errs) > 1e-2, f"{family} without {off} gives the same logits: {errs}"


@torch.no_grad()
def test_gpt_oss_sinks_change_the_logits() -> None:
    model = build_model("gpt_oss")
    twin = copy.deepcopy(model)
    for layer in twin.model.layers:
        layer.self_attn.sinks.fill_(-1e4)  # a sink at -inf is no sink
    pa = patch_model(model, backend="reference", max_model_len=64)
    prompts = make_prompts(PROMPT_LENGTHS)
    logits, _ = paged_greedy(model, pa, prompts, 1)
    errs = [_rel_err(logits[i], _eager_last_logits(twin, p)) for i, p in enumerate(prompts)]
    assert max(errs) > 1e-3, f"gpt-oss sinks have no effect: {errs}"
