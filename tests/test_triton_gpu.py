"""The triton backend on a CUDA device: bf16/fp16/fp32 accuracy, split-KV, CUDA graphs, compile.

Run with ``python -m pytest -q -m gpu tests/test_triton_gpu.py`` on a CUDA machine.
"""

import pytest
import torch
from paged_testing import (
    assert_matches_dense,
    attend,
    dense_batch_f64,
    make_batch,
    write_and_attend,
)

import paged_ops
from paged_ops.backends import triton as triton_backend

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_matches_dense_f64(dtype, head_dim, group):
    batch = make_batch(
        [(0, 19), (70, 1), (33, 6), (0, 1), (130, 1)],
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device="cuda",
        pad_tokens=3,
        pad_seqs=1,
        seed=head_dim * group,
    )
    out = write_and_attend(batch, "triton")
    expected = dense_batch_f64(batch, scale=head_dim**-0.5)
    assert_matches_dense(out, batch, expected, rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_decode_batch_matches_dense_f64(dtype, head_dim):
    # decode-like launch (16-row M tile, 64-wide KV tiles at every head size), split and unsplit
    batch = make_batch([(70, 1), (130, 1), (9, 1), (1000, 1)], num_q_heads=8, num_kv_heads=2,
                       head_dim=head_dim, block_size=16, dtype=dtype, device="cuda",
                       seed=head_dim)  # fmt: skip
    expected = dense_batch_f64(batch, scale=head_dim**-0.5)
    for segments in (None, 1):
        out = write_and_attend(batch, "triton", num_segments=segments)
        assert_matches_dense(out, batch, expected, rtol=TOLERANCE[dtype])


FEATURES = {
    "sliding_window": dict(sliding_window=24),
    "softcap": dict(softcap=30.0, scale=0.2),
    "sinks": dict(sinks=torch.linspace(-1.0, 3.0, 16)),
    "alibi": dict(alibi_slopes=torch.tensor([2.0 ** -(i / 2 + 1) for i in range(16)])),
    "non_causal_window": dict(causal=False, sliding_window=10),
}


@pytest.mark.parametrize("num_segments", [None, 8], ids=["auto", "split8"])
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_bfloat16_features_match_reference(feature, num_segments):
    batch = make_batch(
        [(0, 40), (300, 1), (90, 7), (500, 1)],
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        pad_tokens=5,
        seed=11,
    )
    kwargs = {
        k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in FEATURES[feature].items()
    }
    paged_ops.write_kv(batch.new_key, batch.new_value, batch.kv_cache, batch.slot_mapping)
    out = attend(batch, "triton", num_segments=num_segments, **kwargs)
    expected = attend(batch, "reference", **kwargs)
    real = int(batch.cu_seqlens_q[-1])
    err = (out[:real].float() - expected[:real].float()).norm() / expected[:real].float().norm()
    assert err < 1e-2, f"relative error {err:.2e}"
    assert (out[real:] == 0).all()


def realistic_batch(seqs, **kwargs):
    return make_batch(
        seqs,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        **kwargs,
    )


@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 1000), (3000, 1), (0, 300), (5000, 1), (1200, 64)],  # mixed: prefill tiles
        [(8000, 1), (3000, 1)],  # small decode batch, long contexts: auto split-KV
    ],
    ids=["mixed", "decode_split"],
)
def test_llama_shaped_batches_match_reference(seqs):
    batch = realistic_batch(seqs, pad_tokens=2, pad_seqs=1)
    paged_ops.write_kv(batch.new_key, batch.new_value, batch.kv_cache, batch.slot_mapping)
    out = attend(batch, "triton", sliding_window=4096)
    expected = attend(batch, "reference", sliding_window=4096)
    real = int(batch.cu_seqlens_q[-1])
    err = (out[:real].float() - expected[:real].float()).norm() / expected[:real].float().norm()
    assert err < 1e-2, f"relative error {err:.2e}"


def test_small_decode_batches_take_the_split_kv_path():
    t, s = 2, 2
    cfg = triton_backend.launch_config(
        num_tokens=t,
        num_seqs=s,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_kv_len=8192,
        num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
    )
    assert cfg.num_segments > 1


