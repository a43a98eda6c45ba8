"""paged_ops::small_linear on a CUDA device: bfloat16 at Llama-3.2-1B's decode shapes vs F.linear.

Run with ``python -m pytest -q -m gpu tests/test_small_linear_gpu.py`` on a CUDA machine.
"""

import pytest
import torch
import torch.nn.functional as F

import paged_ops
from paged_ops import linear
from paged_ops.backends import triton_linear_kernels as kernels

pytestmark = pytest.mark.gpu

SHAPES_1B = {  # name: (N, K)
    "qkv": (3072, 2048),
    "o_proj": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
    "lm_head": (128256, 2048),
}


def make(m, n, k, dtype=torch.bfloat16, bias=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)  # [M, K]
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(dtype)  # [N, K]
    b = torch.randn(n, generator=g, device="cuda").to(dtype) if bias else None
    return x, w, b


def assert_close_to_reference(out, x, w, b):
    ref = (x.double() @ w.double().T + (0 if b is None else b.double())).float()  # [M, N]
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}[x.dtype]
    scale = ref.abs().max().item() + 1
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=tol * scale)
    # as close to float64 as cuBLAS is, to within one bfloat16 rounding of the output
    ours = (out.float() - ref).abs().max().item()
    cublas = (F.linear(x, w, b).float() - ref).abs().max().item()
    assert ours <= cublas + tol * scale


@pytest.mark.parametrize("name", SHAPES_1B)
@pytest.mark.parametrize("m", [1, 4, 16])
def test_bf16_matches_f_linear_at_1b_shapes(name, m):
    n, k = SHAPES_1B[name]
    x, w, b = make(m, n, k, bias=name == "qkv")
    out = paged_ops.small_linear(x[None], w, b)  # [1, M, N]
    assert out.shape == (1, m, n) and out.dtype == torch.bfloat16
    assert_close_to_reference(out[0], x, w, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype):
    x, w, b = make(5, 3072, 2048, dtype=dtype, bias=True)
    assert_close_to_reference(paged_ops.small_linear(x, w, b), x, w, b)


@pytest.mark.parametrize(
    "config",
    [
        kernels.LinearConfig(block_n=16, block_k=256, split_k=4),
        kernels.LinearConfig(block_n=8, block_k=256, split_k=2, use_dot=False),
        kernels.LinearConfig(block_n=64, block_k=128, num_stages=3),
        kernels.LinearConfig(block_n=16, block_k=512, num_warps=8, num_stages=2, use_dot=False),
        # programmatic dependent launch, the weights asked of L2 before the wait; split-K's
        # reduce then waits for the partials the same way
        kernels.LinearConfig(block_n=8, block_k=512, use_dot=False, pdl=True, prefetch_k=2048),
        kernels.LinearConfig(block_n=64, block_k=128, split_k=4, pdl=True, prefetch_k=512),
    ],
    ids=str,
)
@pytest.mark.parametrize("m", [1, 8])
def test_forced_configs_on_a_strided_view_of_stacked_weights(config, m):
    n, k = SHAPES_1B["down"]
    stacked = torch.randn(3 * n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    w = torch.as_strided(stacked, (n, k), (k, 1), storage_offset=n * k)  # the middle third
    x, _, _ = make(m, n, k)
    assert_close_to_reference(kernels.small_linear(x, w, None, config=config), x, w, None)


def test_cuda_graph_replay_and_compile():
    x, w, b = make(4, 3072, 2048, bias=True)
    f = torch.compile(lambda t: paged_ops.small_linear(t, w, b), fullgraph=True)
    expected = f(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(x)
    x.copy_(make(4, 3072, 2048, seed=1)[0])
    graph.replay()
    assert_close_to_reference(out, x, w, b)
    assert not torch.equal(out, expected)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs sm_90+",
)
def test_pdl_launches_wait_for_the_kernel_before_them_in_a_cuda_graph():
    # x -> (eager scale) -> GEMV(pdl) -> GEMV(pdl, split-K) -> (eager add) -> GEMV(pdl): each
    # GEMV may start while its predecessor runs and must still read that predecessor's output
    n, k = SHAPES_1B["down"]
    x, w_down, _ = make(2, n, k)  # x [2, 8192], w_down [2048, 8192]
    _, w_up, _ = make(1, k, n, seed=2)  # [8192, 2048]
    first = kernels.LinearConfig(block_n=8, block_k=512, use_dot=False, pdl=True, prefetch_k=2048)
    split = kernels.LinearConfig(block_n=64, block_k=128, split_k=4, pdl=True, prefetch_k=512)

    def chain(t):
        h = kernels.small_linear(t * 0.5, w_down, None, config=first)  # [2, 2048]
        u = kernels.small_linear(h, w_up, None, config=first)  # [2, 8192]
        d = kernels.small_linear(u, w_down, None, config=split)  # [2, 2048]
        return kernels.small_linear(d + h, w_up, None, config=first)  # [2, 8192]

    def reference(t):
        h = F.linear((t * 0.5).float(), w_down.float()).to(t.dtype)
        u = F.linear(h.float(), w_up.float()).to(t.dtype)
        d = F.linear(u.float(), w_down.float()).to(t.dtype)
        return F.linear((d + h).float(), w_up.float())

    chain(x)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    for seed in (1, 3):
        x.copy_(make(2, n, k, seed=seed)[0])
        graph.replay()
        expected = reference(x)
        err = (out.float() - expected).abs().max() / expected.abs().max()
        assert err < 0.03, f"seed {seed}: relative error {err:.3g}"


def _hopper() -> bool:
    return torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="TMA GEMM: sm_90 only")
