"""Graph pass: a gated MLP's ``down_proj(silu(gate) * up)`` becomes one :func:`silu_mul_projection`
call, which runs ``paged_ops::silu_mul_linear`` (:mod:`paged_ops.mlp_linear`) when the step
has one token and the model's own ops otherwise.

It matches transformers' ``LlamaMLP`` (and the families that copy it: Mistral, Qwen2/3, Granite,
...; Phi-3's ``up * act(gate)`` of its one ``gate_up_proj`` as well) as Dynamo traces it, after
:func:`~paged_ops.engine.fusion.fuse_linears` stacked gate and up (and, when it ran first,
:func:`~paged_ops.engine.norm_fusion.fuse_norm_linears` put the norm into that projection)::

    gate_up = linear(y, W_gate_up)                  # or getitem(norm_projections(...), 0)
    split = torch.functional.split(gate_up, [I, I], -1)
    gate, up = split[0], split[1]
    silu = torch.nn.functional.silu(gate)
    product = silu * up                             # its only user is the down projection
    down = linear(product, W_down)                  # no bias, W_down within max_out_features

and replaces ``down`` by the call's output; the product, the SiLU and the split go (Phi-3's
``chunk(2, -1)`` is the same split). Gate and up must be the halves of one tensor: the call takes
that tensor (without stacked weights they are two projections' outputs, left alone). In a
one-token step (the batch-1 CUDA graph) the down GEMV forms ``silu(gate) * up`` from its loads,
so the SiLU-mul kernel before it (and its launch boundary) is gone. Like the norm pass the call is
a ``torch.ops.higher_order.cond`` on the step's token count, a size: the host picks the branch
from the shapes (no device sync), a CUDA graph keeps the branch its step took, and the one graph
serves every step. Steps of several tokens run what they ran before the pass: Inductor's SiLU-mul
and ``paged_ops::small_linear`` (where :func:`~paged_ops.engine.fusion.route_small_linears` would
have sent the down projection). Other activations (Gemma's GELU), a product with other users and a
biased or wide down projection are left as they were.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from paged_ops.engine.fusion import _LINEAR_TARGETS, cond_on_one_token, weight_rows
from paged_ops.engine.norm_fusion import _value

# how a traced graph splits a tensor: (node.op, node.target)
_SPLITS = {("call_function", torch.functional.split), ("call_method", "split")}
_CHUNKS = {("call_function", torch.chunk), ("call_method", "chunk")}


def _silu_input(node: Any) -> fx.Node | None:
    """``F.silu(x)`` (not in place) with no other user than the product -> ``x``, else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not F.silu:
        return None
    if len(node.args) != 1 or node.kwargs not in ({}, {"inplace": False}) or len(node.users) != 1:
        return None
    return node.args[0] if isinstance(node.args[0], fx.Node) else None


def _halves_of(gate: fx.Node, up: Any) -> fx.Node | None:
    """``gate, up = x.split([I, I], -1)`` (or ``x.chunk(2, -1)``) -> ``x``, ``[..., 2I]``; else
    None. Read from the halves' traced values: a stacked projection's output has none."""
    if not all(isinstance(n, fx.Node) and n.target is operator.getitem for n in (gate, up)):
        return None
    parts = gate.args[0]
    if not isinstance(parts, fx.Node) or up.args[0] is not parts:
        return None
    if (gate.args[1], up.args[1]) != (0, 1) or (parts.op, parts.target) not in _SPLITS | _CHUNKS:
        return None
    if len(parts.args) not in (2, 3) or set(parts.kwargs) - {"dim"}:
        return None
    source, how, *rest = parts.args
    dim = rest[0] if rest else parts.kwargs.get("dim", 0)
    gate_value, up_value = _value(gate), _value(up)
    if not isinstance(gate_value, torch.Tensor) or not isinstance(up_value, torch.Tensor):
        return None
    width = gate_value.shape[-1]
    if dim not in (-1, gate_value.dim() - 1) or up_value.shape != gate_value.shape:
        return None
    if not isinstance(source, fx.Node):
        return None
    if (parts.op, parts.target) in _CHUNKS:  # two chunks of one width: the two halves
        return source if how == 2 else None
    return source if isinstance(how, (list, tuple)) and list(how) == [width, width] else None


