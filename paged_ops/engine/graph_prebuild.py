"""Compile the kernel variants of paged_ops' own projection, norm and argmax ops, predicted from
the compiled graph, in a child process beside the rest of the first start's compile.

:mod:`paged_ops.engine.variant_prebuild` builds the attention's variants (and the split-K
GEMM's) from the engine's sizes before the compile starts. The other Triton kernels of ours that
a step runs (the one-row GEMVs of ``small_linear``, ``add_rms_norm_linear``,
``silu_mul_linear``, the add + RMSNorm and SiLU-mul kernels of their several-row routes, the
greedy argmax's two kernels) depend on which ops the graph passes put where, so they compiled in
the LLM's own process: ~0.9 s in the first step after Inductor's compile and ~3.3 s more in the
warm-up's later steps and graph runs on an H200's first start (benchmarks/NOTES.md section 39:
``small_linear_kernel`` 6 variants, ``argmax_parts_kernel`` 6, ``add_rms_norm_gemv_kernel`` 2,
``argmax_combine_kernel`` 5, ...).

How: the compile backend (``fusion.compile_backend(on_graph=...)``) hands over the Dynamo graph
after the passes and before Inductor, whose lowering and code generation then take most of the
compile. :func:`predicted_calls` picks the graph's calls of those ops (:func:`graph_targets`),
one per distinct signature (the layers' calls differ only in their weights), and gives each
concrete arguments for every warm-up and graph step ``(T, S)``: the graph's symbolic sizes are
mapped to T and S by their values in the traced step (the warm-up's first, whose T and S differ),
every tensor is a fresh one of the traced dtype, device, sizes, strides and storage offset, and a
weight (a graph input of fixed shape) is the model's own. :func:`start` makes these calls while
``variant_prebuild.recording_variants`` records our kernels' new variants (nothing compiles or
launches; cuBLAS and torch's own kernels in the ops run on the placeholder values) and starts the
child that compiles them. A variant it does not foresee (a size not mapped to T or S, a
verify step's logit rows) compiles in the step that meets it, as without it: a wrong prediction
costs the child's time, never a result.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_map

from paged_ops.engine import variant_prebuild

logger = logging.getLogger("paged_ops")

Step = tuple[int, int]  # (T tokens, S sequences)


# what the graph passes add besides the calls of graph_targets(): a stacked weight's view, the
# pieces of a fused call's output (run to make the arguments of the calls that read them)
_EVALUATED = {torch.as_strided, operator.getitem, torch.split, torch._C._nn.linear}


class _Unpredictable(Exception):
    """An argument whose value at another step cannot be told from the graph."""


def graph_targets() -> set[Callable]:
    """The graph call targets whose kernels :func:`predicted_calls` foresees: the projection
    wrappers the graph passes insert and the ops they (or ``route_small_linears`` and the
    engine's greedy choice) call."""
    import paged_ops.argmax
    import paged_ops.gated_mlp
    import paged_ops.linear
    import paged_ops.mlp_linear
    import paged_ops.mlp_norm_linear
    import paged_ops.norm_linear  # noqa: F401  (each registers its op)
    from paged_ops.engine.mlp_fusion import down_norm_projections, silu_mul_projection
    from paged_ops.engine.norm_fusion import norm_projections

    ops = torch.ops.paged_ops
    return {
        norm_projections,
        silu_mul_projection,
        down_norm_projections,
        ops.small_linear.default,
        ops.add_rms_norm_linear.default,
        ops.silu_mul_linear.default,
        ops.silu_mul_add_rms_norm_linear.default,
        ops.add_rms_norm_gated_mlp.default,
        ops.greedy_argmax.default,
    }


def _int(value: Any, sizes: dict) -> int:
    """A size or stride at the step whose symbol values are ``sizes`` (``{symbol: int}``)."""
    if isinstance(value, torch.SymInt):
        try:
            return int(value.node.expr.xreplace(sizes))
        except TypeError as e:  # a symbol that is neither T nor S
            raise _Unpredictable(str(value)) from e
    return int(value)


def _tensor_like(value: torch.Tensor, sizes: dict) -> torch.Tensor:
    """A fresh tensor with ``value``'s dtype, device, sizes, strides and storage offset at the
    step (uninitialised: the recorded kernels never run; others read placeholder values)."""
    shape = [_int(n, sizes) for n in value.shape]
    strides = [_int(s, sizes) for s in value.stride()]
    offset = _int(value.storage_offset(), sizes)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) if all(shape) else 0
    extent = offset + span
    storage = torch.empty(extent, dtype=value.dtype, device=value.device)
    return storage.as_strided(shape, strides, offset)


def _describe(arg: Any) -> Any:
    """A hashable signature of a call argument: a node's traced tensor as dtype, sizes, strides,
    storage offset (symbolic where they vary); a node the passes added (no traced value) as its
    call; anything else as its repr."""
    if isinstance(arg, fx.Node):
        value = arg.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            return (value.dtype, str(tuple(value.shape)), str(value.stride()),
                    str(value.storage_offset()))  # fmt: skip
        if value is None and arg.op == "call_function":
            return (repr(arg.target), _describe(arg.args), _describe(arg.kwargs))
        return ("node", repr(value))
    if isinstance(arg, (list, tuple)):
        return tuple(_describe(a) for a in arg)
    if isinstance(arg, dict):
        return tuple(sorted((k, _describe(v)) for k, v in arg.items()))
    return repr(arg)