@pytest.mark.parametrize("m", [64, 96, 128, 200, 256])
def test_down_projection_at_64_to_256_rows_takes_the_split_k_gemm(m, monkeypatch):
    from paged_ops.backends import triton_gemm_kernels as gemm

    calls = []
    launch = gemm.split_k_gemm
    monkeypatch.setattr(gemm, "split_k_gemm", lambda *a, **k: calls.append(1) or launch(*a, **k))
    n, k = SHAPES_1B["down"]
    x, w, b = make(m, n, k, seed=m)
    paged_ops.small_linear(x, w)  # a step launched from Python keeps cuBLAS (host time)
    assert calls == []
    with linear.graph_kernels():  # what a CUDA graph records (and the engine's warm-up)
        out = paged_ops.small_linear(x, w, b if m == 96 else None)
    assert calls == [1] and out.shape == (m, n) and out.dtype == torch.bfloat16
    assert_close_to_reference(out, x, w, b if m == 96 else None)
    # the other projections keep cuBLAS, and so does the down projection with the switch off
    paged_ops.small_linear(x[:, :2048].contiguous(), make(m, 3072, 2048)[1])
    # an 8B's down projection: split (and served) at 64 rows, unsplit (cuBLAS) at 256
    w8 = make(64, 4096, 14336)[1]
    with linear.graph_kernels():
        paged_ops.small_linear(make(256, 4096, 14336)[0], w8)
        assert calls == [1]
        paged_ops.small_linear(make(64, 4096, 14336)[0], w8)
        assert calls == [1, 1]
        monkeypatch.setenv("PAGED_OPS_SPLIT_K_GEMM", "0")
        paged_ops.small_linear(x, w)
        assert calls == [1, 1]


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="TMA GEMM: sm_90 only")
def test_split_k_gemm_replays_in_a_cuda_graph_on_new_inputs():
    n, k = SHAPES_1B["down"]
    x, w, _ = make(256, n, k)
    stacked = torch.randn(2 * n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    w = torch.as_strided(stacked, (n, k), (k, 1), storage_offset=n * k)  # a view, as fusion makes
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), linear.graph_kernels():
        paged_ops.small_linear(x, w)  # compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_ops.small_linear(x, w)
    for seed in (1, 2):
        x.copy_(make(256, n, k, seed=seed)[0])
        graph.replay()
        assert_close_to_reference(out, x, w, None)
