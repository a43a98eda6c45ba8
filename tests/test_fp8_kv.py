"""FP8 KV cache: the quantization rule, both ops on the reference and triton backends (triton under
the interpreter), checks, PagedAttention's scales and calibration.

Outputs are compared with an independent float64 dense attention twice: over the *dequantized* K/V
(what an exact kernel computes: tight) and over the unquantized K/V (FP8's own error).
"""

import dataclasses
import os

import pytest
import torch
from paged_testing import (
    PADDED_FEATURES,
    assert_matches_dense,
    dense_batch_f64,
    fp8_scales,
    make_batch,
    quantized_batch,
    write_and_attend,
)

import paged_ops
from paged_ops.fp8 import dequantize, fp8_max, quantize, resolve_kv_cache_dtype

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]
BACKENDS = ["reference", "triton"]
MIXED = [(0, 7), (13, 1), (30, 5), (0, 1), (21, 1)]  # prefill, decode, chunk, 1-token prompt
# Relative error of the output against the unquantized K/V: e4m3 rounds each value to 3 mantissa
# bits (up to 2^-4 relative, 3.6% RMS), e5m2 to 2 bits (7.2% RMS); the output's error is of that
# order (FlashInfer's own, measured on the H200: 3.9e-2 and 7.7e-2). Short sequences are noisier.
UNQUANTIZED_RTOL = {E4M3: 6e-2, E5M2: 1.2e-1}


def needs_triton(backend: str) -> None:
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton on CPU tensors needs TRITON_INTERPRET=1 (test_triton_gpu.py on a GPU)")