def _match(down: fx.Node, max_out_features: int | None) -> tuple[fx.Node, ...] | None:
    """``down = linear(silu(gate) * up, W)`` with gate and up the halves of ``gate_up`` ->
    ``(product, silu, gate, up, gate_up, W)``, else None."""
    if down.op != "call_function" or down.target not in _LINEAR_TARGETS or down.kwargs:
        return None
    if len(down.args) not in (2, 3) or down.args[2:] not in ((), (None,)):
        return None
    product, weight = down.args[:2]
    if not isinstance(product, fx.Node) or not isinstance(weight, fx.Node):
        return None
    if product.op != "call_function" or product.target is not operator.mul or product.kwargs:
        return None
    if len(product.args) != 2 or set(product.users) != {down}:
        return None
    for silu, up in (product.args, product.args[::-1]):
        gate = _silu_input(silu)
        if gate is not None:
            gate_up = _halves_of(gate, up)
            if gate_up is not None:
                break
    else:
        return None
    rows = weight_rows(weight)
    if rows is None or (max_out_features is not None and rows > max_out_features):
        return None
    gate_value, weight_value, down_value = (_value(n) for n in (gate, weight, down))
    if not isinstance(weight_value, torch.Tensor) or not isinstance(down_value, torch.Tensor):
        return None
    if weight_value.dim() != 2 or weight_value.shape[1] != gate_value.shape[-1]:
        return None
    dtype = gate_value.dtype
    if not dtype.is_floating_point or not dtype == weight_value.dtype == down_value.dtype:
        return None
    return product, silu, gate, up, gate_up, weight


def _one_row(gate_up: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor]:
    """``silu_mul_projection``'s branch for one token: the fused op, one GEMV launch."""
    gate, up = gate_up.chunk(2, -1)  # [..., I] each: views, nothing copied
    return (torch.ops.paged_ops.silu_mul_linear.default(gate, up, weight),)


def _rows(gate_up: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor]:
    """``silu_mul_projection``'s branch for more tokens: the model's SiLU-mul (Inductor fuses it
    into one pointwise kernel) and the down projection as the small-linear pass routes it."""
    gate, up = gate_up.chunk(2, -1)
    return (torch.ops.paged_ops.small_linear.default(F.silu(gate) * up, weight, None),)


def silu_mul_projection(
    gate_up: torch.Tensor,  # [..., 2I] the gate projection's output, then the up projection's
    weight: torch.Tensor,  # [N, I]
    conds: bool = True,
) -> torch.Tensor:  # [..., N]
    """What the pass puts in the graph (:func:`~paged_ops.engine.fusion.cond_on_one_token`): a
    one-token step runs ``silu_mul_linear`` and every other step the model's SiLU-mul and then
    ``small_linear`` (``conds=False``: ``silu_mul_linear`` in every step). The operand is the
    whole gate/up output, split inside each branch (``cond`` refuses operands that alias each
    other, as its two halves do); the branches return a 1-tuple (Inductor's lowering of ``cond``
    zips the branch outputs with the node's value)."""
    return cond_on_one_token(gate_up, _one_row, _rows, (gate_up, weight), conds)[0]


def fuse_silu_mul_linears(
    gm: fx.GraphModule, max_out_features: int | None = None, conds: bool = True
) -> int:
    """Replace each matched ``linear(silu(gate) * up, W)`` by one :func:`silu_mul_projection`
    call (see the module docstring; ``conds`` is its ``conds``); returns the projections
    fused."""
    import paged_ops.linear  # noqa: F401  (registers the ops)
    import paged_ops.mlp_linear  # noqa: F401

    graph = gm.graph
    fused = 0
    for down in list(graph.nodes):
        match = _match(down, max_out_features)
        if match is None:
            continue
        product, silu, gate, up, gate_up, weight = match
        parts = gate.args[0]
        with graph.inserting_before(down):
            call = graph.call_function(
                silu_mul_projection, (gate_up, weight), {} if conds else {"conds": False}
            )
        call.meta["example_value"] = _value(down)
        down.replace_all_uses_with(call)
        for node in (down, product, silu, gate, up, parts):  # users before what they read
            if not node.users:
                graph.erase_node(node)
        fused += 1
    if fused:
        graph.lint()
        gm.recompile()
    return fused


def down_norm_projections(
    residual: torch.Tensor,  # [..., H] the residual stream
    gate_up: torch.Tensor,  # [..., 2I] the gate/up projection's output
    down_weight: torch.Tensor,  # [H, I]
    g: torch.Tensor,  # [H] the next norm's weight
    eps: float,
    weight: torch.Tensor,  # [N, H] the projection that reads the norm
) -> tuple[torch.Tensor, torch.Tensor]:  # out [..., N], h [..., H]
    """What :func:`fuse_down_norms` puts in the graph: ``silu_mul_projection`` then the next
    layer's ``norm_projections`` of one weight, as ``paged_ops::silu_mul_add_rms_norm_linear``
    (the same values; one kernel fewer where the down projection takes the split-K GEMM)."""
    gate, up = gate_up.chunk(2, -1)  # [..., I] each: views
    return torch.ops.paged_ops.silu_mul_add_rms_norm_linear.default(
        gate, up, down_weight, residual, g, eps, weight
    )


