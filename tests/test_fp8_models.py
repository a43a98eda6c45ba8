"""An FP8 KV cache behind patch_model, transformers' generate and the LLM engine (CPU, reference
backend): the engine under KV pressure, with prefix caching and compiled, gives the tokens that
one-prompt-at-a-time generate gives on a twin FP8 cache with the same scales; checkpoint scales and
calculate_kv_scales set the scales."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import all_blocks_free, build_model, make_prompts, padded_batch
from paged_ops.integrations.transformers import patch_model

from paged_ops import LLM, SamplingParams
from paged_ops.engine import llm as llm_module

pytest.importorskip("transformers")

E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model("llama", seed=3)


def fp8_twin(model: torch.nn.Module, k_scales: torch.Tensor, v_scales: torch.Tensor):
    """A deep copy patched with an FP8 cache whose scales are given ([L, Hkv])."""
    twin = copy.deepcopy(model)
    pa = patch_model(twin, backend="reference", kv_cache_dtype="fp8", max_model_len=64)
    pa.set_kv_scales(list(k_scales), list(v_scales))
    return twin


def generate_one_by_one(twin: torch.nn.Module, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = twin.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                            do_sample=False)  # fmt: skip
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def make_llm(model: torch.nn.Module, **kwargs) -> LLM:
    opts = dict(backend="reference", compile=False, block_size=4, max_num_seqs=8,
                max_model_len=64, kv_cache_dtype="fp8")  # fmt: skip
    opts.update(kwargs)
    return LLM(copy.deepcopy(model), **opts)


def test_engine_on_fp8_under_kv_pressure_loses_nothing_and_matches_generate(model):
    # 12 blocks of 4 tokens hold 48 tokens; 5 requests want up to 20 + 12 tokens each
    llm = make_llm(model, num_blocks=12, prefix_caching=False, calculate_kv_scales=True)
    assert llm.pa.kv_cache.data.dtype == E4M3
    prompts = make_prompts([20, 9, 15, 3, 12], seed=2)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=12), use_tqdm=False)
    assert llm.last_metrics.num_preemptions > 0
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in outs)
    assert all_blocks_free(llm.pa)
    # the first step measured the scales (not 1.0); a twin with those scales agrees token by token
    assert not torch.equal(llm.pa.k_scales, torch.ones_like(llm.pa.k_scales))
    twin = fp8_twin(model, llm.pa.k_scales, llm.pa.v_scales)
    assert [o.token_ids for o in outs] == generate_one_by_one(twin, prompts, 12)


def test_engine_on_fp8_with_shared_prefixes_matches_generate(model):
    llm = make_llm(model, num_blocks=64, max_num_seqs=2)
    llm.pa.set_kv_scales(0.01, 0.02)
    prefix = make_prompts([13], seed=3)[0]  # 3 full blocks + 1 token
    prompts = [prefix + tail for tail in make_prompts([2, 5, 1, 7], seed=4)]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=5), use_tqdm=False)
    assert outs[-1].num_cached_tokens == 12
    twin = fp8_twin(model, llm.pa.k_scales, llm.pa.v_scales)
    assert [o.token_ids for o in outs] == generate_one_by_one(twin, prompts, 5)
    assert all_blocks_free(llm.pa)


def test_compiled_engine_on_fp8_calibrates_inside_the_graph_and_matches_eager(model):
    prompts = make_prompts([11, 4, 17], seed=5)
    params = SamplingParams(max_new_tokens=6)
    compiled = make_llm(model, num_blocks=64, compile=True, calculate_kv_scales=True)
    got = compiled.generate(prompts, params, use_tqdm=False)
    scales = compiled.pa.k_scales.clone(), compiled.pa.v_scales.clone()
    eager = make_llm(model, num_blocks=64)
    eager.pa.set_kv_scales(list(scales[0]), list(scales[1]))
    assert [o.token_ids for o in got] == [
        o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)
    ]
    # a second call keeps the scales measured by the first
    compiled.generate(make_prompts([30], seed=6), params, use_tqdm=False)
    assert torch.equal(compiled.pa.k_scales, scales[0])


def test_llm_fp8_cache_holds_four_times_the_blocks_of_float32_in_a_budget(model, monkeypatch):
    monkeypatch.setattr(llm_module, "_CPU_KV_BYTES", 1 << 20)  # the default CPU budget, smaller
    plain = make_llm(model, kv_cache_dtype="auto", max_num_seqs=256)
    fp8 = make_llm(model, max_num_seqs=256)
    # the budget caps both: one byte per value instead of four (the model is float32)
    assert fp8.pa.kv_cache.num_blocks == 4 * plain.pa.kv_cache.num_blocks
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        make_llm(model, kv_cache_dtype="int4")


def test_checkpoint_scales_on_the_attention_modules_are_read(model):
    ckpt = copy.deepcopy(model)
    for i, layer in enumerate(ckpt.model.layers):
        layer.self_attn.k_scale = torch.nn.Parameter(torch.tensor(0.01 * (i + 1)))
        layer.self_attn.v_scale = torch.nn.Parameter(torch.tensor([0.03, 0.04]))
    pa = patch_model(ckpt, backend="reference", kv_cache_dtype="fp8_e5m2")
    assert pa.kv_cache.data.dtype == torch.float8_e5m2
    torch.testing.assert_close(pa.k_scales, torch.tensor([[0.01, 0.01], [0.02, 0.02]]))
    torch.testing.assert_close(pa.v_scales, torch.tensor([[0.03, 0.04], [0.03, 0.04]]))
    plain = patch_model(copy.deepcopy(model), backend="reference", kv_cache_dtype="fp8")
    assert torch.equal(plain.k_scales, torch.ones(2, 2))  # no scales in the checkpoint: 1.0


def test_hf_generate_on_fp8_with_padding_and_beams_matches_one_by_one(model):
    twin = fp8_twin(model, torch.full((2, 2), 0.01), torch.full((2, 2), 0.01))
    prompts = make_prompts([5, 9, 2], seed=7)
    ids, mask = padded_batch(prompts)
    out = twin.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert out[:, ids.shape[1] :].tolist() == generate_one_by_one(twin, prompts, 5)
    # beam search copies partly filled blocks of an FP8 cache (byte copies)
    beams = twin.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=4, num_beams=3)
    assert beams.shape == (1, ids.shape[1] + 4)


def test_llm_on_a_model_patched_with_fp8_keeps_it_and_names_a_conflicting_dtype(model):
    patched = copy.deepcopy(model)
    pa = patch_model(patched, backend="reference", kv_cache_dtype="fp8_e5m2", max_model_len=64)
    llm = LLM(patched, compile=False, kv_cache_dtype="fp8_e5m2")
    assert llm.pa is pa and llm.pa.kv_cache.data.dtype == torch.float8_e5m2
    with pytest.raises(ValueError, match=r"kv_cache_dtype=torch.float32 \(the patched model has "):
        LLM(patched, compile=False, kv_cache_dtype="auto")
