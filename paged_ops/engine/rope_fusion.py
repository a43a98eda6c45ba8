"""Graph pass: the rotary embedding of q and k goes into the q/k/v projection that the norm pass
(:mod:`paged_ops.engine.norm_fusion`) fused with its residual add + RMSNorm.

After that pass a Llama-style attention block reads, as Dynamo traces transformers'
``apply_rotary_pos_emb``::

    qkv, h = norm_projections(a, b, g, eps, W_qkv)      # the stacked q/k/v projection
    q, k, v = torch.functional.split(qkv, [Hq*D, Hkv*D, Hkv*D], -1)
    q_states = q.view(1, T, -1, D).transpose(1, 2)      # k_states, v_states alike
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)           # cos, sin [1, T, D]
    q_embed = q_states * c + cat((-q_states[..., D/2:], q_states[..., :D/2]), -1) * s
    k_embed = ...                                       # the same with k_states

In a one-token step that is a RoPE kernel of its own per layer (~1.5 us plus a launch boundary
inside the batch-1 graph; benchmarks/NOTES.md section 25). The pass gives the call ``cos``,
``sin`` and the rotated column count, so that a one-token step rotates q and k in the GEMV's
epilogue (``paged_ops::add_rms_norm_linear``'s ``cos``/``sin``); every other step rotates with
the model's own formula after the model's own matmul (:func:`norm_projections_rope`, the same
``cond`` on the token count). ``q_embed`` and ``k_embed`` are then ``q_states`` and
``k_states`` themselves. Anything else (separate q/k/v projections, q/k norms between the split
and the rotation as in Qwen3, interleaved rotations, a ``cos`` of another dtype) is left alone.

With ``into_attention`` (``LLM(rope_in_attention=True)``) a rotation that only a
``paged_ops::write_kv_and_attend`` call reads (the triton backend's layers) goes into that call
instead (its ``rope_cos``/``rope_sin``; :mod:`paged_ops.rope`): the decode kernel rotates the
query rows it loads and the key row it writes, other steps rotate in one launch first. That
takes every layer's rotation, layer 0's included (no fused norm needed), and the q/k/v
projection rotates nothing.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
from torch import fx

from paged_ops import ops as _ops  # noqa: F401 (registers paged_ops::write_kv_and_attend)
from paged_ops.engine.fusion import cond_on_one_token
from paged_ops.engine.norm_fusion import _call, _other, _rows, _value, norm_projections
from paged_ops.norm_linear import rotate

_SPLITS = (torch.functional.split, torch.split)


def _one_row_rope(eps: float, rope_cols: int, a, b, g, cos, sin, weight):  # noqa: ANN001, ANN202
    """:func:`norm_projections_rope`'s branch for one token: the fused op, rotating in its GEMV."""
    return torch.ops.paged_ops.add_rms_norm_linear.default(
        a, b, g, eps, weight, cos, sin, rope_cols
    )


def _rows_rope(eps: float, rope_cols: int, a, b, g, cos, sin, weight):  # noqa: ANN001, ANN202
    """Its branch for more tokens: the model's add, norm and matmul, then its rotation."""
    out, h = _rows(eps, a, b, g, weight)
    return rotate(out, cos, sin, rope_cols), h