def _one_weight_norm(node: fx.Node) -> bool:
    """A ``norm_projections`` call without ``cond`` and with one weight: what
    :func:`fuse_down_norms` and :func:`fuse_gated_mlps` fuse further."""
    from paged_ops.engine.norm_fusion import norm_projections

    return (
        node.op == "call_function"
        and node.target is norm_projections
        and node.kwargs == {"conds": False}
        and len(node.args) == 5
    )


def _lone_down(node: Any) -> bool:
    """A ``silu_mul_projection`` without ``cond`` read by one node."""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target is silu_mul_projection
        and node.kwargs == {"conds": False}
        and len(node.users) == 1
    )


def fuse_down_norms(gm: fx.GraphModule) -> int:
    """Replace each ``silu_mul_projection`` (without ``cond``) whose only reader is a
    ``norm_projections`` (without ``cond``) of one weight by one :func:`down_norm_projections`
    call (``LLM(down_norm_fusion)``, on by default; :mod:`paged_ops.mlp_norm_linear`); returns
    the pairs fused. Run after :func:`fuse_silu_mul_linears` and the norm pass; the last layer's
    down projection (read by the final norm) and a norm whose projections were not stacked
    stay."""
    import paged_ops.mlp_norm_linear  # noqa: F401  (registers the op)

    graph = gm.graph
    fused = 0
    for norm in list(graph.nodes):
        if not _one_weight_norm(norm):
            continue
        a, b, g, eps, weight = norm.args
        if _lone_down(b):
            down, residual = b, a
        elif _lone_down(a):
            down, residual = a, b
        else:
            continue
        gate_up, down_weight = down.args
        with graph.inserting_before(norm):
            call = graph.call_function(
                down_norm_projections, (residual, gate_up, down_weight, g, eps, weight)
            )
        call.meta.update(norm.meta)
        norm.replace_all_uses_with(call)
        graph.erase_node(norm)
        graph.erase_node(down)
        fused += 1
    if fused:
        graph.lint()
        gm.recompile()
    return fused


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _item(node: fx.Node, index: int) -> fx.Node | None:
    """The ``getitem(node, index)`` reading ``node``'s output (the first, if several), or None."""
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == index:
            return user
    return None


def fuse_gated_mlps(gm: fx.GraphModule) -> int:
    """Replace each ``norm_projections`` (without ``cond``) of one stacked gate/up weight whose
    projection feeds only the MLP's down projection (``silu_mul_projection``, or the
    ``down_norm_projections`` that :func:`fuse_down_norms` made of it, whose residual is that
    norm's sum and read nowhere else) by one ``paged_ops::add_rms_norm_gated_mlp`` call
    (:mod:`paged_ops.gated_mlp`: the gate/up GEMM and the SiLU-mul in one kernel where that
    serves); returns the MLPs fused. Run after :func:`fuse_down_norms`, without ``fold_conds``."""
    import paged_ops.gated_mlp  # noqa: F401  (registers the op)

    op = torch.ops.paged_ops.add_rms_norm_gated_mlp.default
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    fused = 0
    for norm in list(graph.nodes):
        if not _one_weight_norm(norm):
            continue
        gate_up, h = _item(norm, 0), _item(norm, 1)
        if gate_up is None or len(norm.users) != 1 + (h is not None):
            continue
        mlp = _only_user(gate_up)
        if mlp is None or mlp.op != "call_function":
            continue
        if (
            mlp.target is silu_mul_projection
            and mlp.kwargs == {"conds": False}
            and mlp.args[0] is gate_up
            and (h is None or all(order.get(u, -1) > order[mlp] for u in h.users))  # read later
        ):
            args = (*norm.args, mlp.args[1])  # a, b, g, eps, W_gate_up, W_down
        elif (
            mlp.target is down_norm_projections
            and h is not None
            and mlp.args[0] is h
            and mlp.args[1] is gate_up
            and _only_user(h) is mlp
        ):
            _, _, down_weight, g, eps, weight = mlp.args
            args = (*norm.args, down_weight, g, eps, weight)
        else:
            continue
        with graph.inserting_before(mlp):
            call = graph.call_function(op, args)
            if mlp.target is silu_mul_projection:  # (down, h): the MLP's output, then the sum
                down = graph.call_function(operator.getitem, (call, 0))
                h_out = graph.call_function(operator.getitem, (call, 1))
        if mlp.target is silu_mul_projection:
            down.meta.update(mlp.meta)
            mlp.replace_all_uses_with(down)
            if h is not None:
                h_out.meta.update(h.meta)
                h.replace_all_uses_with(h_out)
            else:
                graph.erase_node(h_out)
        else:  # (out, h2), as down_norm_projections returned
            call.meta.update(mlp.meta)
            mlp.replace_all_uses_with(call)
        for node in (mlp, h, gate_up, norm):  # users before what they read
            if node is not None and not node.users:
                graph.erase_node(node)
        fused += 1
    if fused:
        graph.lint()
        gm.recompile()
    return fused
