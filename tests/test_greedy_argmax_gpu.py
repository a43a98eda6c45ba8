"""paged_ops::greedy_argmax on a CUDA device: bfloat16 at a 128k vocabulary vs ``torch.argmax``.

Run with ``python -m pytest -q -m gpu tests/test_greedy_argmax_gpu.py`` on a CUDA machine.
"""

import pytest
import torch

from paged_ops import argmax

pytestmark = pytest.mark.gpu
VOCAB = 128256


@pytest.mark.parametrize("rows", [1, 2, 7, 64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_torch_argmax(rows, dtype):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, VOCAB, generator=g, device="cuda").to(dtype)  # [S, V]
    x[0, 100] = x[0, VOCAB - 7] = x[0].max() + 1  # a tie across parts: the first
    if rows > 1:
        x[1, :] = float("-inf")
        x[1, 3] = float("nan")
    assert argmax.greedy_argmax(x).tolist() == x.argmax(-1).tolist()


def test_in_a_cuda_graph_with_a_compiled_caller():
    x = torch.randn(64, VOCAB, device="cuda", dtype=torch.bfloat16)
    f = torch.compile(lambda t: argmax.greedy_argmax(t * 2), fullgraph=True, dynamic=True)
    f(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert out.tolist() == x.argmax(-1).tolist()