def test_cuda_graph_replays_new_metadata_values():
    # Capture once, then change lengths/tables in place (as the metadata builder does) and replay.
    steps = [[(100, 1), (37, 1), (0, 6)], [(101, 1), (38, 1), (6, 1), (0, 3)]]
    batches = [realistic_batch(seqs, pad_tokens=12 - sum(q for _, q in seqs)) for seqs in steps]
    width = max(b.block_table.shape[1] for b in batches)
    num_blocks = max(b.kv_cache.shape[0] for b in batches)

    def padded(b):
        cu = torch.nn.functional.pad(b.cu_seqlens_q, (0, 5 - b.cu_seqlens_q.shape[0]), value=-1)
        cu[cu < 0] = b.cu_seqlens_q[-1]  # padded sequences repeat the last offset
        lens = torch.nn.functional.pad(b.seq_lens, (0, 4 - b.seq_lens.shape[0]))
        table = torch.nn.functional.pad(b.block_table, (0, width - b.block_table.shape[1]))
        table = torch.nn.functional.pad(table, (0, 0, 0, 4 - table.shape[0]))
        cache = torch.nn.functional.pad(
            b.kv_cache, (0, 0, 0, 0, 0, 0, 0, 0, 0, num_blocks - b.kv_cache.shape[0])
        )
        return cache, cu.int(), lens.int(), table.int()

    static = [t.clone() for t in padded(batches[0])]
    query = batches[0].query.clone()

    def step():
        return triton_backend.paged_attention(
            query, *static, scale=0.088, causal=True, window=0, softcap=0.0, sinks=None,
            alibi_slopes=None,
        )  # fmt: skip

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for b in batches:
        for dst, src in zip(static, padded(b), strict=True):
            dst.copy_(src)
        query.copy_(b.query)
        graph.replay()
        expected = paged_ops.paged_attention(
            query, *static, scale=0.088, backend="reference"
        )  # fmt: skip
        real = int(b.cu_seqlens_q[-1])
        torch.testing.assert_close(out[:real], expected[:real], rtol=2e-2, atol=2e-2)


def test_compiled_module_forward_does_not_recompile_and_matches_reference():
    def build(backend):
        return paged_ops.PagedAttention(
            num_layers=2,
            num_q_heads=8,
            num_kv_heads=2,
            head_dim=64,
            layers=[
                paged_ops.LayerConfig(),
                paged_ops.LayerConfig(sliding_window=16, softcap=20.0),
            ],
            block_size=16,
            num_blocks=64,
            max_num_seqs=4,
            max_model_len=256,
            dtype=torch.bfloat16,
            device="cuda",
            backend=backend,
        )

    tri, ref = build("triton"), build("reference")
    assert tri.layer_backends == ["triton", "triton"]

    def forward(pa, q, k, v):
        return pa(0, q, k, v) + pa(1, q, k, v)

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, dynamic=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    steps = [{"a": 30, "b": 2}, {"a": 1, "b": 1, "c": 20}, {"a": 1, "b": 1, "c": 1, "d": 9}]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in steps:
            for pa in (tri, ref):
                pa.prepare(batch, num_tokens=32, num_seqs=4)
            q = torch.randn(32, 8, 64, device="cuda", generator=g, dtype=torch.bfloat16)
            k = torch.randn(32, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
            v = torch.randn(32, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
            real = sum(batch.values())
            got, expected = compiled(tri, q, k, v)[:real], forward(ref, q, k, v)[:real]
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_opcheck_on_cuda():
    batch = make_batch(
        [(3, 4), (20, 1)],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        pad_tokens=1,
    )
    torch.library.opcheck(
        torch.ops.paged_ops.write_kv.default,
        (batch.new_key, batch.new_value, batch.kv_cache, batch.slot_mapping, None, None, "triton"),
    )
    args = (batch.query, batch.kv_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_table)
    sinks = torch.zeros(4, device="cuda")
    torch.library.opcheck(
        torch.ops.paged_ops.paged_attention.default,
        (*args, 0.125, True, 8, 0.0, sinks, None, None, None, "triton", -1),
    )
