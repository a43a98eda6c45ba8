"""The graph prebuild's prediction (paged_ops/engine/graph_prebuild.py) on the CPU: from the
graph the engine's first compile traced at one step, each projection, norm and argmax call with
the arguments it gets at other steps. (Named for norm_fusion: the torch 2.11 leg, whose triton
cannot interpret, skips it with the other fold tests.)"""

from __future__ import annotations

import os

import pytest
import torch

from paged_ops.engine import graph_prebuild, runner
from paged_ops.engine.mlp_fusion import down_norm_projections, silu_mul_projection
from paged_ops.engine.norm_fusion import norm_projections

VOCAB = 96


def _traced_graph(monkeypatch: pytest.MonkeyPatch, layers: int = 3) -> tuple:
    """An LLM's first compile on the CPU (small_linears, the default folds): the graph and
    inputs its backend's ``on_graph`` saw, the LLM's warm-up shapes, the model."""
    from engine_models import tiny_llama

    from paged_ops import LLM

    pytest.importorskip("paged_ops.backends.triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU tensors under TRITON_INTERPRET=1")
    monkeypatch.setattr(runner, "INNER_BACKEND", "aot_eager")
    seen = []

    def on_graph(self, gm, example_inputs):  # noqa: ANN001
        seen.append((gm, list(example_inputs)))

    monkeypatch.setattr(runner.ModelRunner, "_prebuild_from_graph", on_graph)
    torch._dynamo.reset()
    model = tiny_llama(seed=3, layers=layers, vocab=VOCAB)
    llm = LLM(model, backend="triton", block_size=4, max_num_seqs=4, max_model_len=40,
              num_blocks=32, compile=True, small_linears=True)  # fmt: skip
    shapes = llm.runner._warm_up_shapes()
    llm.close()
    return seen, shapes, model


def test_the_traced_graphs_calls_get_each_steps_sizes(monkeypatch):
    seen, shapes, model = _traced_graph(monkeypatch)
    assert len(seen) == 1  # the forward's one compile: on_graph saw it once, after the passes
    gm, inputs = seen[0]
    traced = shapes[0]
    assert traced == (16, 2)  # T and S differ there: the prediction can tell them apart
    cfg = model.config
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head = hidden // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head
    small_linear = torch.ops.paged_ops.small_linear.default
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    # 3 layers: layer 0's q/k/v (no residual add before its norm) and o x 3 through small_linear,
    # with the LM head; each layer's gate/up norm, its MLP and (layers 0-1) the next layer's
    # q/k/v norm in one add_rms_norm_gated_mlp
    gated = torch.ops.paged_ops.add_rms_norm_gated_mlp.default
    assert sum(n.target is small_linear for n in nodes) == 5
    assert sum(n.target is gated for n in nodes) == 3
    assert not any(
        n.target in (norm_projections, down_norm_projections, silu_mul_projection) for n in nodes
    )
    for tokens, seqs in [(1, 1), (2, 2), (7, 3), (40, 4)]:
        calls = graph_prebuild.calls_at(gm, inputs, traced, (tokens, seqs))
        # one per signature, not one per layer; each target's calls by their shapes
        by = {}
        for target, args, kwargs in calls:
            shapes_of = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
            by.setdefault(target, set()).add((shapes_of, tuple(sorted(kwargs.items()))))
        assert by[small_linear] == {
            (((1, tokens, hidden), (qkv, hidden), None), ()),  # layer 0's q/k/v, stacked
            (((1, tokens, hidden), (hidden, hidden), None), ()),  # o
            (((1, seqs, hidden), (VOCAB, hidden), None), ()),  # LM head: a row per sequence
        }
        row, eps = (1, tokens, hidden), cfg.rms_norm_eps
        mlp = (row, row, (hidden,), eps, (2 * inter, hidden), (hidden, inter))
        assert by[gated] == {
            (mlp, ()),  # layer 2's MLP, read by the final norm
            ((*mlp, (hidden,), eps, (qkv, hidden)), ()),  # layers 0-1's, then the next q/k/v
        }
        assert len(calls) == 5
        for target, args, kwargs in calls:  # each runs (the CPU route) on the made arguments
            out = target(*args, **kwargs)
            first = out[0] if isinstance(out, tuple) else out
            assert first.shape[:2] == (1, seqs if args[1].shape[0] == VOCAB else tokens)


def test_weights_are_the_models_own_and_unknown_sizes_are_left_out(monkeypatch):
    seen, shapes, model = _traced_graph(monkeypatch, layers=2)
    gm, inputs = seen[0]
    params = {p.data_ptr() for p in model.parameters()}
    calls = graph_prebuild.calls_at(gm, inputs, shapes[0], (5, 2))
    (_, args, _), *_ = [c for c in calls if c[0] is torch.ops.paged_ops.small_linear.default]
    assert args[1].data_ptr() in params  # the o projection's weight, not a copy
    # T = S in the traced step: the sizes cannot be told apart, nothing is predicted
    assert graph_prebuild.calls_at(gm, inputs, (2, 2), (5, 2)) == []
    # a step whose sizes the graph's symbols cannot take (no symbol traced at 16 or 2)
    assert graph_prebuild.calls_at(gm, inputs, (17, 3), (5, 2)) == []