def norm_projections_rope(
    a: torch.Tensor,  # [..., K] the block's output
    b: torch.Tensor,  # [..., K] the residual
    g: torch.Tensor,  # [K] the norm's weight
    eps: float,
    rope_cols: int,
    cos: torch.Tensor,  # [..., D]
    sin: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [N, K] the stacked q/k/v weight
    conds: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # qkv [..., N] with q and k rotated, h = a + b [..., K]
    """:func:`~paged_ops.engine.norm_fusion.norm_projections` of one stacked q/k/v weight with
    its first ``rope_cols`` columns (the q and k heads) rotated by ``cos``/``sin``, behind the
    same :func:`~paged_ops.engine.fusion.cond_on_one_token` (the call's ``conds`` kept)."""
    one_row = functools.partial(_one_row_rope, eps, rope_cols)
    more_rows = functools.partial(_rows_rope, eps, rope_cols)
    return cond_on_one_token(a, one_row, more_rows, (a, b, g, cos, sin, weight), conds)


def _sole_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _half_slice(node: Any, states: fx.Node, first: bool, half: int) -> bool:
    """``states[..., :half]`` (``first``) or ``states[..., half:]``."""
    if not _call(node, "call_function", operator.getitem) or node.args[0] is not states:
        return False
    wanted = slice(None, half, None) if first else slice(half, None, None)
    return node.args[1] == (Ellipsis, wanted)


def _unsqueezed(node: Any) -> Any:
    """``t.unsqueeze(1)`` -> ``t``, else None."""
    if _call(node, "call_method", "unsqueeze") and node.args[1:] == (1,) and not node.kwargs:
        return node.args[0]
    return None


def _rotation(states: fx.Node, head_dim: int) -> tuple[fx.Node, Any, Any, list[fx.Node]] | None:
    """``states * c + cat((-states[..., D/2:], states[..., :D/2]), -1) * s`` with ``c`` and
    ``s`` ``cos``/``sin`` unsqueezed at 1 -> ``(embed, cos, sin, nodes)``, ``nodes`` the rotation's
    own nodes (embed first); else None."""
    half = head_dim // 2
    users = list(states.users)
    if len(users) != 3:
        return None
    x1 = [u for u in users if _half_slice(u, states, True, half)]
    x2 = [u for u in users if _half_slice(u, states, False, half)]
    by_cos = [u for u in users if _call(u, "call_function", operator.mul)]
    if len(x1) != 1 or len(x2) != 1 or len(by_cos) != 1:
        return None
    (x1,), (x2,), (by_cos,) = x1, x2, by_cos
    neg = _sole_user(x2)
    if not _call(neg, "call_function", operator.neg):
        return None
    cat = _sole_user(neg)
    if not _call(cat, "call_function", torch.cat) or _sole_user(x1) is not cat:
        return None
    if cat.args[:1] != ([neg, x1],) and cat.args[:1] != ((neg, x1),):
        return None
    if cat.args[1:] + tuple(cat.kwargs.values()) not in ((-1,), (3,)):
        return None
    by_sin = _sole_user(cat)
    if not _call(by_sin, "call_function", operator.mul):
        return None
    embed = _sole_user(by_sin)
    if not _call(embed, "call_function", operator.add) or _sole_user(by_cos) is not embed:
        return None
    if _other(embed, by_cos) is not by_sin:
        return None
    cos, sin = _unsqueezed(_other(by_cos, states)), _unsqueezed(_other(by_sin, cat))
    if not isinstance(cos, fx.Node) or not isinstance(sin, fx.Node):
        return None
    return embed, cos, sin, [embed, by_sin, cat, neg, x2, x1, by_cos]


def _view_shape(view: Any) -> tuple | None:
    """The shape of ``t.view(shape)`` / ``t.view(*shape)``, else None."""
    if not _call(view, "call_method", "view") or view.kwargs:
        return None
    shape = view.args[1] if len(view.args) == 2 else view.args[1:]
    return tuple(shape) if isinstance(shape, (tuple, list)) else None


def _heads(piece: fx.Node, head_dim: int) -> fx.Node | None:
    """``piece.view(1, T, -1, D).transpose(1, 2)`` -> the transposed node (the head states)."""
    view = _sole_user(piece)
    shape = _view_shape(view)
    if shape is None or len(shape) != 4 or shape[-1] != head_dim:
        return None
    states = _sole_user(view)
    if _call(states, "call_method", "transpose") and states.args[1:] == (1, 2):
        return states
    return None


def _rotations(split: fx.Node) -> tuple[Any, ...] | None:
    """``split(qkv, [Hq*D, Hkv*D, Hkv*D], -1)`` whose q and k pieces are viewed as heads and
    rotated by one ``cos``/``sin`` -> ``(cos, sin, sizes, [(q_embed, q_states), (k_embed,
    k_states)], dead nodes)``, else None."""
    if split.op != "call_function" or split.target not in _SPLITS:
        return None
    sizes = split.args[1] if len(split.args) > 1 else None
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if not isinstance(sizes, (list, tuple)) or len(sizes) != 3 or dim != -1:
        return None
    pieces = {u.args[1]: u for u in split.users if _call(u, "call_function", operator.getitem)}
    if set(pieces) != {0, 1, 2} or len(split.users) != 3:
        return None
    shape = _view_shape(_sole_user(pieces[0]))
    head_dim = shape[-1] if shape else None
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        return None
    matched, tables, dead = [], set(), []
    for index in (0, 1):  # q, then k
        states = _heads(pieces[index], head_dim)
        rotation = _rotation(states, head_dim) if states is not None else None
        if rotation is None:
            return None
        embed, cos, sin, nodes = rotation
        tables.add((cos, sin))
        matched.append((embed, states))
        dead += nodes
    if len(tables) != 1:  # q and k rotated by other tables
        return None
    cos_value, sin_value = _value(cos), _value(sin)
    if not all(isinstance(v, torch.Tensor) for v in (cos_value, sin_value)):
        return None
    if cos_value.shape[-1] != head_dim or sin_value.shape != cos_value.shape:
        return None
    if not all(isinstance(n, int) and n % head_dim == 0 for n in sizes[:2]):
        return None
    return cos, sin, sizes, matched, dead


def _match(call: fx.Node) -> tuple[Any, ...] | None:
    """A ``norm_projections`` call of one weight whose output is split into q, k, v and rotated
    -> ``(cos, sin, rope_cols, [(q_embed, q_states), (k_embed, k_states)], dead nodes)``."""
    if len(call.args) != 5:
        return None
    qkv = [u for u in call.users if _call(u, "call_function", operator.getitem) and u.args[1] == 0]
    split = _sole_user(qkv[0]) if len(qkv) == 1 else None
    found = _rotations(split) if split is not None else None
    if found is None:
        return None
    cos, sin, sizes, matched, dead = found
    a_value, cos_value, sin_value = _value(call.args[0]), _value(cos), _value(sin)
    if not isinstance(a_value, torch.Tensor) or cos_value.dim() != a_value.dim():
        return None
    if cos_value.dtype != a_value.dtype or sin_value.dtype != a_value.dtype:
        return None  # the op takes cos/sin in the model's dtype, as the model casts them
    return cos, sin, sizes[0] + sizes[1], matched, dead


_VIEWS = frozenset({"transpose", "reshape", "view", "contiguous"})  # (call_method names)
_SHAPE_READERS = frozenset({"new_empty", "size", "dim"})  # methods that read no values


def _attention_reading(embeds: list[fx.Node]) -> fx.Node | None:
    """The ``paged_ops::write_kv_and_attend`` call whose query and key (arguments 0 and 1) are
    ``embeds`` ``[q_embed, k_embed]`` through views alone, where nothing else reads their values
    (``new_empty`` and ``size`` read the shape only), and that rotates nothing yet; else None."""
    attention = None
    for index, embed in enumerate(embeds):
        node = embed
        while True:
            users = [
                u for u in node.users if u.op != "call_method" or u.target not in _SHAPE_READERS
            ]
            if len(users) != 1:
                return None
            (user,) = users
            if user.op == "call_method" and user.target in _VIEWS:
                node = user
                continue
            if not _call(user, "call_function", torch.ops.paged_ops.write_kv_and_attend.default):
                return None
            if len(user.args) <= 1 or user.args[index] is not node or node in user.args[2:]:
                return None
            if attention is not None and attention is not user:
                return None
            attention = user
            break
    if attention is None or attention.kwargs.get("rope_cos") is not None:
        return None
    return attention


def _drop_rotation(graph: fx.Graph, cos: fx.Node, sin: fx.Node, matched: list, dead: list) -> None:
    """Give each rotation's users its unrotated states and erase what nobody reads any more."""
    for embed, states in matched:
        embed.replace_all_uses_with(states)
    for node in dead:  # embed first: each node's users are gone by its turn
        if not node.users:
            graph.erase_node(node)
    for node in (cos, sin):  # the unsqueezes the rotations read, when nothing else does
        for user in list(node.users):
            if _unsqueezed(user) is node and not user.users:
                graph.erase_node(user)


def _fuse_into_attention(graph: fx.Graph) -> int:
    """Every q/k rotation read by a ``write_kv_and_attend`` call alone goes into that call
    (``rope_cos``/``rope_sin``); returns the rotations moved."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    moved = 0
    for split in list(graph.nodes):
        found = _rotations(split) if split.op == "call_function" else None
        if found is None:
            continue
        cos, sin, _, matched, dead = found
        attention = _attention_reading([embed for embed, _ in matched])
        if attention is None or order[cos] > order[attention] or order[sin] > order[attention]:
            continue
        attention.kwargs = {**attention.kwargs, "rope_cos": cos, "rope_sin": sin}
        _drop_rotation(graph, cos, sin, matched, dead)
        moved += 1
    return moved


def fuse_rope_projections(gm: fx.GraphModule, into_attention: bool = False) -> int:
    """Move each matched q/k rotation into the kernels (see the module docstring): with
    ``into_attention`` into the ``write_kv_and_attend`` call that alone reads it, else (and for
    the rest) into its ``norm_projections`` call; returns the rotations moved."""
    graph = gm.graph
    fused = _fuse_into_attention(graph) if into_attention else 0
    order = {node: i for i, node in enumerate(graph.nodes)}
    for call in list(graph.nodes):
        if not _call(call, "call_function", norm_projections):
            continue
        match = _match(call)
        if match is None:
            continue
        cos, sin, rope_cols, matched, dead = match
        if order[cos] > order[call] or order[sin] > order[call]:
            continue  # the tables' rows are read after the projection (not seen in the models)
        a, b, g, eps, weight = call.args
        call.target = norm_projections_rope
        call.args = (a, b, g, eps, rope_cols, cos, sin, weight)
        _drop_rotation(graph, cos, sin, matched, dead)
        fused += 1
    if fused:
        graph.lint()
        gm.recompile()
    return fused