# ---- the quantization rule ----


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_saturates_rounds_to_nearest_even_and_dequantize_is_exact(dtype):
    limit = fp8_max(dtype)
    x = torch.tensor([1e9, -1e9, limit * 1.04, 0.0, 1.0, -3.0])[:, None, None]  # [T, 1, 1]
    q = quantize(x, None, dtype)
    assert torch.isfinite(q.float()).all()
    assert q.float().flatten().tolist()[:3] == [limit, -limit, limit]  # saturated, never NaN
    assert q.float().flatten().tolist()[3:] == [0.0, 1.0, -3.0]  # representable: exact
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    every = every[torch.isfinite(every)]
    # every finite FP8 value survives a round trip, and a midpoint goes to the even neighbour
    assert torch.equal(quantize(every[:, None, None], None, dtype).float().flatten(), every)
    s = torch.tensor(0.5)
    assert torch.equal(
        dequantize(quantize(every[:, None, None] * 0.5, s, dtype), s).flatten(), every * 0.5
    )


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale_kind", ["none", "layer", "head"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_stores_exactly_the_quantization_rule(backend, scale_kind, dtype):
    needs_triton(backend)
    g = torch.Generator().manual_seed(1)
    num_tokens, heads, dim, block = 24, 2, 32, 4
    key = torch.randn(num_tokens, heads, dim, generator=g) * 3
    value = torch.randn(num_tokens, heads, dim, generator=g)
    # ties, subnormals, saturation and signed zeros, in every scale's units
    key[0, 0, :10] = torch.tensor([1e-4, 3e-3, -2e-3, 1000.0, -1e5, 0.0, -0.0, 7.75, 2**-9, 1.0625])
    k_scale, v_scale = fp8_scales(scale_kind, heads)
    slots = torch.randperm(8 * block, generator=g)[:num_tokens]
    slots[5] = -1
    cache = torch.zeros(8, 2, block, heads, dim, dtype=dtype)
    paged_ops.write_kv(key, value, cache, slots, k_scale=k_scale, v_scale=v_scale, backend=backend)
    expect_k, expect_v = quantize(key, k_scale, dtype), quantize(value, v_scale, dtype)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        stored = cache[slot // block, :, slot % block].view(torch.uint8)  # [2, Hkv, D]
        assert torch.equal(stored[0], expect_k[t].view(torch.uint8)), f"key of token {t}"
        assert torch.equal(stored[1], expect_v[t].view(torch.uint8)), f"value of token {t}"
    # the skipped token wrote nothing: every other slot is still zero
    written = {s for s in slots.tolist() if s >= 0}
    for slot in set(range(8 * block)) - written:
        assert not cache[slot // block, :, slot % block].view(torch.uint8).any()


# ---- attention on an FP8 cache ----


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale_kind", ["layer", "head"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_matches_float64_on_the_dequantized_and_the_unquantized_kv(
    backend, group, scale_kind, dtype
):
    needs_triton(backend)
    heads = 2
    base = make_batch(
        MIXED, num_q_heads=heads * group, num_kv_heads=heads, head_dim=32, block_size=4,
        pad_tokens=2, pad_seqs=1, seed=group,
    )  # fmt: skip
    k_scale, v_scale = fp8_scales(scale_kind, heads)
    batch = quantized_batch(base, dtype, k_scale, v_scale)
    out = write_and_attend(batch, backend, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == torch.float32
    scale = 32**-0.5
    assert_matches_dense(out, batch, dense_batch_f64(batch, scale=scale), rtol=1e-5)
    assert_matches_dense(out, batch, dense_batch_f64(base, scale=scale), UNQUANTIZED_RTOL[dtype])


FEATURES = ["window_4", "softcap", "sinks", "everything"]  # of PADDED_FEATURES (4 query heads)


def _dense(kwargs: dict, head_dim: int) -> dict:
    kwargs = dict(kwargs)
    return dict(
        kwargs, scale=kwargs.pop("scale", head_dim**-0.5), window=kwargs.pop("sliding_window", None)
    )


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_features_on_an_fp8_cache(backend, query_dtype, feature):
    needs_triton(backend)
    kwargs = PADDED_FEATURES[feature]
    base = make_batch(
        MIXED, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=4, dtype=query_dtype,
        pad_tokens=1, seed=3,
    )  # fmt: skip
    k_scale, v_scale = fp8_scales("head", 2)
    batch = quantized_batch(base, E4M3, k_scale, v_scale)
    out = write_and_attend(batch, backend, k_scale=k_scale, v_scale=v_scale, **kwargs)
    assert out.dtype == query_dtype
    tight = 1e-5 if query_dtype == torch.float32 else 3e-3
    dense = _dense(kwargs, 32)
    assert_matches_dense(out, batch, dense_batch_f64(batch, **dense), rtol=tight)
    assert_matches_dense(out, batch, dense_batch_f64(base, **dense), UNQUANTIZED_RTOL[E4M3])


@pytest.mark.parametrize("num_segments", [2, 4])
@pytest.mark.parametrize("dtype", FP8)
def test_triton_split_kv_on_an_fp8_cache(dtype, num_segments):
    needs_triton("triton")
    base = make_batch(
        [(40, 1), (70, 1), (9, 1)], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=8,
        dtype=torch.float16, pad_seqs=1, seed=7,
    )  # fmt: skip
    k_scale, v_scale = fp8_scales("head", 2)
    batch = quantized_batch(base, dtype, k_scale, v_scale)
    out = write_and_attend(batch, "triton", num_segments, k_scale=k_scale, v_scale=v_scale)
    assert_matches_dense(out, batch, dense_batch_f64(batch, scale=64**-0.5), rtol=3e-3)


DECODE = [(0, 1), (5, 1), (37, 1), (64, 1), (130, 1)]  # (context, 1 new token): ends mid-tile


@pytest.mark.parametrize("num_segments", [1, 2])
@pytest.mark.parametrize(
    ("group", "feature"),
    [(1, "plain"), (4, "plain"), (8, "plain"), *((2, f) for f in [*FEATURES, "alibi"])],
)
@pytest.mark.parametrize("cache", [*FP8, pytest.param(torch.float32, id="float32")])
def test_triton_decode_with_kv_heads_in_pairs_matches_float64(cache, group, feature, num_segments):
    """``LaunchConfig.kv_heads=2`` (FP8 decode at D=64 by default): one program, two KV heads with
    their own scales; each row keeps its own head's half. Spare programs zero the padding rows."""
    from paged_ops.backends import triton as tb

    needs_triton("triton")
    kwargs = PADDED_FEATURES[feature]  # (sinks / ALiBi for 4 query heads: group 2 x 2 KV heads)
    num_kv_heads = 2 if feature != "plain" else 4
    base = make_batch(
        DECODE, num_q_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_dim=64,
        block_size=16, dtype=torch.float16, pad_tokens=2, pad_seqs=1, seed=group,
    )  # fmt: skip
    fp8 = cache != torch.float32
    k_scale, v_scale = fp8_scales("head", num_kv_heads) if fp8 else (None, None)
    batch = quantized_batch(base, cache, k_scale, v_scale) if fp8 else base
    cfg = tb.LaunchConfig(16, 16 // (2 * group), 128, num_segments, 4, 3, kv_heads=2)
    out = write_and_attend(batch, "triton", config=cfg, k_scale=k_scale, v_scale=v_scale, **kwargs)
    dense = _dense(kwargs, 64)
    assert_matches_dense(out, batch, dense_batch_f64(batch, **dense), rtol=3e-3)
    real = int(batch.cu_seqlens_q[-1])
    assert (out[real:] == 0).all(), "padded query rows must be zeros"


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_pairs_decode_every_bit_pattern_exactly(dtype):
    """``_fp8_pairs_to_float16`` (V read as int16 pairs): all 65,536 pairs give both bytes' exact
    values, low byte first (the interpreter's integer path; the GPU's PTX in test_fp8_gpu.py)."""
    needs_triton("triton")
    from fp8_pairs_kernel import all_pairs_and_values, fp8_pairs_to_float16

    pairs, values, finite = all_pairs_and_values(dtype)
    assert finite.sum() >= 60000  # (NaN patterns are never stored: writes saturate)
    lo, hi = fp8_pairs_to_float16(pairs, dtype, by_hand=True)
    assert torch.equal(lo[finite], values[finite, 0])
    assert torch.equal(hi[finite], values[finite, 1])


@pytest.mark.parametrize("num_segments", [1, 2])
@pytest.mark.parametrize(
    ("kv_heads", "group", "feature"),
    [(1, 1, "plain"), (1, 4, "plain"), (1, 8, "plain"), (2, 4, "plain"),
     *((1, 2, f) for f in [*FEATURES, "alibi"]), (2, 2, "everything")],
)  # fmt: skip
@pytest.mark.parametrize("dtype", FP8)
def test_triton_decode_with_v_as_int16_pairs_matches_float64(dtype, kv_heads, group, feature,
                                                             num_segments):  # fmt: skip
    """``LaunchConfig.v_pairs=1`` (FP8 decode's default): V read as int16 pairs, even and odd
    columns accumulated apart and interleaved at the end; one or two KV heads per program, with
    per-head scales; padding rows zero. The same step with V read as bytes agrees to fp32
    rounding."""
    from paged_ops.backends import triton as tb

    needs_triton("triton")
    kwargs = PADDED_FEATURES[feature]  # (sinks / ALiBi for 4 query heads)
    num_kv_heads = 4 if feature == "plain" else 4 // group
    base = make_batch(
        DECODE, num_q_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_dim=64,
        block_size=16, dtype=torch.float16, pad_tokens=2, pad_seqs=1, seed=5 + group,
    )  # fmt: skip
    k_scale, v_scale = fp8_scales("head", num_kv_heads)
    batch = quantized_batch(base, dtype, k_scale, v_scale)
    cfg = tb.LaunchConfig(16, 16 // (kv_heads * group), 128, num_segments, 4, 3,
                          kv_heads=kv_heads, v_pairs=1)  # fmt: skip
    out = write_and_attend(batch, "triton", config=cfg, k_scale=k_scale, v_scale=v_scale, **kwargs)
    dense = _dense(kwargs, 64)
    assert_matches_dense(out, batch, dense_batch_f64(batch, **dense), rtol=3e-3)
    assert_matches_dense(out, batch, dense_batch_f64(base, **dense), UNQUANTIZED_RTOL[dtype])
    real = int(batch.cu_seqlens_q[-1])
    assert (out[real:] == 0).all(), "padded query rows must be zeros"
    bytes_cfg = dataclasses.replace(cfg, v_pairs=0)
    out_bytes = write_and_attend(
        batch, "triton", config=bytes_cfg, k_scale=k_scale, v_scale=v_scale, **kwargs
    )
    torch.testing.assert_close(out, out_bytes, rtol=1e-3, atol=1e-4)


def test_v_pairs_is_fp8_decodes_default_and_refused_where_the_cache_does_not_fit():
    from paged_ops.backends import triton as tb

    needs_triton("triton")
    shape = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, max_kv_len=4096, num_sms=132)
    assert tb.launch_config(num_tokens=8, num_seqs=8, fp8_cache=True, **shape).v_pairs == 1
    assert tb.launch_config(num_tokens=8, num_seqs=8, **shape).v_pairs == 0
    assert tb.launch_config(num_tokens=512, num_seqs=2, fp8_cache=True, **shape).v_pairs == 0
    # head size 48 (not a power of two): the default drops v_pairs, a forced config is refused
    base = make_batch(
        DECODE, num_q_heads=4, num_kv_heads=2, head_dim=48, block_size=16,
        dtype=torch.float16, seed=3,
    )  # fmt: skip
    k_scale, v_scale = fp8_scales("head", 2)
    batch = quantized_batch(base, E4M3, k_scale, v_scale)
    out = write_and_attend(batch, "triton", k_scale=k_scale, v_scale=v_scale)
    assert_matches_dense(out, batch, dense_batch_f64(batch, scale=48**-0.5), rtol=3e-3)
    forced = tb.LaunchConfig(16, 8, 128, 1, 4, 3, v_pairs=1)
    with pytest.raises(ValueError, match="v_pairs=1"):
        write_and_attend(batch, "triton", config=forced, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("scales", ["head", "layer"])
@pytest.mark.parametrize("dtype", FP8)
def test_triton_prefill_kernel_on_an_fp8_cache_matches_dense_f64(dtype, scales):
    # Long-prompt steps on an FP8 cache take the prefill kernel (float16 dots, scales folded in);
    # forced here with small tiles: prompts, a chunk after context and a decode row, GQA 4.
    needs_triton("triton")
    from paged_ops.backends.triton import LaunchConfig

    base = make_batch(
        [(0, 37), (21, 19), (0, 5), (30, 1)], num_q_heads=8, num_kv_heads=2, head_dim=64,
        block_size=8, dtype=torch.float16, pad_seqs=1, seed=13,
    )  # fmt: skip
    k_scale, v_scale = fp8_scales(scales, 2)
    batch = quantized_batch(base, dtype, k_scale, v_scale)
    cfg = LaunchConfig(block_m=16, block_q=4, tile_n=16, num_segments=1, num_warps=4,
                       num_stages=2, kernel="prefill")  # fmt: skip
    out = write_and_attend(batch, "triton", config=cfg, k_scale=k_scale, v_scale=v_scale)
    assert_matches_dense(out, batch, dense_batch_f64(batch, scale=64**-0.5), rtol=3e-3)
    rtol = UNQUANTIZED_RTOL[dtype]
    assert_matches_dense(out, batch, dense_batch_f64(base, scale=64**-0.5), rtol)


def test_triton_matches_reference_on_the_same_fp8_cache_bit_for_bit_in_the_write():
    needs_triton("triton")
    base = make_batch(MIXED, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, seed=9)
    k_scale, v_scale = fp8_scales("head", 2)
    outs, caches = [], []
    for backend in BACKENDS:
        batch = quantized_batch(base, E4M3, k_scale, v_scale)
        outs.append(write_and_attend(batch, backend, k_scale=k_scale, v_scale=v_scale))
        caches.append(batch.kv_cache.view(torch.uint8))
    assert torch.equal(caches[0], caches[1])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


# ---- ops contract and checks ----


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale_kind", ["none", "layer", "head"])
def test_opcheck_with_an_fp8_cache(scale_kind, backend):
    # test_schema is left out: its schema-check mode multiplies every tensor argument, which
    # torch has no CPU kernel for in float8 (the schema is the same one opcheck checks on float
    # caches in test_ops_contract.py)
    needs_triton(backend)
    base = make_batch(
        [(3, 4), (5, 1)], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
        dtype=torch.float16, pad_tokens=1, pad_seqs=1,
    )  # fmt: skip
    k_scale, v_scale = fp8_scales(scale_kind, 2)
    batch = quantized_batch(base, E4M3, k_scale, v_scale)
    torch.library.opcheck(
        torch.ops.paged_ops.write_kv.default,
        (batch.new_key, batch.new_value, batch.kv_cache, batch.slot_mapping, k_scale, v_scale,
         backend),
        test_utils=OPCHECK_UTILS,
    )  # fmt: skip
    args = (batch.query, batch.kv_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_table)
    torch.library.opcheck(
        torch.ops.paged_ops.paged_attention.default,
        (*args, 0.25, True, 3, 4.0, None, None, k_scale, v_scale, backend, -1),
        test_utils=OPCHECK_UTILS,
    )


OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _fp8_call(**overrides):
    base = make_batch([(3, 2)], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    batch = quantized_batch(base, E4M3, None, None)
    kwargs = dict(k_scale=torch.tensor(0.5), v_scale=torch.tensor(0.5), backend="reference")
    kwargs.update(overrides)
    return batch, kwargs


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (dict(k_scale=0.5), TypeError, "k_scale must be a float32 tensor"),
        (dict(v_scale=torch.tensor(0.5, dtype=torch.float64)), TypeError, "v_scale must be"),
        (dict(k_scale=torch.ones(3)), ValueError, r"shape \[\] \(per layer\) or \[Hkv\] = \[2\]"),
        (dict(v_scale=torch.ones(1, 2)), ValueError, "v_scale must have shape"),
        (dict(k_scale=torch.ones((), device="meta")), ValueError, "k_scale is on meta"),
    ],
    ids=["python_float", "float64", "three_heads", "2d", "device"],
)
def test_bad_scales_raise_before_any_kernel(overrides, error, match):
    batch, kwargs = _fp8_call(**overrides)
    before = batch.kv_cache.view(torch.uint8).clone()
    with pytest.raises(error, match=match):
        paged_ops.write_kv(batch.new_key, batch.new_value, batch.kv_cache, batch.slot_mapping,
                           **kwargs)  # fmt: skip
    assert torch.equal(batch.kv_cache.view(torch.uint8), before)
    with pytest.raises(error, match=match):
        paged_ops.paged_attention(batch.query, batch.kv_cache, batch.cu_seqlens_q, batch.seq_lens,
                                  batch.block_table, **kwargs)  # fmt: skip


def test_scales_for_a_float_cache_and_fp8_queries_are_refused():
    batch = make_batch([(3, 2)], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="scales apply only to an FP8 cache"):
        paged_ops.paged_attention(batch.query, batch.kv_cache, batch.cu_seqlens_q, batch.seq_lens,
                                  batch.block_table, k_scale=torch.tensor(1.0))  # fmt: skip
    with pytest.raises(ValueError, match="scales apply only to an FP8 cache"):
        paged_ops.write_kv(batch.new_key, batch.new_value, batch.kv_cache, batch.slot_mapping,
                           v_scale=torch.tensor(1.0))  # fmt: skip
    fp8 = quantized_batch(batch, E4M3, None, None)
    with pytest.raises(TypeError, match="query dtype must be one of .* got torch.float8_e4m3fn"):
        paged_ops.paged_attention(fp8.query.to(E4M3), fp8.kv_cache, fp8.cu_seqlens_q,
                                  fp8.seq_lens, fp8.block_table)  # fmt: skip
    with pytest.raises(TypeError, match="key dtype must be one of"):
        paged_ops.write_kv(fp8.new_key.to(E5M2), fp8.new_value, fp8.kv_cache, fp8.slot_mapping)


def test_kv_cache_dtype_names():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype(None, torch.float16) == torch.float16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == E4M3
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) == E4M3
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16) == E5M2
    assert resolve_kv_cache_dtype(E5M2, torch.float32) == E5M2
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("int8", torch.bfloat16)
    with pytest.raises(ValueError, match="must be the model's dtype"):
        resolve_kv_cache_dtype(torch.float16, torch.bfloat16)
    with pytest.raises(TypeError, match="kv_cache_dtype must be a str or a torch.dtype"):
        resolve_kv_cache_dtype(8, torch.bfloat16)


