"""GPU: graphs cut out of one capture (paged_ops.engine.graph_split) replay what they captured."""

from __future__ import annotations

import pytest
import torch

from paged_ops.engine import graph_split

pytestmark = pytest.mark.gpu


def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # [B, K] -> [B, K]
    return torch.relu(x @ w).mul_(2.0) + x  # a matmul, a fused pointwise op, an in-place one


def test_each_segment_replays_its_own_forward_alone():
    torch.manual_seed(0)
    w = torch.randn(64, 64, device="cuda") / 8
    inputs = {b: torch.zeros(b, 64, device="cuda") for b in (8, 4, 1)}  # static input buffers
    for x in inputs.values():
        forward(x, w)  # warm-up (cuBLAS handles) outside the capture
    torch.cuda.synchronize()
    capture = graph_split.SegmentedCapture()
    outputs = {}
    with capture.recording():
        for b, x in inputs.items():
            with capture.segment(b):
                outputs[b] = forward(x, w)
    graphs = capture.graphs()
    assert sorted(graphs) == [1, 4, 8]
    # Replays in any order, each on new inputs, give their own forward's result. The graphs
    # share one memory pool as per-bucket captures did: one bucket's replay may reuse memory
    # that holds another bucket's outputs (the engine reads a graph's outputs right after its
    # replay, in stream order).
    for _ in range(3):
        for b in (1, 8, 4):
            inputs[b].copy_(torch.randn(b, 64, device="cuda"))
            graphs[b].replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(outputs[b], forward(inputs[b], w))


def test_a_segment_twice_and_graphs_outside_recording_are_errors():
    capture = graph_split.SegmentedCapture()
    with pytest.raises(RuntimeError, match="outside recording"), capture.segment(1):
        pass
    x = torch.ones(4, device="cuda")
    with pytest.raises(ValueError, match="recorded twice"), capture.recording():
        with capture.segment(1):
            x.add_(1)
        with capture.segment(1):
            x.add_(1)
