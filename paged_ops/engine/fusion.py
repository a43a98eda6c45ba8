"""Projection fusion: one matmul for the linears that read the same input (q/k/v, gate/up).

At small batch sizes a decode step is a string of matrix-vector products, and cuBLAS runs a
2048 x 512 one (a GQA key or value projection) at a fraction of the memory bandwidth: three
launches for q, k and v cost about as much as one over the stacked weight. Fusing them needs two
steps, neither of which touches the model's forward code:

1. :func:`stack_projection_weights` lays the weights of sibling projections (``q_proj``, ``k_proj``,
   ``v_proj``; ``gate_proj``, ``up_proj``; ``w1``, ``w3``) out back to back in one buffer, and makes
   each module's ``weight`` (and ``bias``) a view into it. Values and the model's behaviour are
   unchanged; memory is the same.
2. :func:`fuse_linears` is a pass over the graph that ``torch.compile`` hands its backend. It finds
   ``linear`` calls that share an input tensor and whose weights are adjacent views of one buffer,
   and replaces them with one ``linear`` over that buffer (an ``as_strided`` view from the first
   weight) followed by a ``split``. :func:`compile_backend` runs it before Inductor.

The pass reads the layout from the actual parameter tensors the graph was traced with; it does not
guard it. :func:`check_stacked` verifies it before each ``generate`` (a weight re-bound to a new
tensor after the model was compiled would make the fused matmul read the wrong memory).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import operator
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn

SIBLING_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
_LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without torch.distributed
        return None
    return DTensor


def _column_sharded(weight: Any) -> bool:
    """A tensor-parallel weight split by output rows over a 1-D mesh (transformers' colwise plan:
    q/k/v, gate/up): each rank's local shard is a plain ``[rows, in]`` block of its own."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(weight, dtensor) or weight.device_mesh.ndim != 1:
        return False
    (placement,) = weight.placements
    return placement.is_shard() and placement.dim == 0 and weight.dim() == 2


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank computes with: a DTensor's local shard, else ``t``."""
    dtensor = _dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def _plain_linear(module: nn.Module | None) -> bool:
    # A tensor-parallel model's weights are DTensors: transformers' hooks swap in their local
    # shards per forward (``to_local()``), so only row-sharded (colwise) weights with no bias are
    # stacked, as local shards, and the graph pass reads through ``to_local``.
    if type(module) is not nn.Linear or not module.weight.dtype.is_floating_point:
        return False
    if type(module.weight) is nn.Parameter:
        return True
    return _column_sharded(module.weight) and module.bias is None


def stack_projection_weights(model: nn.Module) -> list[tuple[nn.Linear, ...]]:
    """Re-lay sibling projections' weights (and biases) contiguously; returns the groups stacked.

    A group is stacked when all its members are plain ``nn.Linear`` modules with the same input
    width, dtype, device and bias presence. Already stacked groups are left alone.
    """
    groups = []
    for parent in model.modules():
        for names in SIBLING_PROJECTIONS:
            mods = [getattr(parent, n, None) for n in names]
            if not all(_plain_linear(m) for m in mods):
                continue
            first = mods[0]
            same = all(
                m.in_features == first.in_features
                and type(m.weight) is type(first.weight)
                and m.weight.dtype == first.weight.dtype
                and m.weight.device == first.weight.device
                and (m.bias is None) == (first.bias is None)
                for m in mods
            )
            if not same:
                continue
            group = tuple(mods)
            if not _stacked(group):
                _stack(group)
            groups.append(group)
    return groups


def _stack(group: Sequence[nn.Linear]) -> None:
    if type(group[0].weight) is not nn.Parameter:
        return _stack_shards(group)
    with torch.no_grad():
        weight = torch.cat([m.weight for m in group])  # [sum of out_features, in_features]
        bias = None if group[0].bias is None else torch.cat([m.bias for m in group])
    row = 0
    for m in group:
        rows = m.out_features
        m.weight = nn.Parameter(weight[row : row + rows], requires_grad=m.weight.requires_grad)
        if bias is not None:
            m.bias = nn.Parameter(bias[row : row + rows], requires_grad=m.bias.requires_grad)
        row += rows
    return None