# ---- PagedAttention ----


def _pa(**kwargs) -> paged_ops.PagedAttention:
    args = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, num_blocks=16,
                max_model_len=64, block_size=4)  # fmt: skip
    args.update(kwargs)
    return paged_ops.PagedAttention(**args)


def test_memory_budget_holds_twice_the_blocks_of_bfloat16():
    budget = 1 << 20
    bf16 = _pa(num_blocks=None, memory_budget_bytes=budget, dtype=torch.bfloat16)
    fp8 = _pa(num_blocks=None, memory_budget_bytes=budget, dtype=torch.bfloat16,
              kv_cache_dtype="fp8")  # fmt: skip
    assert fp8.kv_cache.data.dtype == E4M3 and fp8.kv_cache_dtype == E4M3
    assert fp8.kv_cache.num_blocks == 2 * bf16.kv_cache.num_blocks
    assert fp8.kv_cache.data.nbytes <= budget


def test_set_kv_scales_per_layer_and_per_head_and_its_checks():
    pa = _pa(kv_cache_dtype="fp8_e5m2")
    assert torch.equal(pa.k_scales, torch.ones(2, 2))
    pa.set_kv_scales([0.5, torch.tensor([0.25, 0.125])], 2.0)
    assert pa.k_scales.tolist() == [[0.5, 0.5], [0.25, 0.125]]
    assert pa.v_scales.tolist() == [[2.0, 2.0], [2.0, 2.0]]
    with pytest.raises(ValueError, match="got 3 values for 2 layers"):
        pa.set_kv_scales([1.0, 1.0, 1.0], 1.0)
    with pytest.raises(ValueError, match=r"k_scales\[0\] has 3 values"):
        pa.set_kv_scales(torch.ones(3), 1.0)
    with pytest.raises(ValueError, match="finite and > 0"):
        pa.set_kv_scales(1.0, 0.0)
    with pytest.raises(ValueError, match="apply to an FP8 cache"):
        _pa().set_kv_scales(1.0, 1.0)
    with pytest.raises(ValueError, match="calculate_kv_scales=True needs an FP8 cache"):
        _pa(calculate_kv_scales=True)