def _step_symbols(nodes: Sequence[fx.Node], traced: Step) -> dict[Any, int] | None:
    """``{symbol: 0 (T) or 1 (S)}`` for the symbols in the nodes' traced sizes, told apart by
    their values in the traced step; None where T and S were equal there."""
    tokens, seqs = traced
    if tokens == seqs:
        return None
    which: dict[Any, int] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            value = arg.meta.get("example_value")
            if not isinstance(value, torch.Tensor):
                continue
            for n in (*value.shape, *value.stride(), value.storage_offset()):
                if not isinstance(n, torch.SymInt):
                    continue
                shape_env = n.node.shape_env
                hints = getattr(shape_env, "backed_var_to_val", None)  # (torch >= 2.13)
                hints = shape_env.var_to_val if hints is None else hints
                for symbol in n.node.expr.free_symbols:
                    hint = hints.get(symbol)
                    if hint == tokens:
                        which[symbol] = 0
                    elif hint == seqs:
                        which[symbol] = 1
    return which


def calls_at(
    gm: fx.GraphModule, example_inputs: Sequence[Any], traced: Step, step: Step
) -> list[tuple[Callable, tuple, dict]]:
    """``(target, args, kwargs)`` of each distinct :func:`graph_targets` call of ``gm`` (traced
    at step ``traced``) with arguments for step ``step``: :func:`predicted_calls` for one step."""
    return [(t, a, k) for _, t, a, k in predicted_calls(gm, example_inputs, traced, [step])]


def predicted_calls(
    gm: fx.GraphModule, example_inputs: Sequence[Any], traced: Step, steps: Sequence[Step]
) -> Iterator[tuple[Step, Callable, tuple, dict]]:
    """``(step, target, args, kwargs)``: each distinct :func:`graph_targets` call of ``gm``
    (traced at step ``traced``; ``example_inputs`` its inputs, in placeholder order) with
    arguments for each of ``steps`` in turn (one step's arguments are made when the caller asks
    for its first call); calls with a size that is neither T nor S are left out. The calls are
    picked and the sizes mapped once. An argument the graph passes made (no traced value: a
    stacked weight's view, another fused call's output) is computed by running its node, so
    making the arguments can run such calls (:func:`start` does it while recording)."""
    targets = graph_targets()
    nodes, seen = [], set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in targets:
            continue
        key = (node.target, _describe(node.args), _describe(node.kwargs))
        if key not in seen:
            seen.add(key)
            nodes.append(node)
    which = _step_symbols(nodes, traced)
    if not nodes or which is None:
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = dict(zip(placeholders, example_inputs, strict=False))  # (inputs may be fewer)
    evaluated = _EVALUATED | targets

    for step in steps:
        sizes = {symbol: step[i] for symbol, i in which.items()}
        made: dict[fx.Node, Any] = {}

        def concrete(arg: Any, sizes: dict = sizes, made: dict = made) -> Any:
            if not isinstance(arg, fx.Node):
                return arg
            if arg in made:
                return made[arg]
            value = arg.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                shape = (*value.shape, *value.stride())
                fixed = not any(isinstance(n, torch.SymInt) for n in shape)
                real = inputs.get(arg)  # a weight: the model's own tensor (its pointer's alignment)
                out = (
                    real if fixed and isinstance(real, torch.Tensor) else _tensor_like(value, sizes)
                )
            elif isinstance(value, (int, float, bool, torch.SymInt)):
                out = _int(value, sizes) if isinstance(value, torch.SymInt) else value
            elif value is None and arg.op == "call_function" and arg.target in evaluated:
                # a node the passes added (a stacked weight's view, a fused call's output): run it
                args, kwargs = tree_map(concrete, (tuple(arg.args), dict(arg.kwargs)))
                out = arg.target(*args, **kwargs)
            else:
                raise _Unpredictable(f"{arg.name}: {type(value).__name__}")
            made[arg] = out
            return out

        for node in nodes:
            try:
                args, kwargs = tree_map(concrete, (tuple(node.args), dict(node.kwargs)))
            except _Unpredictable as e:
                logger.debug("graph prebuild: %s at %s left out (%s)", node.name, step, e)
                continue
            yield step, node.target, args, kwargs


def start(
    gm: fx.GraphModule, example_inputs: Sequence[Any], steps: Sequence[Step]
) -> variant_prebuild.Prebuild | None:
    """Record the kernel variants that ``gm``'s projection, norm and argmax calls (traced at
    ``steps[0]``) take at each of ``steps`` and start the child that compiles them; None when
    nothing is new, off (``PAGED_OPS_PREBUILD_VARIANTS=0``) or not on CUDA. Never raises: the
    steps compile what is missing, as without it."""
    if not variant_prebuild.enabled() or not steps:
        return None
    try:
        made = 0
        with torch.inference_mode(), variant_prebuild.recording_variants() as records:
            calls = predicted_calls(gm, example_inputs, steps[0], list(dict.fromkeys(steps)))
            for step, target, args, kwargs in calls:
                if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
                    return None
                try:
                    target(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - that step compiles it
                    logger.debug("graph prebuild: %s at %s failed: %r", target, step, e)
                    continue
                made += 1
        logger.debug("graph prebuild: %d calls, %d new variants", made, len(records))
        if not records:
            return None
        return variant_prebuild.spawn(records, variant_prebuild.current_target())
    except Exception as e:  # noqa: BLE001
        logger.debug("graph prebuild did not start: %r", e)
        return None
