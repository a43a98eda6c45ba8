"""Rotate-half RoPE of a step's query and key heads in one launch (paged_ops/rope.py's formula).

Where the attention kernel cannot rotate them as it reads them (prefill and mixed steps, an FP8
cache, the prefill kernel), the triton backend rotates the query and key first with this kernel:
one launch per layer, as the model's own RoPE kernel under Inductor was (a float32 torch
expression would be seven launches and float32 temporaries: ~4 ms per 4,096-token prefill step of
a 16-layer model, benchmarks/NOTES.md section 34).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_ops.backends.triton_kernels import _rope_partner
from paged_ops.backends.triton_launch import launcher, next_power_of_2


@triton.jit
def _rotate_rows(
    src, dst, tok, stride_t, stride_h, c, s, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ROTATED: tl.constexpr = -1,
):  # fmt: skip
    """Token ``tok``'s ``HEADS`` rows of ``src`` rotated by ``c``/``s`` ``[BLOCK_D]`` into
    ``dst`` (contiguous ``[T, HEADS, HEAD_DIM]``); with ``ROTATED >= 0`` only the first
    ``ROTATED`` heads are rotated and the rest copied."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    partner, sign = _rope_partner(offs_d, HEAD_DIM)
    mask = (offs_h < HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_H, BLOCK_D]
    rotated = mask
    if ROTATED >= 0:
        rotated = mask & (offs_h < ROTATED)[:, None]
    rows = src + tok * stride_t + offs_h[:, None] * stride_h
    x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(rows + partner[None, :], mask=rotated, other=0.0).to(tl.float32)
    y = x * c[None, :] + (sign[None, :] * x_partner) * s[None, :]
    if ROTATED >= 0:
        y = tl.where(rotated, y, x)
    out = dst + (tok * HEADS + offs_h[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(out, y.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def rotate_heads_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    q_out_ptr,  # [T, Hq, D] contiguous
    k_out_ptr,  # [T, Hkv, D] contiguous
    cos_ptr,  # [T, D], unit stride along D
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program ``(t, 0)`` rotates token ``t``'s query heads, ``(t, 1)`` its key heads: ``x * cos
    + cat(-x2, x1) * sin`` in float32, rounded once to the output's dtype."""
    tok = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    c = tl.load(cos_ptr + tok * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tok * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    if tl.program_id(1) == 0:
        _rotate_rows(q_ptr, q_out_ptr, tok, stride_qt, stride_qh, c, s, NUM_Q_HEADS, HEAD_DIM,
                     BLOCK_H, BLOCK_D)  # fmt: skip
    else:
        _rotate_rows(k_ptr, k_out_ptr, tok, stride_kt, stride_kh, c, s, NUM_K_HEADS, HEAD_DIM,
                     BLOCK_H, BLOCK_D)  # fmt: skip


def rotate_heads(
    query: torch.Tensor,  # [T, Hq, D], unit stride along D
    key: torch.Tensor | None,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D], unit stride along D
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # rotated copies, contiguous
    """Rotate-half RoPE of ``query`` (and ``key``) by rows of ``cos``/``sin``, one launch."""
    num_tokens, num_q_heads, head_dim = query.shape
    if query.stride(-1) != 1 or (key is not None and key.stride(-1) != 1):
        query = query.contiguous()
        key = key.contiguous() if key is not None else None
    q_out = query.new_empty(query.shape)
    k_out = key.new_empty(key.shape) if key is not None else None
    if num_tokens == 0:
        return q_out, k_out
    # without a key: only programs (t, 0) run, and the key arguments are the query's
    k_in, k_dst = (key, k_out) if key is not None else (query, q_out)
    launcher(rotate_heads_kernel)[(num_tokens, 2 if key is not None else 1)](
        query, k_in, q_out, k_dst, cos, sin, query.stride(0), query.stride(1), k_in.stride(0),
        k_in.stride(1), cos.stride(0), sin.stride(0), NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=k_in.shape[1], HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(max(num_q_heads, k_in.shape[1])),
        BLOCK_D=next_power_of_2(head_dim), num_warps=4,
    )  # fmt: skip
    return q_out, k_out


@triton.jit
def rotate_columns_kernel(
    x_ptr,  # [M, N], unit last stride
    out_ptr,  # [M, N] contiguous
    cos_ptr,  # [M, D], unit stride along D
    sin_ptr,
    stride_x,
    stride_cos,
    stride_sin,
    HEADS: tl.constexpr,  # N // D
    ROTATED: tl.constexpr,  # leading heads rotated
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program ``t``: row ``t`` of ``x`` as ``HEADS`` heads, the first ``ROTATED`` rotated by its
    cos/sin row (float32, rounded once), the others copied, into ``out``."""
    tok = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    c = tl.load(cos_ptr + tok * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tok * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    _rotate_rows(x_ptr, out_ptr, tok, stride_x, HEAD_DIM, c, s, HEADS, HEAD_DIM, BLOCK_H,
                 BLOCK_D, ROTATED)  # fmt: skip


def rotate_columns(
    x: torch.Tensor,  # [M, N], unit last stride, N a multiple of D
    cos: torch.Tensor,  # [M, D], unit stride along D
    sin: torch.Tensor,
    rope_cols: int,  # a multiple of D, <= N
) -> torch.Tensor:  # [M, N] contiguous
    """Rotate-half RoPE of ``x``'s first ``rope_cols`` columns taken as heads of ``D`` (a stacked
    q/k/v projection's q and k), the other columns copied: one launch of one program per row
    (the model's two RoPE expressions would be one Inductor kernel; in torch they are seven)."""
    rows, width = x.shape
    head_dim = cos.shape[-1]
    out = x.new_empty((rows, width))
    if rows == 0:
        return out
    heads = width // head_dim
    block_h, block_d = next_power_of_2(heads), next_power_of_2(head_dim)
    launcher(rotate_columns_kernel)[(rows,)](
        x, out, cos, sin, x.stride(0), cos.stride(0), sin.stride(0), HEADS=heads,
        ROTATED=rope_cols // head_dim, HEAD_DIM=head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4 if block_h * block_d <= 4096 else 8,
    )  # fmt: skip
    return out
