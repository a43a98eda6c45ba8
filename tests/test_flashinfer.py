"""FlashInfer backend on CPU: capability checks, "auto" fallback, host-side planning logic, the
FP8 write fallback and the FP8 scale folding.

No GPU and no flashinfer needed: planning is exercised against a stand-in flashinfer module that
records how the wrappers are built, planned and run.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from paged_testing import fp8_scales, make_batch, quantized_batch

from paged_ops import LayerConfig, MetadataBuilder, SequenceSlice
from paged_ops.backends import LayerSpec, cost_table, reference, resolve_backend
from paged_ops.backends import flashinfer as fi_backend
from paged_ops.backends.flashinfer_host import (
    apply_v_scale_,
    fold_k_scale,
    paged_kv_index,
    scatter_kv,
    step_shape,
)
from paged_ops.fp8 import fp8_max, quantize

CUDA = torch.device("cuda")
SPEC = LayerSpec(head_dim=128, num_q_heads=32, num_kv_heads=8, dtype=torch.bfloat16)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]


def spec(**changes: object) -> LayerSpec:
    return LayerSpec(**{**SPEC.__dict__, **changes})


@pytest.fixture
def flashinfer_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fi_backend, "is_available", lambda: True)
    monkeypatch.setattr(cost_table, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


# ---- capability checks and backend choice ----


def test_supported_layer_on_cuda_has_no_reason():
    assert fi_backend.unsupported_reason(SPEC, CUDA) is None
    assert fi_backend.unsupported_reason(spec(sliding_window=512, softcap=30.0), CUDA) is None
    assert fi_backend.unsupported_reason(spec(causal=False, dtype=torch.float16), CUDA) is None


@pytest.mark.parametrize(
    ("changes", "device", "words"),
    [
        ({}, "cpu", "CUDA devices only"),
        ({"head_dim": 80}, "cuda", "head size 80"),
        ({"dtype": torch.float32}, "cuda", "float32"),
        ({"has_sinks": True}, "cuda", "sinks"),
        ({"has_alibi": True}, "cuda", "ALiBi"),
        ({"dtype": torch.float32, "kv_dtype": E4M3}, "cuda", "query dtype torch.float32"),
        ({"kv_dtype": torch.float16}, "cuda", "cache dtype torch.float16 is neither"),
        ({"kv_dtype": E5M2, "has_sinks": True}, "cuda", "sinks"),
        ({"kv_dtype": E4M3, "head_dim": 96}, "cuda", "head size 96"),
    ],
)
def test_unsupported_layers_get_a_reason(changes, device, words):
    reason = fi_backend.unsupported_reason(spec(**changes), torch.device(device))
    assert reason is not None and words in reason


def test_auto_picks_flashinfer_only_for_measured_prefill_on_a_known_gpu(flashinfer_available):
    # cost_table: FA3 prefill at D=128 beats triton (attention_h200.json); decode/mixed: triton
    assert resolve_backend("auto", SPEC, CUDA, step_kind="prefill") == "flashinfer"
    assert resolve_backend("auto", SPEC, CUDA) == "triton"  # decode, the default kind
    assert resolve_backend("auto", SPEC, CUDA, step_kind="mixed") == "triton"
    windowed = spec(sliding_window=4096)  # not measured: triton ("when in doubt, triton")
    assert resolve_backend("auto", windowed, "cuda:0", step_kind="prefill") == "triton"


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_caches_under_16_bit_queries_are_served(flashinfer_available, dtype, kv_dtype):
    # Per-layer and per-head scales alike: they are folded on the device (no LayerSpec field).
    fp8 = spec(dtype=dtype, kv_dtype=kv_dtype)
    assert fi_backend.unsupported_reason(fp8, CUDA) is None
    assert fi_backend.unsupported_reason(spec(dtype=dtype, kv_dtype=dtype), CUDA) is None
    for kind in ("decode", "prefill", "mixed"):  # triton FP8 decode 1.08-1.67x FlashInfer's
        assert resolve_backend("auto", fp8, CUDA, step_kind=kind) == "triton"
    assert resolve_backend("flashinfer", spec(kv_dtype=kv_dtype, softcap=30.0), CUDA)


@pytest.mark.parametrize("changes", [{"has_sinks": True}, {"head_dim": 80}])
def test_auto_falls_back_to_triton_for_layers_flashinfer_cannot_serve(
    flashinfer_available, changes
):
    assert resolve_backend("auto", spec(**changes), CUDA) == "triton"


def test_auto_is_reference_on_cpu(flashinfer_available):
    assert resolve_backend("auto", SPEC, "cpu") == "reference"


def test_explicit_flashinfer_names_the_limit_and_triton(flashinfer_available):
    with pytest.raises(ValueError) as err:
        resolve_backend("flashinfer", spec(head_dim=80), CUDA)
    message = str(err.value)
    assert "head size 80 is not one of [64, 128, 256]" in message
    assert "backend='triton'" in message


def test_explicit_flashinfer_without_flashinfer_says_it_is_not_available(monkeypatch):
    monkeypatch.setattr(fi_backend, "is_available", lambda: False)
    with pytest.raises(ValueError, match="'flashinfer' is not available"):
        resolve_backend("flashinfer", SPEC, CUDA)


# ---- pure host logic ----


def naive_paged_kv_index(seq_lens: list[int], table: list[list[int]], block_size: int):
    indptr, indices, last = [0], [], []
    for n, row in zip(seq_lens, table, strict=True):
        pages = -(-n // block_size)
        indices += row[:pages]
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * block_size if pages else 1)
    return indptr, indices, last


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_kv_index_matches_a_loop_and_pads_empty_sequences(block_size):
    g = torch.Generator().manual_seed(block_size)
    seq_lens = [1, 54, 97, 0, 16, 0, block_size, block_size + 1]
    width = max(-(-n // block_size) for n in seq_lens) + 2
    table = torch.randint(0, 1000, (len(seq_lens), width), generator=g, dtype=torch.int32)
    got = paged_kv_index(torch.tensor(seq_lens, dtype=torch.int32), table, block_size)
    indptr, indices, last = naive_paged_kv_index(seq_lens, table.tolist(), block_size)
    assert got.indptr.tolist() == indptr
    assert got.indices.tolist() == indices
    assert got.last_page_len.tolist() == last
    assert all(1 <= x <= block_size for x in got.last_page_len.tolist())
    assert {t.dtype for t in (got.indptr, got.indices, got.last_page_len)} == {torch.int32}


def test_step_shape_uses_the_padded_bucket_for_decode_and_real_sequences_for_prefill():
    decode = step_shape(num_seqs=3, padded_num_seqs=8, num_tokens=3, is_decode=True)
    assert (decode.kind, decode.batch_size) == ("decode", 8)
    mixed = step_shape(num_seqs=3, padded_num_seqs=8, num_tokens=40, is_decode=False)
    assert (mixed.kind, mixed.batch_size, mixed.num_tokens) == ("prefill", 3, 40)
    assert step_shape(num_seqs=0, padded_num_seqs=4, num_tokens=0, is_decode=False).kind == "empty"


@pytest.mark.parametrize("slots", [[5, -1, 0, 9, -1], [-1, -1, -1], [-1, 3, -1, 0], [0, 1, 2]])
def test_scatter_kv_matches_reference_and_skips_padding(slots):
    g = torch.Generator().manual_seed(len(slots))
    cache = torch.randn(4, 2, 4, 2, 8, generator=g)
    key, value = torch.randn(2, len(slots), 2, 8, generator=g)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    expected = cache.clone()
    reference.write_kv(key, value, expected, slot_mapping)
    scatter_kv(key, value, cache, slot_mapping)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("kind", ["layer", "head", "none"])
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("slots", [[5, -1, 0, 9, -1, 14], [-1] * 6, [-1, 3, -1, 0, 1, 2]])
def test_scatter_kv_quantizes_bit_for_bit_and_skips_padding(slots, dtype, src_dtype, kind):
    g = torch.Generator().manual_seed(len(slots) + len(kind))
    num_kv_heads = 3
    k_scale, v_scale = fp8_scales(kind, num_kv_heads)
    key, value = (torch.randn(2, len(slots), num_kv_heads, 16, generator=g) * 2).to(src_dtype)
    # saturating (|x| / scale > max, or inf in float16), zero and a value that rounds to zero
    limit = fp8_max(dtype) * (0.011 if kind == "layer" else 1.0)
    key[0, 0, :4] = torch.tensor([limit * 2, -1e30, 0.0, 1e-30]).to(src_dtype)
    cache = quantize(torch.randn(4 * 4, num_kv_heads, 16, generator=g), None, dtype)
    cache = torch.stack([cache, cache.flip(0)]).view(2, 4, 4, num_kv_heads, 16).transpose(0, 1)
    cache = cache.contiguous()  # [N=4, 2, B=4, Hkv, D]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    expected = cache.clone()
    reference.write_kv(key, value, expected, slot_mapping, k_scale, v_scale)
    scatter_kv(key, value, cache, slot_mapping, k_scale, v_scale)
    assert cache.dtype == dtype
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    # ... and the bytes are paged_ops.fp8.quantize's, slot by slot
    keep = slot_mapping >= 0
    stored = cache.transpose(0, 1).reshape(2, 16, num_kv_heads, 16)[:, slot_mapping[keep]]
    want_k = quantize(key[keep], k_scale, dtype)
    want_v = quantize(value[keep], v_scale, dtype)
    assert torch.equal(stored[0].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(stored[1].view(torch.uint8), want_v.view(torch.uint8))
    assert torch.isfinite(cache.float()).all()


def test_fp8_write_kv_falls_back_to_the_torch_scatter_on_cpu():
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 5, 2, 8, generator=g).bfloat16()
    k_scale, v_scale = torch.tensor([0.01, 0.02]), torch.tensor(0.015)
    slots = torch.tensor([3, -1, 0, 7, 1])
    cache = torch.zeros(2, 2, 4, 2, 8, dtype=E4M3)
    expected = cache.clone()
    fi_backend.write_kv(key, value, cache, slots, k_scale, v_scale)  # positional, like the op
    reference.write_kv(key, value, expected, slots, k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


# ---- FP8 scale folding: k_scale into the query, v_scale into the output ----


@pytest.mark.parametrize("kind", ["layer", "head"])
def test_folding_helpers_match_an_explicit_float64_computation(kind):
    g = torch.Generator().manual_seed(1)
    num_kv_heads, group = 3, 4
    k_scale, v_scale = fp8_scales(kind, num_kv_heads)
    query = torch.randn(5, num_kv_heads * group, 8, generator=g).bfloat16()
    folded = fold_k_scale(query, k_scale, num_kv_heads)
    out = torch.randn(5, num_kv_heads * group, 8, generator=g).bfloat16()
    scaled = apply_v_scale_(out.clone(), v_scale, num_kv_heads)
    assert folded.dtype == scaled.dtype == torch.bfloat16
    for h in range(num_kv_heads * group):
        ks = float(k_scale if k_scale.dim() == 0 else k_scale[h // group])
        vs = float(v_scale if v_scale.dim() == 0 else v_scale[h // group])
        # one rounding of the exact float64 product (float32 is exact enough for it)
        assert torch.equal(folded[:, h], (query[:, h].double() * ks).bfloat16())
        assert torch.equal(scaled[:, h], (out[:, h].double() * vs).bfloat16())
    assert fold_k_scale(query, None, num_kv_heads) is query
    assert torch.equal(apply_v_scale_(out.clone(), None, num_kv_heads), out)


FEATURES = [
    dict(),
    dict(window=5, softcap=4.0),
    dict(causal=False),
]


@pytest.mark.parametrize("features", FEATURES, ids=["plain", "window-softcap", "bidirectional"])
@pytest.mark.parametrize("kind", ["layer", "head"])
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_folded_scales_equal_dequantize_then_attend(query_dtype, dtype, kind, features):
    """What the FlashInfer path computes, emulated with the reference backend: attention of the
    scaled query over the stored FP8 values (scale 1), times v_scale; against the reference's
    dequantize-then-attend on the same cache."""
    base = make_batch(
        [(0, 9), (21, 1), (13, 4), (0, 1)],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=query_dtype,
        pad_tokens=2,
        pad_seqs=1,
        seed=3,
    )
    k_scale, v_scale = fp8_scales(kind, 2)
    batch = quantized_batch(base, dtype, k_scale, v_scale)
    reference.write_kv(
        batch.new_key, batch.new_value, batch.kv_cache, batch.slot_mapping, k_scale, v_scale
    )
    constants = dict(
        scale=0.3,
        causal=features.get("causal", True),
        window=features.get("window", 0),
        softcap=features.get("softcap", 0.0),
        sinks=None,
        alibi_slopes=None,
    )
    meta = (batch.kv_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_table)
    expected = reference.paged_attention(
        batch.query, *meta, **constants, k_scale=k_scale, v_scale=v_scale
    )
    folded = reference.paged_attention(fold_k_scale(batch.query, k_scale, 2), *meta, **constants)
    got = apply_v_scale_(folded, v_scale, 2)
    assert got.dtype == query_dtype and not got[int(batch.cu_seqlens_q[-1]) :].any()
    if query_dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    else:  # the scaled query's and the output's roundings: bfloat16/float16 level
        err = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
        assert err < (1e-2 if query_dtype == torch.bfloat16 else 2e-3)


# ---- planner routing against a stand-in flashinfer ----


class _FakeWrapper:
    def __init__(self, workspace: torch.Tensor, layout: str, **kwargs: object) -> None:
        self.layout, self.init_kwargs, self.plans, self.runs = layout, kwargs, [], []

    def plan(self, **kwargs: object) -> None:  # keyword-only, like our calls must be
        self.plans.append(kwargs)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        # no k_scale/v_scale: FlashInfer takes them as host floats, the backend folds its own
        assert out.shape == q.shape and out.dtype == q.dtype
        if self.plans:
            assert kv_cache.dtype == self.plans[-1]["kv_data_type"]  # FlashInfer checks it too
        self.runs.append(q.clone())
        out.copy_(q + 1)  # recognisable, finite
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = type("Prefill", (_FakeWrapper,), {})
    module.BatchDecodeWithPagedKVCacheWrapper = type("Decode", (_FakeWrapper,), {})
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr("paged_ops.backends.flashinfer_planner._FLOAT_WORKSPACE_BYTES", 16)
    return module


def make_owner(
    num_q_heads: int = 8, block_size: int = 4, kv_cache_dtype: torch.dtype | None = None
) -> SimpleNamespace:
    builder = MetadataBuilder(
        max_num_tokens=32,
        max_num_seqs=8,
        max_blocks_per_seq=4,
        block_size=block_size,
        num_blocks=32,
    )
    owner = SimpleNamespace(
        num_q_heads=num_q_heads,
        num_kv_heads=2,
        head_dim=64,
        block_size=block_size,
        dtype=torch.bfloat16,
        kv_cache=SimpleNamespace(device=torch.device("cpu")),
        builder=builder,
    )
    if kv_cache_dtype is not None:  # PagedAttention's attribute (absent: the cache is `dtype`)
        owner.kv_cache_dtype = kv_cache_dtype
    return owner


def run_layer(
    planner,
    md,
    cfg: LayerConfig,
    q: torch.Tensor,
    cache: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    return fi_backend.paged_attention(
        q,
        torch.zeros(32, 2, 4, 2, 64, dtype=torch.bfloat16) if cache is None else cache,
        md.cu_seqlens_q,
        md.seq_lens,
        md.block_table,
        scale=64**-0.5,
        causal=cfg.causal,
        window=int(cfg.sliding_window or 0),
        softcap=float(cfg.softcap or 0.0),
        sinks=None,
        alibi_slopes=None,
        k_scale=k_scale,
        v_scale=v_scale,
        plan_handle=planner.handle,
        out=out,
    )


def assert_written_into(planner, md, cfg: LayerConfig, q: torch.Tensor, expected: torch.Tensor):
    """``out=`` (write_kv_and_attend's): the same values, written into the given tensor."""
    given = torch.full_like(q, float("nan"))
    assert run_layer(planner, md, cfg, q, out=given) is given
    assert torch.equal(given, expected)


def test_prefill_plan_is_causal_windowed_and_zeroes_padded_tokens(fake_flashinfer, monkeypatch):
    owner, cfg = make_owner(), LayerConfig(sliding_window=8, softcap=30.0)
    planner = fi_backend.make_planner(owner, cfg)
    slices = [SequenceSlice([3, 1], 2, 5), SequenceSlice([7], 0, 1)]  # mixed: 5 + 1 tokens
    md = owner.builder.build(slices, num_tokens=10, num_seqs=4)
    planner.plan(md)
    plan = planner._prefill.plans[-1]
    assert plan["causal"] is True and plan["window_left"] == 7 and plan["logits_soft_cap"] == 30.0
    assert plan["qo_indptr"].tolist() == [0, 5, 6]  # real sequences only
    assert plan["paged_kv_indptr"].tolist() == [0, 2, 3]
    assert plan["paged_kv_indices"].tolist() == [3, 1, 7]
    assert plan["paged_kv_last_page_len"].tolist() == [3, 1]
    q = torch.randn(10, 8, 64)
    out = run_layer(planner, md, cfg, q)
    assert torch.equal(out[:6], q[:6] + 1) and not out[6:].any()
    assert_written_into(planner, md, cfg, q, out)
    monkeypatch.setattr("paged_ops.backends.flashinfer_planner.capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot be captured"):
        run_layer(planner, md, cfg, q)


def test_decode_plans_use_one_graph_wrapper_per_bucket_replanned_in_place(fake_flashinfer):
    owner, cfg = make_owner(num_q_heads=8), LayerConfig()
    planner = fi_backend.make_planner(owner, cfg)
    wrappers = []
    for lens in ([5, 9, 2], [6, 10], [3, 1, 4]):  # two steps of bucket 4, one new set of sequences
        slices = [SequenceSlice(list(range(4)), n - 1, 1) for n in lens]
        md = owner.builder.build(slices, num_tokens=4, num_seqs=4)
        planner.plan(md)
        wrappers.append(planner._decode[4])
        plan = wrappers[-1].plans[-1]
        assert plan["last_page_len"].tolist() == [(n - 1) % 4 + 1 for n in lens] + [1] * (
            4 - len(lens)
        )
        indptr = plan["indptr"].tolist()
        assert len(indptr) == 5 and indptr[len(lens) :] == [indptr[len(lens)]] * (5 - len(lens))
        q = torch.randn(4, 8, 64)
        out, real = run_layer(planner, md, cfg, q), len(lens)
        assert torch.equal(out[:real], q[:real] + 1) and not out[real:].any()
        assert_written_into(planner, md, cfg, q, out)
    assert wrappers[0] is wrappers[1] is wrappers[2]
    init = wrappers[0].init_kwargs
    assert init["use_cuda_graph"] is True and init["use_tensor_cores"] is True  # group 4
    assert init["paged_kv_last_page_len_buffer"].shape == (4,)
    md = owner.builder.build([SequenceSlice([0], 0, 1)], num_tokens=2, num_seqs=2)
    planner.plan(md)
    assert set(planner._decode) == {2, 4}
    assert planner._decode[2].init_kwargs["use_cuda_graph"] is True


def test_stale_decode_plan_is_refused(fake_flashinfer):
    owner, cfg = make_owner(num_q_heads=2), LayerConfig()
    planner = fi_backend.make_planner(owner, cfg)
    planner.plan(owner.builder.build([SequenceSlice([0], 3, 1)], num_tokens=2, num_seqs=2))
    assert planner._decode[2].init_kwargs["use_tensor_cores"] is False  # group 1
    md = owner.builder.build([SequenceSlice([0], 3, 1)], num_tokens=4, num_seqs=4)
    with pytest.raises(RuntimeError, match="planned a decode step of 2 sequences"):
        run_layer(planner, md, cfg, torch.randn(4, 2, 64))


def test_constants_that_differ_from_the_plan_are_refused(fake_flashinfer):
    owner = make_owner()
    planner = fi_backend.make_planner(owner, LayerConfig())
    md = owner.builder.build([SequenceSlice([0], 0, 3)])
    planner.plan(md)
    with pytest.raises(RuntimeError, match="was made for"):
        run_layer(planner, md, LayerConfig(sliding_window=4), torch.randn(3, 8, 64))


def test_unplanned_call_plans_real_sequences_and_reuses_its_planner(fake_flashinfer, monkeypatch):
    monkeypatch.setattr(fi_backend, "_unplanned", {})

    def call(num_seqs: int, width: int) -> torch.Tensor:
        cu = torch.tensor([0, 3, 4] + [4] * (num_seqs - 2), dtype=torch.int32)
        lens = torch.tensor([7, 1] + [0] * (num_seqs - 2), dtype=torch.int32)
        table = torch.arange(num_seqs * width, dtype=torch.int32).view(num_seqs, width)
        q = torch.randn(6, 8, 64)
        constants = dict(scale=0.125, causal=True, window=0, softcap=0.0)
        cache = torch.zeros(64, 2, 4, 2, 64, dtype=torch.bfloat16)
        out = fi_backend.paged_attention(
            q, cache, cu, lens, table, **constants, sinks=None, alibi_slopes=None, plan_handle=-1
        )
        assert torch.equal(out[:4], q[:4] + 1) and not out[4:].any()
        return out

    call(num_seqs=3, width=2)
    (planner,) = fi_backend._unplanned.values()
    plan = planner._prefill.plans[-1]
    assert plan["qo_indptr"].tolist() == [0, 3, 4] and plan["paged_kv_indices"].tolist() == [
        0,
        1,
        2,
    ]
    call(num_seqs=2, width=2)
    assert list(fi_backend._unplanned.values()) == [planner]  # fits: reused
    call(num_seqs=5, width=3)
    (bigger,) = fi_backend._unplanned.values()
    assert bigger is not planner and bigger.max_num_seqs == 5
    assert bigger._prefill.plans[-1]["paged_kv_indices"].tolist() == [0, 1, 3]


# ---- FP8 caches against the stand-in flashinfer ----


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_plans_carry_the_cache_dtype_and_run_on_fa2(fake_flashinfer, dtype):
    owner = make_owner(num_q_heads=8, kv_cache_dtype=dtype)  # GQA group 4: tensor-core decode
    planner = fi_backend.make_planner(owner, LayerConfig(sliding_window=8))
    assert (planner.dtype, planner.kv_dtype) == (torch.bfloat16, dtype)
    assert planner._prefill.init_kwargs["backend"] == "fa2"  # FA3 needs an FP8 query for FP8 KV
    planner.plan(owner.builder.build([SequenceSlice([3, 1], 2, 5)], num_tokens=6, num_seqs=2))
    prefill = planner._prefill.plans[-1]
    assert prefill["q_data_type"] == torch.bfloat16 and prefill["kv_data_type"] == dtype
    slices = [SequenceSlice([0, 1], 4, 1), SequenceSlice([2], 1, 1)]
    planner.plan(owner.builder.build(slices, num_tokens=2, num_seqs=2))
    decode = planner._decode[2]
    assert decode.init_kwargs["backend"] == "fa2" and decode.init_kwargs["use_tensor_cores"]
    assert decode.plans[-1]["q_data_type"] == torch.bfloat16
    assert decode.plans[-1]["kv_data_type"] == dtype
    # CUDA-core decode (group 1) has no backend choice to make
    small = fi_backend.make_planner(make_owner(num_q_heads=2, kv_cache_dtype=dtype), LayerConfig())
    small.plan(owner.builder.build(slices, num_tokens=2, num_seqs=2))
    assert small._decode[2].init_kwargs["backend"] == "auto"
    assert small._decode[2].plans[-1]["kv_data_type"] == dtype


def test_16_bit_plans_keep_auto_and_the_query_dtype(fake_flashinfer):
    for owner in (make_owner(), make_owner(kv_cache_dtype=torch.bfloat16)):
        planner = fi_backend.make_planner(owner, LayerConfig())
        assert planner.kv_dtype == torch.bfloat16
        assert planner._prefill.init_kwargs["backend"] == "auto"  # FA3 on sm90
        planner.plan(owner.builder.build([SequenceSlice([0], 0, 3)]))
        assert planner._prefill.plans[-1]["kv_data_type"] == torch.bfloat16
        planner.plan(owner.builder.build([SequenceSlice([0], 3, 1)], num_seqs=2))
        assert planner._decode[2].init_kwargs["backend"] == "auto"


def explicit_fold(x: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """``x[:, h] * scale[h // group]`` computed head by head in float64, rounded once."""
    out = torch.empty_like(x)
    for h in range(x.shape[1]):
        s = float(scale if scale.dim() == 0 else scale[h // group])
        out[:, h] = (x[:, h].double() * s).to(x.dtype)
    return out


@pytest.mark.parametrize("kind", ["layer", "head"])
@pytest.mark.parametrize("dtype", FP8)
def test_fp8_scales_are_folded_into_the_query_and_the_output(fake_flashinfer, dtype, kind):
    owner = make_owner(num_q_heads=8, kv_cache_dtype=dtype)
    planner, cfg = fi_backend.make_planner(owner, LayerConfig()), LayerConfig()
    cache = torch.zeros(32, 2, 4, 2, 64, dtype=dtype)
    k_scale, v_scale = fp8_scales(kind, 2)
    g = torch.Generator().manual_seed(0)
    # prefill/mixed (eager wrapper) and decode (graph wrapper, padded to a bucket of 4)
    steps = [
        ([SequenceSlice([3, 1], 2, 5), SequenceSlice([7], 0, 1)], 10, 4, "_prefill"),
        ([SequenceSlice([3, 1], 7, 1), SequenceSlice([7], 1, 1)], 4, 4, "decode"),
    ]
    for slices, num_tokens, num_seqs, wrapper in steps:
        md = owner.builder.build(slices, num_tokens=num_tokens, num_seqs=num_seqs)
        planner.plan(md)
        q = torch.randn(num_tokens, 8, 64, generator=g).bfloat16()
        out = run_layer(planner, md, cfg, q, cache, k_scale, v_scale)
        ran = planner._prefill if wrapper == "_prefill" else planner._decode[num_seqs]
        n = md.num_tokens
        scaled_q = explicit_fold(q, k_scale, 4)
        assert torch.equal(ran.runs[-1][:n], scaled_q[:n])  # the kernel saw q * k_scale[h // 4]
        assert out.dtype == torch.bfloat16
        assert torch.equal(out[:n], explicit_fold(scaled_q[:n] + 1, v_scale, 4))
        assert not out[n:].any()  # padded rows stay zero
    # no scales: the query goes through untouched
    md = owner.builder.build([SequenceSlice([0], 0, 3)])
    planner.plan(md)
    q = torch.randn(3, 8, 64, generator=g).bfloat16()
    out = run_layer(planner, md, cfg, q, cache)
    assert torch.equal(planner._prefill.runs[-1], q) and torch.equal(out, q + 1)


def test_unplanned_calls_get_one_planner_per_cache_dtype(fake_flashinfer, monkeypatch):
    monkeypatch.setattr(fi_backend, "_unplanned", {})
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    lens = torch.tensor([7, 1], dtype=torch.int32)
    table = torch.arange(4, dtype=torch.int32).view(2, 2)
    q = torch.randn(4, 8, 64).bfloat16()
    k_scale, v_scale = torch.tensor(0.5), torch.tensor([2.0, 4.0])
    for dtype in (E4M3, E5M2, torch.bfloat16, E4M3):
        cache = torch.zeros(8, 2, 4, 2, 64, dtype=dtype)
        scales = dict(k_scale=k_scale, v_scale=v_scale) if dtype != torch.bfloat16 else {}
        out = fi_backend.paged_attention(
            q, cache, cu, lens, table, scale=0.125, causal=True, window=0, softcap=0.0,
            sinks=None, alibi_slopes=None, plan_handle=-1, **scales,
        )  # fmt: skip
        if scales:
            assert torch.equal(out, explicit_fold(explicit_fold(q, k_scale, 4) + 1, v_scale, 4))
    planners = list(fi_backend._unplanned.values())
    assert [p.kv_dtype for p in planners] == [E4M3, E5M2, torch.bfloat16]
    assert [p._prefill.plans[-1]["kv_data_type"] for p in planners] == [E4M3, E5M2, torch.bfloat16]
    assert len(planners[0]._prefill.plans) == 2  # the second e4m3 call reused its planner


@pytest.mark.parametrize("group", [4, 1])
def test_jit_specs_build_the_modules_plan_will_use(fake_flashinfer, monkeypatch, group):
    calls = []
    jit = types.ModuleType("flashinfer.jit")
    attention = types.ModuleType("flashinfer.jit.attention")
    attention.gen_batch_prefill_module = lambda *a: calls.append(("prefill", *a)) or a
    attention.gen_batch_decode_module = lambda *a: calls.append(("decode", *a)) or a
    utils = types.ModuleType("flashinfer.utils")

    def determine_attention_backend(device, pos, fp16_qk, custom_mask, dtype_q, dtype_kv):
        # flashinfer 0.6.4 on sm90: FA3 unless the cache is FP8 and the query is not
        return "fa2" if dtype_kv in (E4M3, E5M2) and dtype_q not in (E4M3, E5M2) else "fa3"

    utils.determine_attention_backend = determine_attention_backend
    for name, module in (
        ("flashinfer.jit", jit),
        ("flashinfer.jit.attention", attention),
        ("flashinfer.utils", utils),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    bf16 = torch.bfloat16
    for kv_dtype, prefill in ((E4M3, "fa2"), (bf16, "fa3"), (E5M2, "fa2")):
        calls.clear()
        owner = make_owner(num_q_heads=2 * group, kv_cache_dtype=kv_dtype)
        planner = fi_backend.make_planner(owner, LayerConfig(sliding_window=8, softcap=5.0))
        planner.jit_specs()
        variant = (torch.int32, 64, 64, 0, True, True)
        assert calls[0] == ("prefill", prefill, bf16, kv_dtype, bf16, *variant, False)
        if group >= 4:  # tensor-core decode: FA2 prefill kernels over the same dtype pair
            assert calls[1] == ("prefill", "fa2", bf16, kv_dtype, bf16, *variant, False)
        else:
            assert calls[1] == ("decode", bf16, kv_dtype, bf16, *variant)


def test_the_shared_float_workspace_goes_with_the_last_planner_that_holds_it(monkeypatch):
    """It stayed for the life of the process: 128 MiB left after an LLM's close() on the H100."""
    import gc
    import weakref

    from paged_ops.backends import flashinfer_planner
    from paged_ops.backends.flashinfer_planner import float_workspace

    # an empty registry of the module's own kind (other tests' planners may hold theirs)
    registry = flashinfer_planner._float_workspaces
    monkeypatch.setattr(flashinfer_planner, "_float_workspaces", type(registry)())
    cpu = torch.device("cpu")
    first = float_workspace(cpu)
    assert float_workspace(cpu) is first  # shared while somebody holds it
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None
    assert float_workspace(cpu).numel() == 128 * 1024 * 1024  # a new one when needed again
