"""Graph pass: a residual add, the Llama-style RMSNorm of its sum and the projections that read
the norm become ``paged_ops::add_rms_norm_linear`` calls (:mod:`paged_ops.norm_linear`).

It matches transformers' ``LlamaRMSNorm`` (and the many families that copy it: Mistral, Qwen2/3,
Phi-3, Granite, ...) as Dynamo traces it::

    h = a + b                                   # the residual add
    h32 = h.to(torch.float32)
    var = h32.pow(2).mean(-1, keepdim=True)
    y = g * (h32 * torch.rsqrt(var + eps)).to(h.dtype)
    out_i = linear(y, W_i)                      # every user of y, no bias

and replaces each ``linear`` by the op's first output; the add's other users (the next residual)
read its second output. Anything else (a norm with other users, such as the final norm, which
reaches the vocabulary head through a slice; a projection wider than ``max_out_features``;
Gemma's ``1 + g``; a norm of a tensor that is not a sum) is left as it was, so the pass changes
which kernels run, not what they compute beyond the op's bfloat16 rounding (one-row steps scale
by the norm after the sum).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from paged_ops.engine.fusion import _LINEAR_TARGETS, weight_rows


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _call(node: Any, op: str, target: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == op and node.target == target


def _other(node: fx.Node, first: Any) -> Any:
    """The argument of a two-argument call that is not ``first``."""
    a, b = node.args
    return b if a is first else a if b is first else None


def _to_dtype(node: Any) -> Any:
    """``x.to(dtype)`` -> dtype, else None."""
    if not _call(node, "call_method", "to") or node.kwargs or len(node.args) != 2:
        return None
    return node.args[1] if isinstance(node.args[1], torch.dtype) else None


def _match_norm(y: fx.Node) -> tuple[list[fx.Node], fx.Node, float] | None:
    """``y = g * (h32 * rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)`` with
    ``h32 = h.to(float32)`` and ``h = a + b`` -> ``(chain, g, eps)``, ``chain`` the nodes from
    ``y`` back to ``h`` (last); else None."""
    if not _call(y, "call_function", operator.mul) or len(y.args) != 2:
        return None
    for cast, g in (y.args, y.args[::-1]):
        if _to_dtype(cast) is not None and isinstance(g, fx.Node):
            break
    else:
        return None
    g_value = _value(g)
    if not isinstance(g_value, torch.Tensor) or g_value.dim() != 1:
        return None
    scaled = cast.args[0]
    if not _call(scaled, "call_function", operator.mul) or len(scaled.args) != 2:
        return None
    for h32, rsqrt in (scaled.args, scaled.args[::-1]):
        if _call(rsqrt, "call_function", torch.rsqrt) and _to_dtype(h32) == torch.float32:
            break
    else:
        return None
    plus_eps = rsqrt.args[0]
    if not _call(plus_eps, "call_function", operator.add) or len(plus_eps.args) != 2:
        return None
    var, eps = plus_eps.args
    if not isinstance(eps, float):
        return None
    if not _call(var, "call_method", "mean") or var.args[1:] != (-1,):
        return None
    if var.kwargs != {"keepdim": True}:
        return None
    square = var.args[0]
    if not _call(square, "call_method", "pow") or square.args != (h32, 2) or square.kwargs:
        return None
    h = h32.args[0]
    if not _call(h, "call_function", operator.add) or len(h.args) != 2 or h.kwargs:
        return None
    h_value, y_value = _value(h), _value(y)
    if not isinstance(h_value, torch.Tensor) or not isinstance(y_value, torch.Tensor):
        return None
    if not all(isinstance(v, fx.Node) for v in h.args) or _value(h.args[0]) is None:
        return None
    if _to_dtype(cast) != h_value.dtype or y_value.dtype != h_value.dtype:
        return None
    if g_value.dtype != h_value.dtype or _value(h.args[0]).shape != _value(h.args[1]).shape:
        return None
    if set(h32.users) != {square, scaled} or set(square.users) != {var}:
        return None
    return [y, cast, scaled, rsqrt, plus_eps, var, square, h32, h], g, eps


def _projections(y: fx.Node, max_out_features: int | None) -> list[fx.Node] | None:
    """Every user of ``y``, each a bias-free ``linear(y, W)`` within ``max_out_features``, else
    None."""
    users = list(y.users)
    for node in users:
        if node.op != "call_function" or node.target not in _LINEAR_TARGETS or node.kwargs:
            return None
        if (
            node.args[0] is not y
            or len(node.args) not in (2, 3)
            or node.args[2:] not in ((), (None,))
        ):
            return None
        rows = weight_rows(node.args[1])
        if rows is None or (max_out_features is not None and rows > max_out_features):
            return None
    return users or None


def fuse_norm_linears(gm: fx.GraphModule, max_out_features: int | None = None) -> int:
    """Replace each matched add + RMSNorm + projections by ``add_rms_norm_linear`` calls (see the
    module docstring); returns the norms fused."""
    import paged_ops.norm_linear  # noqa: F401  (registers the op)

    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    fused = 0
    for y in list(graph.nodes):
        match = _match_norm(y)
        if match is None:
            continue
        chain, g, eps = match
        h, h32 = chain[-1], chain[-2]
        projections = _projections(y, max_out_features)
        if projections is None:
            continue
        first = min(projections, key=order.__getitem__)
        later = [u for u in h.users if u is not h32]
        if any(order[u] < order[first] for u in later):  # the sum is read before the projection
            continue
        a, b = h.args
        h_out = None
        for node in sorted(projections, key=order.__getitem__):
            with graph.inserting_before(node):
                call = graph.call_function(
                    torch.ops.paged_ops.add_rms_norm_linear.default, (a, b, g, eps, node.args[1])
                )
                out = graph.call_function(operator.getitem, (call, 0))
                if h_out is None:
                    h_out = graph.call_function(operator.getitem, (call, 1))
                    h_out.meta["example_value"] = _value(h)
            out.meta["example_value"] = _value(node)
            node.replace_all_uses_with(out)
            graph.erase_node(node)
        for user in later:
            user.replace_input_with(h, h_out)
        for node in chain:  # y first: each node's users are gone by its turn
            if not node.users:
                graph.erase_node(node)
        fused += 1
    if fused:
        graph.lint()
        gm.recompile()
    return fused