def _stack_shards(group: Sequence[nn.Linear]) -> None:
    """:func:`_stack` for column-sharded DTensor weights: this rank's local shards go back to back
    in one buffer and each weight becomes a DTensor over its view (same global shape, mesh and
    placement; the other ranks do the same with theirs)."""
    dtensor = _dtensor_type()
    assert dtensor is not None
    shards = [m.weight.to_local() for m in group]  # [local rows, in] each
    with torch.no_grad():
        local = torch.cat(shards)  # [sum of local rows, in]
    row = 0
    for m, own in zip(group, shards, strict=True):
        w, rows = m.weight, own.shape[0]
        shard = dtensor.from_local(
            local[row : row + rows], w.device_mesh, w.placements, run_check=False,
            shape=w.shape, stride=w.stride(),
        )  # fmt: skip
        m.weight = nn.Parameter(shard, requires_grad=w.requires_grad)
        row += rows


def _adjacent(tensors: Sequence[torch.Tensor]) -> bool:
    """Contiguous tensors that follow each other in one storage, in this order."""
    first = tensors[0]
    offset = first.storage_offset()
    ptr = first.untyped_storage().data_ptr()
    for t in tensors:
        if (
            not t.is_contiguous()
            or t.untyped_storage().data_ptr() != ptr
            or t.storage_offset() != offset
            or t.dtype != first.dtype
            or t.shape[1:] != first.shape[1:]
        ):
            return False
        offset += t.numel()
    return True


def _stacked(group: Sequence[nn.Linear]) -> bool:
    weights_ok = _adjacent([_local(m.weight) for m in group])
    return weights_ok and (group[0].bias is None or _adjacent([m.bias for m in group]))


def check_stacked(groups: Sequence[Sequence[nn.Linear]]) -> None:
    """Raise ``RuntimeError`` when a stacked group's weights are no longer one buffer."""
    for group in groups:
        if not _stacked(group):
            raise RuntimeError(
                "a fused projection's weights were re-bound after the model was compiled; copy new "
                "values into the existing tensors (load_state_dict does) or build a new LLM"
            )


