"""FlashInfer backend on a CUDA GPU, driven through PagedAttention (prepare -> plan -> op -> run).

Every step's output is compared with the reference backend on the same cache and metadata. The
kernel variants are few on purpose (FlashInfer JIT-compiles each one): bf16, head size 128, two
layer configs (plain; sliding window + softcap) and two GQA groups (4: tensor-core decode; 1: CUDA-
core decode). They are compiled once, in parallel, by the module fixture.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from paged_testing import make_batch

import paged_ops
from paged_ops import LayerConfig, PagedAttention
from paged_ops.backends import reference
from paged_ops.backends.flashinfer_host import scatter_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]

HQ, D, BLOCK = 16, 128, 16
PLAIN = LayerConfig()
SLIDING = LayerConfig(sliding_window=32, softcap=20.0)
TWO_GROUPS = [SLIDING, PLAIN, SLIDING, PLAIN]  # Gemma-2 style interleaving


def make_pa(layers: list[LayerConfig], num_kv_heads: int = 4) -> PagedAttention:
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
    )


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