def _step(pa: paged_ops.PagedAttention, batch: dict, seed: int, scale: float = 1.0):
    md = pa.prepare(batch)
    g = torch.Generator().manual_seed(seed)
    t = md.num_tokens

    def rand(h):
        return torch.randn(t, h, 16, generator=g) * scale

    qkv = [(rand(4), rand(2), rand(2)) for _ in range(2)]
    outs = [pa(i, *qkv[i]) for i in range(2)]
    return md, qkv, outs


def test_calculate_kv_scales_measures_the_first_step_then_keeps_them():
    pa = _pa(kv_cache_dtype="fp8", calculate_kv_scales=True, num_blocks=32)
    md, qkv, _ = _step(pa, {"a": 5, "b": 3}, seed=0, scale=3.0)
    real = md.slot_mapping >= 0
    for i, (_, k, v) in enumerate(qkv):
        expect_k = k[real].abs().amax(dim=(0, 2)) / (448.0 / 2)
        expect_v = v[real].abs().amax(dim=(0, 2)) / (448.0 / 2)
        torch.testing.assert_close(pa.k_scales[i], expect_k, rtol=0, atol=0)
        torch.testing.assert_close(pa.v_scales[i], expect_v, rtol=0, atol=0)
    fixed = pa.k_scales.clone(), pa.v_scales.clone()
    _step(pa, {"a": 1, "b": 1}, seed=1, scale=100.0)  # larger values later: scales stay
    assert torch.equal(pa.k_scales, fixed[0]) and torch.equal(pa.v_scales, fixed[1])
    pa.recalibrate_kv_scales()
    _step(pa, {"c": 4}, seed=2, scale=0.5)
    assert not torch.equal(pa.k_scales, fixed[0])


def test_fp8_module_matches_a_float_module_within_fp8_error_and_reads_its_own_writes():
    fp8 = _pa(kv_cache_dtype="fp8", num_blocks=32)
    fp8.set_kv_scales(0.01, 0.01)
    ref = _pa(num_blocks=32)
    for step, batch in enumerate([{"a": 9, "b": 4}, {"a": 1, "b": 1}, {"a": 2, "c": 6}]):
        _, _, outs = _step(fp8, batch, seed=step)
        _, _, expect = _step(ref, batch, seed=step)
        for got, want in zip(outs, expect, strict=True):
            assert (got - want).norm() / want.norm() < UNQUANTIZED_RTOL[E4M3]
    # the cache holds exactly the quantized keys of the float cache
    a = ref.kv_cache.data
    torch.testing.assert_close(
        dequantize(fp8.kv_cache.data[:, :, 0].flatten(0, 2), torch.tensor(0.01)),
        dequantize(quantize(a[:, :, 0].flatten(0, 2), torch.tensor(0.01), E4M3), torch.tensor(0.01)),
        rtol=0, atol=0,
    )  # fmt: skip
