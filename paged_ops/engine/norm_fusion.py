"""Graph pass: a residual add, the Llama-style RMSNorm of its sum and the projections that read
the norm become one :func:`norm_projections` call, which runs ``paged_ops::add_rms_norm_linear``
(:mod:`paged_ops.norm_linear`) when the step has one token and the model's own ops otherwise.

It matches transformers' ``LlamaRMSNorm`` (and the many families that copy it: Mistral, Qwen2/3,
Phi-3, Granite, ...) as Dynamo traces it::

    h = a + b                                   # the residual add
    h32 = h.to(torch.float32)
    var = h32.pow(2).mean(-1, keepdim=True)
    y = g * (h32 * torch.rsqrt(var + eps)).to(h.dtype)
    out_i = linear(y, W_i)                      # every user of y, no bias

and replaces each ``linear`` by one of the call's outputs; the add's other users (the next
residual) read its last output, ``h``. The call is a ``torch.ops.higher_order.cond`` on the
step's token count, a size: the host picks the branch from the shapes (no device sync), a CUDA
graph keeps the branch its step took, and the one graph serves every step. Steps of several
tokens (prefills, mixed and batched decode steps) thus run exactly the code Inductor made before
the pass (the fused op there cost 1% at 64 and 256 requests on an H200: benchmarks/NOTES.md
sections 25-26). Anything else (a norm with other users, such as the final norm, which reaches
the vocabulary head through a slice; a projection wider than ``max_out_features``; Gemma's
``1 + g``; a norm of a tensor that is not a sum) is left as it was, so the pass changes which
kernels run, not what they compute beyond the op's bfloat16 rounding (one-token steps scale by
the norm after the sum).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from paged_ops.engine.fusion import _LINEAR_TARGETS, cond_on_one_token, weight_rows


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


def _one_row(eps: float, a: torch.Tensor, b: torch.Tensor, g: torch.Tensor, *weights: torch.Tensor):
    """``norm_projections``' branch for one token: the fused op per projection (``h`` from the
    first; each recomputes the add and the norm inside its GEMV)."""
    outs = [torch.ops.paged_ops.add_rms_norm_linear.default(a, b, g, eps, w) for w in weights]
    return (*(out for out, _ in outs), outs[0][1])


def _rows(eps: float, a: torch.Tensor, b: torch.Tensor, g: torch.Tensor, *weights: torch.Tensor):
    """``norm_projections``' branch for more tokens: the model's own ops (the matched formula),
    which Inductor fuses and sends to cuBLAS as it did before the pass."""
    h = a + b
    hf = h.to(torch.float32)
    y = g * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return (*(F.linear(y, w) for w in weights), h)


def norm_projections(
    a: torch.Tensor,  # [..., K] the block's output
    b: torch.Tensor,  # [..., K] the residual
    g: torch.Tensor,  # [K] the norm's weight
    eps: float,
    *weights: torch.Tensor,  # [N_i, K] each
    conds: bool = True,
) -> tuple[torch.Tensor, ...]:  # out_i [..., N_i] each, then h = a + b [..., K]
    """What the pass puts in the graph (:func:`~paged_ops.engine.fusion.cond_on_one_token`): a
    one-token step (the batch-1 graph) runs ``add_rms_norm_linear`` and every other step runs
    the model's own add, norm and matmuls, compiled as before (``conds=False``: the op in every
    step)."""
    one_row, more_rows = functools.partial(_one_row, eps), functools.partial(_rows, eps)
    return cond_on_one_token(a, one_row, more_rows, (a, b, g, *weights), conds)


def fuse_norm_linears(
    gm: fx.GraphModule, max_out_features: int | None = None, conds: bool = True
) -> int:
    """Replace each matched add + RMSNorm + projections by one :func:`norm_projections` call (see
    the module docstring; ``conds`` is its ``conds``); returns the norms fused."""
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
        projections.sort(key=order.__getitem__)
        first = projections[0]
        weights = [node.args[1] for node in projections]
        later = [u for u in h.users if u is not h32]
        if any(order[u] < order[first] for u in later):  # the sum is read before the projection
            continue
        if any(isinstance(w, fx.Node) and order[w] > order[first] for w in weights):
            continue  # a weight made after the first projection (not seen in the models)
        a, b = h.args
        with graph.inserting_before(first):
            call = graph.call_function(
                norm_projections, (a, b, g, eps, *weights), {} if conds else {"conds": False}
            )
            outs = [graph.call_function(operator.getitem, (call, i)) for i in range(len(weights))]
            h_out = graph.call_function(operator.getitem, (call, len(weights)))
        h_out.meta["example_value"] = _value(h)
        for node, out in zip(projections, outs, strict=True):
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