def fuse_linears(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Fuse ``linear`` calls sharing an input whose weights are adjacent; returns calls removed.

    ``example_inputs`` are the real tensors of ``gm``'s placeholders (what ``torch.compile``
    passes a backend); weights and biases must be placeholders to be considered.
    """
    graph = gm.graph
    real: dict[fx.Node, Any] = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs, strict=False):
        real[node] = value
    for node in graph.nodes:  # a tensor-parallel weight: ``placeholder.to_local()``
        if _is_to_local(node) and len(node.args) == 1:
            value = real.get(node.args[0])
            if isinstance(value, torch.Tensor) and _column_sharded(value):
                real[node] = value.to_local()
    by_input: dict[tuple[fx.Node, bool], list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _LINEAR_TARGETS or node.kwargs:
            continue
        x, w, b = (*node.args, None)[:3]
        if not isinstance(w, fx.Node) or not isinstance(real.get(w), torch.Tensor):
            continue
        if b is not None and not (isinstance(b, fx.Node) and isinstance(real.get(b), torch.Tensor)):
            continue
        if real[w].dim() != 2:
            continue
        by_input[x, b is not None].append(node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    removed = 0
    for (x, has_bias), nodes in by_input.items():
        # longest runs of weights adjacent in memory, in memory order
        nodes = sorted(nodes, key=lambda n: (real[n.args[1]].untyped_storage().data_ptr(),
                                             real[n.args[1]].storage_offset()))  # fmt: skip
        run: list[fx.Node] = []
        for node in [*nodes, None]:
            if node is not None and _extends(run, node, real, has_bias):
                run.append(node)
                continue
            if len(run) > 1:
                _replace_run(graph, x, run, real, has_bias, order)
                removed += len(run) - 1
            run = [node] if node is not None else []
    if removed:
        graph.lint()
        gm.recompile()
    return removed


def _is_to_local(node: fx.Node) -> bool:
    """``DTensor.to_local()`` in a Dynamo graph: a method call (torch 2.13), or the function
    ``torch._dynamo.variables.tensor.prim_to_local`` that torch 2.11 traces it to."""
    if node.op == "call_method":
        return node.target == "to_local"
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "prim_to_local"


def _extends(run: list[fx.Node], node: fx.Node, real: dict, has_bias: bool) -> bool:
    if not run:
        return True
    weights = [real[n.args[1]] for n in (*run, node)]
    if not _adjacent(weights):
        return False
    return not has_bias or _adjacent([real[n.args[2]] for n in (*run, node)])


def _replace_run(
    graph: fx.Graph, x: fx.Node, run: list[fx.Node], real: dict, has_bias: bool, order: dict
) -> None:
    sizes = [real[n.args[1]].shape[0] for n in run]
    width = real[run[0].args[1]].shape[1]
    with graph.inserting_before(min(run, key=order.__getitem__)):
        # [sum(sizes), width]: the stacked buffer, viewed from its first weight
        weight = graph.call_function(
            torch.as_strided, (run[0].args[1], (sum(sizes), width), (width, 1))
        )
        bias = None
        if has_bias:
            bias = graph.call_function(torch.as_strided, (run[0].args[2], (sum(sizes),), (1,)))
        fused = graph.call_function(torch._C._nn.linear, (x, weight, bias))  # [..., sum(sizes)]
        parts = graph.call_function(torch.split, (fused, sizes, -1))
        outs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(run))]
    for node, out in zip(run, outs, strict=True):
        # the part has the replaced call's value (shape, dtype): AOTAutograd's cache reads it
        if "example_value" in node.meta:
            out.meta["example_value"] = node.meta["example_value"]
        node.replace_all_uses_with(out)
        graph.erase_node(node)


def weight_rows(w: Any) -> int | None:
    """The row count (output features) of the graph's weight ``w``: from its traced example
    value, or from the ``as_strided`` view that :func:`fuse_linears` made of a stacked weight;
    None when neither tells."""
    weight_value = getattr(w, "meta", {}).get("example_value")
    rows = getattr(weight_value, "shape", (None,))[0]
    if rows is None and getattr(w, "target", None) == torch.as_strided:
        rows = w.args[1][0]  # as_strided(w, (rows, K), ...)
    return rows


def cond_on_one_token(
    tokens: torch.Tensor,  # [..., K]: its leading dims count the step's tokens
    one_token: Callable[..., tuple],
    other: Callable[..., tuple],
    operands: tuple,
    conds: bool = True,
) -> tuple:
    """``one_token(*operands)`` in a step of one token, ``other(*operands)`` otherwise: the graph
    passes' fused branch (the batch-1 graph) against the model's own ops. Traced with symbolic
    sizes it is a ``torch.ops.higher_order.cond`` on that size: the host picks the branch from
    the shapes (no device sync), a CUDA graph keeps the branch its step took, and one compiled
    graph serves every step. With concrete sizes (eager) it is a plain call. Both branches
    return tuples of tensors (Inductor's lowering of ``cond`` needs them).

    ``conds=False`` (``LLM(fold_conds=False)``, the LLM's default): no ``cond``; ``one_token``
    serves every step, its ops choosing their kernels from the row count when they run.
    AOTAutograd and Inductor then see one opaque op where a ``cond`` had two traced branches
    (compile time; and a graph with a ``cond`` bypasses their caches)."""
    if not conds:
        return one_token(*operands)
    rows = math.prod(tokens.shape[:-1])
    if not isinstance(rows, torch.SymInt):  # eager, concrete sizes
        return (one_token if rows == 1 else other)(*operands)
    return torch.ops.higher_order.cond(rows == 1, one_token, other, operands)


def route_small_linears(gm: fx.GraphModule, max_out_features: int | None = None) -> int:
    """Send ``linear`` calls through ``paged_ops::small_linear``; returns the calls rerouted.

    The op runs a Triton GEMV when the call has at most ``SMALL_M_MAX`` rows (decode steps of small
    batches: the CUDA graphs of those buckets record it) and ``F.linear`` otherwise, so the pass
    changes no result's meaning, only which kernel computes it. Calls whose weight has more than
    ``max_out_features`` rows (a vocabulary head, which cuBLAS already streams near the copy
    bandwidth) are left alone; the weight's row count is read from the traced example value.
    """
    import paged_ops.linear  # noqa: F401  (registers the op)

    graph = gm.graph
    rerouted = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _LINEAR_TARGETS or node.kwargs:
            continue
        if not 2 <= len(node.args) <= 3:
            continue
        x, w, b = (*node.args, None)[:3]
        rows = weight_rows(w)
        if max_out_features is not None and (rows is None or rows > max_out_features):
            continue
        with graph.inserting_before(node):
            call = graph.call_function(torch.ops.paged_ops.small_linear.default, (x, w, b))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        rerouted += 1
    if rerouted:
        graph.lint()
        gm.recompile()
    return rerouted


def _autotunes_gemms() -> bool:
    from torch._inductor import config

    return bool(config.max_autotune or config.max_autotune_gemm)


def compile_backend(
    inner: str | Callable = "inductor",
    on_fused: Callable[[int], None] | None = None,
    *,
    fuse: bool = True,
    small_linears: bool = False,
    max_out_features: int | None = None,
    on_rerouted: Callable[[int], None] | None = None,
    inductor_options: dict[str, Any] | None = None,
    on_norms_fused: Callable[[int], None] | None = None,
    on_mlps_fused: Callable[[int], None] | None = None,
    on_ropes_fused: Callable[[int], None] | None = None,
    rope_in_attention: bool = True,
    fold_conds: bool = False,
    down_norm_fusion: bool = False,
    on_down_norms_fused: Callable[[int], None] | None = None,
    on_graph: Callable[[fx.GraphModule, Sequence[Any]], None] | None = None,
    on_gated_mlps_fused: Callable[[int], None] | None = None,
) -> Callable:
    """A ``torch.compile`` backend: :func:`fuse_linears` (``fuse``), then with ``small_linears``
    :func:`~paged_ops.engine.norm_fusion.fuse_norm_linears` (residual add + RMSNorm + the
    projections that read it as one op),
    :func:`~paged_ops.engine.rope_fusion.fuse_rope_projections` (q and k's rotary embedding into
    that q/k/v projection), :func:`~paged_ops.engine.mlp_fusion.fuse_silu_mul_linears` (a gated
    MLP's SiLU-mul into its down projection) and :func:`route_small_linears`, then ``inner``
    (Inductor by default).

    ``on_fused`` is told how many ``linear`` calls each compiled graph lost, ``on_rerouted`` how
    many went to the small-batch op, ``on_norms_fused`` how many norms went into projections,
    ``on_mlps_fused`` how many SiLU-mul products went into down projections, ``on_ropes_fused``
    how many q/k rotations moved (into the attention op with ``rope_in_attention``, else into
    the q/k/v projection). ``fold_conds`` is :func:`cond_on_one_token`'s ``conds`` for every
    fold. ``down_norm_fusion`` (without ``fold_conds``) then fuses each down projection with the
    next layer's norm-fed projection (:func:`~paged_ops.engine.mlp_fusion.fuse_down_norms`;
    ``on_down_norms_fused`` is told how many). Without ``fold_conds`` each MLP's norm-fed
    gate/up projection then joins its down projection
    (:func:`~paged_ops.engine.mlp_fusion.fuse_gated_mlps`; ``on_gated_mlps_fused`` is told how
    many). ``on_graph(gm, example_inputs)`` sees each graph
    after the passes, before ``inner`` compiles it (the engine's graph prebuild,
    :mod:`paged_ops.engine.graph_prebuild`).
    While Inductor autotunes GEMMs (``max_autotune`` or
    ``max_autotune_gemm`` in ``torch._inductor.config`` when the graph is compiled), nothing is
    fused: its autotuner times each matmul on fresh inputs sized from the graph's own inputs, and a
    stacked weight is a view past the first weight's storage, which those inputs do not have
    (benchmarks/NOTES.md section 12). ``inductor_options`` patch ``torch._inductor.config``
    while ``inner`` compiles each graph.
    """
    from torch._dynamo import lookup_backend

    compile_inner = lookup_backend(inner) if isinstance(inner, str) else inner

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        if fuse and not _autotunes_gemms():
            removed = fuse_linears(gm, example_inputs)
            if on_fused is not None:
                on_fused(removed)
        if small_linears:
            from paged_ops.engine.mlp_fusion import fuse_silu_mul_linears
            from paged_ops.engine.norm_fusion import fuse_norm_linears
            from paged_ops.engine.rope_fusion import fuse_rope_projections

            norms = fuse_norm_linears(gm, max_out_features, conds=fold_conds)
            if on_norms_fused is not None:
                on_norms_fused(norms)
            ropes = fuse_rope_projections(gm, into_attention=rope_in_attention)
            if on_ropes_fused is not None:
                on_ropes_fused(ropes)
            mlps = fuse_silu_mul_linears(gm, max_out_features, conds=fold_conds)
            if on_mlps_fused is not None:
                on_mlps_fused(mlps)
            if down_norm_fusion and not fold_conds:
                from paged_ops.engine.mlp_fusion import fuse_down_norms

                down_norms = fuse_down_norms(gm)
                if on_down_norms_fused is not None:
                    on_down_norms_fused(down_norms)
            if not fold_conds:
                from paged_ops.engine.mlp_fusion import fuse_gated_mlps

                gated = fuse_gated_mlps(gm)
                if on_gated_mlps_fused is not None:
                    on_gated_mlps_fused(gated)
            rerouted = route_small_linears(gm, max_out_features)
            if on_rerouted is not None:
                on_rerouted(rerouted)
        if on_graph is not None:
            on_graph(gm, example_inputs)
        with brief_fallback_logs(), contextlib.ExitStack() as stack:
            if inductor_options:
                from torch._inductor import config

                stack.enter_context(config.patch(inductor_options))
            return compile_inner(gm, example_inputs)

    return backend


@functools.cache
def _formats_fallback_logs_eagerly() -> bool:
    """Whether Inductor formats an op's arguments for its "Creating implicit fallback" log line
    before the level check (torch 2.11; torch 2.13 passes a ``LazyString``): read from the
    source of ``GraphLowering.call_function``, taken as eager where the source is not at hand."""
    from torch._inductor.graph import GraphLowering

    try:
        source = inspect.getsource(GraphLowering.call_function)
    except (OSError, TypeError):
        return True
    return "LazyString(error.operator_str" not in source


@contextlib.contextmanager
def brief_fallback_logs() -> Iterator[None]:
    """Within the block, Inductor's ``OperatorIssue.operator_str`` names the target and each
    argument's type, not the argument's IR, where Inductor formats it eagerly.

    Each custom op the graph meets for the first time gets an implicit fallback, and torch 2.11
    formats every argument for an INFO log line whether or not it is shown; an argument's IR
    prints its producers recursively, so an op first met deep in the graph costs time exponential
    in that depth: ``paged_ops::silu_mul_add_rms_norm_linear`` (``LLM(down_norm_fusion=True)``,
    first met after a whole decoder layer) kept the 1B's compile past 150 s on an H200
    (benchmarks/NOTES.md section 40). Elsewhere the block changes nothing."""
    if not _formats_fallback_logs_eagerly():
        yield
        return
    from torch._inductor import exc

    def operator_str(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        kinds = ", ".join(type(a).__name__ for a in args)
        return f"  target: {target}\n  args: ({kinds}), kwargs: {sorted(kwargs)}"

    saved = exc.OperatorIssue.__dict__["operator_str"]
    exc.OperatorIssue.operator_str = staticmethod(operator_str)
    try:
        yield
    finally:
        exc.OperatorIssue.operator_str = saved
