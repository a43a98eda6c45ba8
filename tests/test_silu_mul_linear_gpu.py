"""paged_ops::silu_mul_linear on a CUDA device: bfloat16/float16 at Llama-3.2-1B's down projection
(N=2048, I=8192), one row (the FMA GEMV, split-K 4, SiLU-mul in its prologue) and several (the
dot path), against float64 and against the model's own ops; and in a CUDA graph.

Run with ``python -m pytest -q -m gpu tests/test_silu_mul_linear_gpu.py`` on a CUDA machine.
"""

import pytest
import torch
import torch.nn.functional as F

from paged_ops.mlp_linear import silu_mul_linear

pytestmark = pytest.mark.gpu
N, WIDTH = 2048, 8192  # Llama-3.2-1B: hidden size, intermediate size


def make(m, dtype, seed=0):
    """``gate_up [1, M, 2I]`` (the stacked gate/up projection's output) and ``W [N, I]``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = (2 * torch.randn(1, m, 2 * WIDTH, generator=g, device="cuda")).to(dtype)
    weight = (torch.randn(N, WIDTH, generator=g, device="cuda") / WIDTH**0.5).to(dtype)
    return gate_up, weight


def model_ops(gate, up, weight):
    """The compiled model: Inductor's SiLU-mul (float32, rounded once to the dtype), cuBLAS."""
    product = (F.silu(gate.float()) * up.float()).to(gate.dtype)
    return F.linear(product, weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 2, 16])
def test_matches_float64_as_closely_as_the_models_ops(m, dtype):
    gate_up, weight = make(m, dtype, seed=m)
    gate, up = gate_up.chunk(2, -1)  # [1, M, I] each: views of one buffer, as the graph has them
    out = silu_mul_linear(gate, up, weight)
    assert out.shape == (1, m, N) and out.dtype == dtype
    exact = (F.silu(gate.double()) * up.double()) @ weight.double().T
    scale = exact.abs().max().item()
    ours = (out.double() - exact).abs().max().item()
    theirs = (model_ops(gate, up, weight).double() - exact).abs().max().item()
    eager = (F.linear(F.silu(gate) * up, weight).double() - exact).abs().max().item()
    ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    assert ours <= min(theirs, eager) + ulp * scale, (ours, theirs, eager)


def test_one_row_in_a_cuda_graph_reads_each_replays_inputs():
    gate_up, weight = make(1, torch.bfloat16)
    static = gate_up.clone()
    gate, up = static.chunk(2, -1)
    silu_mul_linear(gate, up, weight)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_mul_linear(gate, up, weight)
    for seed in (1, 2):
        new, _ = make(1, torch.bfloat16, seed=seed)
        static.copy_(new)
        graph.replay()
        expected = silu_mul_linear(*new.chunk(2, -1), weight)
        assert torch.equal(out, expected)  # split-K partials summed in a fixed order
