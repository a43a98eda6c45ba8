"""FlashInfer backend on a CUDA GPU, driven through PagedAttention (prepare -> plan -> op -> run).

Every step's output is compared with the reference backend on the same cache and metadata. The
kernel variants are few on purpose (FlashInfer JIT-compiles each one): bf16, head size 128, two
layer configs (plain; sliding window + softcap) and two GQA groups (4: tensor-core decode; 1: CUDA-
core decode). They are compiled once, in parallel, by the module fixture.

FP8 caches (e4m3, e5m2) under bf16 queries, with per-layer and per-KV-head scales, are compared with
the reference backend on the same FP8 cache and scales: both read ``stored * scale``, so the
tolerance is the bf16 one (FlashInfer folds k_scale into the bf16 query and v_scale into the
output). Their kernels (FA2 prefill over FP8 K/V, CUDA-core decode over FP8) are compiled by
their own fixture.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from paged_testing import make_batch, quantized_batch

import paged_ops
from paged_ops import LayerConfig, PagedAttention
from paged_ops.backends import reference
from paged_ops.backends.flashinfer_host import scatter_kv
from paged_ops.fp8 import quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]

HQ, D, BLOCK = 16, 128, 16
PLAIN = LayerConfig()
SLIDING = LayerConfig(sliding_window=32, softcap=20.0)
TWO_GROUPS = [SLIDING, PLAIN, SLIDING, PLAIN]  # Gemma-2 style interleaving
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]
SCALES = ["layer", "head"]


def make_pa(
    layers: list[LayerConfig], num_kv_heads: int = 4, kv_cache_dtype: torch.dtype | None = None
) -> PagedAttention:
    return PagedAttention(
        num_layers=len(layers),
        num_q_heads=HQ,
        num_kv_heads=num_kv_heads,
        head_dim=D,
        layers=layers,
        block_size=BLOCK,
        num_blocks=128,
        max_num_seqs=8,
        max_model_len=512,
        dtype=torch.bfloat16,
        device="cuda",
        backend="flashinfer",
        kv_cache_dtype=kv_cache_dtype,
    )


def set_scales(pa: PagedAttention, kind: str) -> None:
    """K/V ~ N(0, 1) in bf16 (|x| < ~5.5): per-layer scales 0.02/0.018 or per-KV-head ones
    spanning 0.015-0.03, different per layer; e4m3 saturates only the rare |x| > 448 * scale."""
    num_layers, hkv = len(pa.layers), pa.num_kv_heads
    if kind == "layer":
        pa.set_kv_scales([0.02 + 0.001 * i for i in range(num_layers)], 0.018)
    else:
        heads = torch.linspace(0.015, 0.03, hkv)
        pa.set_kv_scales(
            [heads * (1 + 0.1 * i) for i in range(num_layers)],
            [heads.flip(0) * (1 - 0.05 * i) for i in range(num_layers)],
        )


def layer_scales(pa: PagedAttention, layer: int) -> dict[str, torch.Tensor | None]:
    if pa.k_scales is None:
        return {}
    return dict(k_scale=pa.k_scales[layer], v_scale=pa.v_scales[layer])


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels() -> None:
    from paged_ops.backends.flashinfer import prebuild

    planners = make_pa(TWO_GROUPS).planners + make_pa([PLAIN], num_kv_heads=HQ).planners
    prebuild(planners)


def random_inputs(pa: PagedAttention, t: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Per layer (q [t, Hq, D], k [t, Hkv, D], v [t, Hkv, D]) in bf16; q scaled so softcap bites."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(heads: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(t, heads, D, device="cuda", generator=g) * scale
        return x.to(torch.bfloat16)

    return [(rand(HQ, 4.0), rand(pa.num_kv_heads), rand(pa.num_kv_heads)) for _ in pa.layers]


def reference_output(pa: PagedAttention, layer: int, query: torch.Tensor) -> torch.Tensor:
    md, cfg = pa.metadata, pa.layers[layer]
    return reference.paged_attention(
        query,
        pa.kv_cache.layers[layer],
        md.cu_seqlens_q,
        md.seq_lens,
        md.block_table,
        scale=D**-0.5,
        causal=cfg.causal,
        window=int(cfg.sliding_window or 0),
        softcap=float(cfg.softcap or 0.0),
        sinks=None,
        alibi_slopes=None,
        **layer_scales(pa, layer),  # an FP8 cache: read as stored * scale, like flashinfer
    )


def assert_matches_reference(
    pa: PagedAttention, inputs: list[tuple[torch.Tensor, ...]], outs: list[torch.Tensor]
) -> None:
    n = pa.metadata.num_tokens
    for layer, ((q, _, _), out) in enumerate(zip(inputs, outs, strict=True)):
        assert out.shape == q.shape and out.dtype == q.dtype
        assert torch.isfinite(out.float()).all(), f"layer {layer}: non-finite output"
        ref = reference_output(pa, layer, q)[:n].float()
        err = ((out[:n].float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, f"layer {layer} ({pa.layers[layer]}): relative error {err:.2e}"


def run_step(
    pa: PagedAttention, batch: dict, seed: int, num_tokens: int | None = None, num_seqs=None
) -> None:
    md = pa.prepare(batch, num_tokens=num_tokens, num_seqs=num_seqs)
    inputs = random_inputs(pa, md.padded_num_tokens, seed)
    outs = [pa(layer, *qkv) for layer, qkv in enumerate(inputs)]
    assert_matches_reference(pa, inputs, outs)


def test_prefill_only_matches_reference_and_writes_the_cache():
    pa = make_pa(TWO_GROUPS)
    assert len(pa.planners) == 2 and pa.layer_backends == ["flashinfer"] * 4
    md = pa.prepare({"a": 100, "b": 1, "c": 17}, num_tokens=128, num_seqs=4)
    inputs = random_inputs(pa, md.padded_num_tokens, seed=0)
    before = pa.kv_cache.layers[0].clone()
    outs = [pa(layer, *qkv) for layer, qkv in enumerate(inputs)]
    reference.write_kv(inputs[0][1], inputs[0][2], before, md.slot_mapping)
    assert torch.equal(pa.kv_cache.layers[0], before)
    assert_matches_reference(pa, inputs, outs)
    assert not outs[0][md.num_tokens :].any()  # padded query tokens read zeros


def test_mixed_batch_with_chunked_prefill_matches_reference():
    pa = make_pa(TWO_GROUPS)
    run_step(pa, {"a": 50, "b": 3}, seed=1)
    # a decodes, b continues its prompt in a chunk, c starts: a mixed step.
    run_step(pa, {"a": 1, "b": 40, "c": 33}, seed=2, num_tokens=80, num_seqs=5)
    run_step(pa, {"c": 1, "a": 1, "b": 2}, seed=3)


def test_decode_only_matches_reference_with_padding_and_changing_batches():
    pa = make_pa(TWO_GROUPS)
    run_step(pa, {"a": 40, "b": 7, "c": 129}, seed=4)
    for step in range(3):
        run_step(pa, {"a": 1, "b": 1, "c": 1}, seed=5 + step, num_tokens=4, num_seqs=4)
    run_step(pa, {"a": 1, "b": 1, "c": 1}, seed=8)  # unpadded: bucket 3
    pa.release("b")
    run_step(pa, {"c": 1, "a": 1}, seed=9, num_tokens=8, num_seqs=4)  # more tokens than seqs
    run_step(pa, {"a": 1, "c": 1}, seed=10, num_seqs=4)  # fewer tokens than seqs


def test_cuda_core_decode_and_non_causal_prefill_match_reference():
    pa = make_pa([PLAIN], num_kv_heads=HQ)  # GQA group 1: CUDA-core decode kernel
    run_step(pa, {"a": 70, "b": 5}, seed=10)
    run_step(pa, {"a": 1, "b": 1}, seed=11, num_tokens=4, num_seqs=4)
    bidirectional = make_pa([LayerConfig(causal=False)])
    run_step(bidirectional, {"a": 20, "b": 9}, seed=12, num_tokens=32, num_seqs=3)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_captured_decode_graph_replays_over_new_lengths_and_sequences(compiled):
    pa = make_pa(TWO_GROUPS)
    run_step(pa, {"a": 20, "b": 45, "c": 3}, seed=13)
    run_step(pa, {"d": 70, "e": 16}, seed=14)
    bucket = 4
    static = random_inputs(pa, bucket, seed=15)

    def forward() -> list[torch.Tensor]:
        return [pa(layer, *qkv) for layer, qkv in enumerate(static)]

    fn = torch.compile(forward, fullgraph=True) if compiled else forward
    pa.prepare({"a": 1, "b": 1, "c": 1}, num_tokens=bucket, num_seqs=bucket)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up (compiles); rewrites the same K/V slots
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    steps = [{"a": 1, "b": 1, "c": 1}] * 3 + [{"d": 1, "e": 1}] * 2 + [{"e": 1, "a": 1, "c": 1}]
    for i, batch in enumerate(steps):
        if i:
            pa.prepare(batch, num_tokens=bucket, num_seqs=bucket)
        for (q, k, v), new in zip(static, random_inputs(pa, bucket, seed=16 + i), strict=True):
            q.copy_(new[0])
            k.copy_(new[1])
            v.copy_(new[2])
        graph.replay()
        assert_matches_reference(pa, static, outs)


def test_functional_call_without_plan_matches_reference():
    batch = make_batch(
        [(30, 1), (0, 17), (64, 5)],
        num_q_heads=HQ,
        num_kv_heads=4,
        head_dim=D,
        block_size=BLOCK,
        dtype=torch.bfloat16,
        device="cuda",
        pad_tokens=3,
        pad_seqs=1,
    )
    paged_ops.write_kv(
        batch.new_key, batch.new_value, batch.kv_cache, batch.slot_mapping, backend="flashinfer"
    )
    args = (batch.query, batch.kv_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_table)
    out = paged_ops.paged_attention(*args, backend="flashinfer")
    ref = paged_ops.paged_attention(*args, backend="reference")
    n = int(batch.cu_seqlens_q[-1])
    assert torch.isfinite(out.float()).all() and not out[n:].any()
    err = ((out[:n].float() - ref[:n].float()).norm() / ref[:n].float().norm()).item()
    assert err < 2e-2


def test_torch_kv_write_fallback_skips_padding_inside_a_cuda_graph():
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(8, 2, BLOCK, 4, D, device="cuda", generator=g).to(torch.bfloat16)
    key, value = torch.randn(2, 6, 4, D, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.tensor([5, -1, 17, 0, -1, 100], device="cuda")
    expected = cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scatter_kv(key, value, cache, slots)
    for new_slots in ([5, -1, 17, 0, -1, 100], [-1] * 6, [-1, 3, 2, 1, -1, 127]):
        slots.copy_(torch.tensor(new_slots))
        graph.replay()
        reference.write_kv(key, value, expected, slots)
        assert torch.equal(cache, expected)


# ---- FP8 KV cache ----


@pytest.fixture(scope="module")
def fp8_kernels() -> None:
    """FA2 prefill / tensor-core decode over e4m3 and e5m2 for both layer configs, and CUDA-core
    decode over both (GQA group 1), compiled in parallel."""
    from paged_ops.backends.flashinfer import prebuild

    planners = []
    for dtype in (E4M3, E5M2):
        planners += make_pa(TWO_GROUPS, kv_cache_dtype=dtype).planners
        planners += make_pa([PLAIN], num_kv_heads=HQ, kv_cache_dtype=dtype).planners
    prebuild(planners)


def assert_cache_holds_quantized(pa: PagedAttention, layer: int, before, key, value) -> None:
    """The layer's cache equals ``before`` with this step's K/V written by the reference (which
    quantizes with paged_ops.fp8.quantize), bit for bit."""
    md = pa.metadata
    reference.write_kv(key, value, before, md.slot_mapping, **layer_scales(pa, layer))
    assert torch.equal(pa.kv_cache.layers[layer].view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("kind", SCALES)
@pytest.mark.parametrize("dtype", FP8)
def test_fp8_prefill_mixed_and_decode_match_reference(fp8_kernels, dtype, kind):
    pa = make_pa(TWO_GROUPS, kv_cache_dtype=dtype)
    assert pa.kv_cache.layers[0].dtype == dtype and pa.layer_backends == ["flashinfer"] * 4
    assert [p.kv_dtype for p in pa.planners] == [dtype, dtype]
    set_scales(pa, kind)
    md = pa.prepare({"a": 100, "b": 1, "c": 17}, num_tokens=128, num_seqs=4)
    inputs = random_inputs(pa, md.padded_num_tokens, seed=20)
    before = pa.kv_cache.layers[1].clone()
    outs = [pa(layer, *qkv) for layer, qkv in enumerate(inputs)]
    assert_cache_holds_quantized(pa, 1, before, inputs[1][1], inputs[1][2])
    assert_matches_reference(pa, inputs, outs)
    assert not outs[0][md.num_tokens :].any()
    run_step(pa, {"a": 1, "b": 40, "c": 33}, seed=21, num_tokens=80, num_seqs=5)  # mixed
    for step in range(2):  # decode, padded to a bucket of 4 (one padded sequence)
        run_step(pa, {"a": 1, "b": 1, "c": 1}, seed=22 + step, num_tokens=4, num_seqs=4)
    run_step(pa, {"a": 1, "b": 1, "c": 1}, seed=24)  # unpadded bucket 3


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_cuda_core_decode_matches_reference(fp8_kernels, dtype):
    pa = make_pa([PLAIN], num_kv_heads=HQ, kv_cache_dtype=dtype)  # group 1: CUDA-core decode
    set_scales(pa, "head")
    run_step(pa, {"a": 70, "b": 5}, seed=30)
    run_step(pa, {"a": 1, "b": 1}, seed=31, num_tokens=4, num_seqs=4)
    run_step(pa, {"a": 1, "b": 1}, seed=32)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_captured_decode_graph_replays_with_device_scales(fp8_kernels, compiled):
    """The scales live on the device: a graph captured once replays over new lengths, sequences
    and new scale values (set_kv_scales writes them in place) without recompiling or recapturing.
    """
    pa = make_pa(TWO_GROUPS, kv_cache_dtype=E4M3)
    set_scales(pa, "head")
    run_step(pa, {"a": 20, "b": 45, "c": 3}, seed=40)
    run_step(pa, {"d": 70, "e": 16}, seed=41)
    bucket = 4
    static = random_inputs(pa, bucket, seed=42)

    def forward() -> list[torch.Tensor]:
        return [pa(layer, *qkv) for layer, qkv in enumerate(static)]

    fn = torch.compile(forward, fullgraph=True) if compiled else forward
    pa.prepare({"a": 1, "b": 1, "c": 1}, num_tokens=bucket, num_seqs=bucket)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up (compiles); rewrites the same K/V slots
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    steps = [{"a": 1, "b": 1, "c": 1}] * 2 + [{"d": 1, "e": 1}] * 2 + [{"e": 1, "a": 1, "c": 1}]
    for i, batch in enumerate(steps):
        if i:
            pa.prepare(batch, num_tokens=bucket, num_seqs=bucket)
        if i == 2:  # new scales: the graph reads them from the same tensors
            set_scales(pa, "layer")
        for (q, k, v), new in zip(static, random_inputs(pa, bucket, seed=43 + i), strict=True):
            q.copy_(new[0])
            k.copy_(new[1])
            v.copy_(new[2])
        before = pa.kv_cache.layers[0].clone()
        graph.replay()
        assert_cache_holds_quantized(pa, 0, before, static[0][1], static[0][2])
        assert_matches_reference(pa, static, outs)


@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("kind", SCALES)
@pytest.mark.parametrize("dtype", FP8)
def test_fp8_functional_call_without_plan_matches_reference(dtype, kind, head_dim):
    """The eager path (one planner per geometry and cache dtype); per-layer scales as ``[]``
    tensors here (PagedAttention always passes ``[Hkv]``). Head size 64 is FlashInfer's own
    FP8 layout (64-byte swizzle); its kernels compile on first use."""
    base = make_batch(
        [(30, 1), (0, 17), (64, 5), (200, 1)],
        num_q_heads=HQ,
        num_kv_heads=4,
        head_dim=head_dim,
        block_size=BLOCK,
        dtype=torch.bfloat16,
        device="cuda",
        pad_tokens=3,
        pad_seqs=1,
        seed=head_dim,
    )
    if kind == "layer":
        k_scale, v_scale = torch.tensor(0.021, device="cuda"), torch.tensor(0.017, device="cuda")
    else:
        k_scale = torch.linspace(0.015, 0.03, 4, device="cuda")
        v_scale = k_scale.flip(0) * 0.9
    batch = quantized_batch(base, dtype, k_scale, v_scale)  # the context quantized in the cache
    cache, expected_cache = batch.kv_cache, batch.kv_cache.clone()
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    paged_ops.write_kv(
        batch.new_key, batch.new_value, cache, batch.slot_mapping, backend="flashinfer", **scales
    )
    paged_ops.write_kv(
        batch.new_key, batch.new_value, expected_cache, batch.slot_mapping, backend="reference",
        **scales,
    )  # fmt: skip
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
    args = (batch.query, cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_table)
    out = paged_ops.paged_attention(*args, backend="flashinfer", **scales)
    ref = paged_ops.paged_attention(*args, backend="reference", **scales)
    n = int(batch.cu_seqlens_q[-1])
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all() and not out[n:].any()
    err = ((out[:n].float() - ref[:n].float()).norm() / ref[:n].float().norm()).item()
    assert err < 2e-2, f"relative error {err:.2e}"


@pytest.mark.parametrize("kind", SCALES)
def test_fp8_torch_kv_write_fallback_quantizes_inside_a_cuda_graph(kind):
    g = torch.Generator(device="cuda").manual_seed(1)
    cache = quantize(torch.randn(8, 2, BLOCK, 4, D, device="cuda", generator=g), None, E4M3)
    key, value = (torch.randn(2, 6, 4, D, device="cuda", generator=g) * 3).to(torch.bfloat16)
    if kind == "layer":
        k_scale, v_scale = torch.tensor(0.01, device="cuda"), torch.tensor(0.02, device="cuda")
    else:
        k_scale = torch.linspace(0.005, 0.02, 4, device="cuda")
        v_scale = k_scale.flip(0)
    slots = torch.tensor([5, -1, 17, 0, -1, 100], device="cuda")
    expected = cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scatter_kv(key, value, cache, slots, k_scale, v_scale)
    for new_slots in ([5, -1, 17, 0, -1, 100], [-1] * 6, [-1, 3, 2, 1, -1, 127]):
        slots.copy_(torch.tensor(new_slots))
        k_scale.mul_(1.5)  # read on the device at each replay
        graph.replay()
        reference.write_kv(key, value, expected, slots, k_scale, v_scale)
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
