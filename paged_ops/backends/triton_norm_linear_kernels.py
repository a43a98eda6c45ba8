"""Triton kernels of ``paged_ops::add_rms_norm_linear``: a decoder layer's residual add, its RMSNorm
and the projection that reads the norm, ``out = rms_norm(x + residual) * g @ W^T``.

In a batch-1 decode step the residual add + RMSNorm is a kernel of its own before each of the
two norm-fed projections (q/k/v and gate/up), ~2 us of a 2,048-wide row each plus a launch
boundary: 32 kernels of a 16-layer step (benchmarks/NOTES.md section 25). Here it is folded into
the GEMV:

- :func:`add_rms_norm_gemv_kernel` (one row, ``M == 1``): each program owns ``BLOCK_N`` rows of
  ``W`` and streams them in ``[BLOCK_N, BLOCK_K]`` tiles as ``small_linear``'s FMA path does. For
  each ``K`` tile it forms ``h = x + residual`` (rounded to the model's dtype, as the model's add
  is), adds ``h^2`` to a running sum and ``W * (h * g)`` to the products; the norm's scale
  ``rsqrt(mean(h^2) + eps)`` is one number per row, so it multiplies the sum after the loop. No
  program waits for a norm before its first weight tile. Program 0 also stores ``h`` (the next
  residual). With ``ROPE`` (a stacked q/k/v projection) a program owns ``BLOCK_N / 2`` rows of
  a head's first half and their partners ``D / 2`` rows on, so that its epilogue rotates them as
  transformers' ``apply_rotary_pos_emb`` does (``out * cos + rotate_half(out) * sin``, from the
  projection rounded to the dtype) in place of the model's RoPE kernel.
- :func:`add_rms_norm_kernel` (any ``M``): one program per row writes ``h`` and the normalised
  row, rounded as the model rounds it (``(h * rsqrt(...)).to(dtype) * g``); the projection
  then runs as ``small_linear``/``F.linear`` would.
- :func:`reduce_add_rms_norm_kernel` (any ``M``, ``LLM(down_norm_fusion=True)``): the same, its
  ``x`` being the sum of a split-K GEMM's float32 partials (a gated MLP's down projection at
  64-256 rows, ``paged_ops::silu_mul_add_rms_norm_linear``): the partials summed in the split-K
  reduce's order and rounded as it stores them, so ``h`` and ``y`` are bitwise what the reduce
  kernel and :func:`add_rms_norm_kernel` give, in one launch instead of two (H200: 2.1-2.7 vs
  3.1-4.0 us at 64-256 rows of 2,048; benchmarks/NOTES.md section 39).

The one-row kernel scales after the sum, so its result differs from the model's (which rounds the
normalised row to the dtype before ``* g`` and the matmul) by that rounding: bfloat16 noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_ops.backends.triton_launch import cdiv, launcher, next_power_of_2


@triton.jit
def add_rms_norm_gemv_kernel(
    x_ptr,  # [K] the block's output (one token)
    res_ptr,  # [K] the residual stream
    g_ptr,  # [K] the norm's weight
    w_ptr,  # [N, K]
    out_ptr,  # [N]
    h_ptr,  # [K] x + residual, stored by program 0
    cos_ptr,  # [HEAD_DIM] ROPE: the token's rotary cos row (else unused)
    sin_ptr,  # [HEAD_DIM] ROPE: its sin row
    N,
    K,
    stride_wn,
    eps,
    rope_cols,  # ROPE: output columns [0, rope_cols) are rotated per head (a multiple of HEAD_DIM)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    NUM_STAGES: tl.constexpr,
    ROPE: tl.constexpr,  # rotate the first rope_cols outputs (rotate-half RoPE of HEAD_DIM)
    HEAD_DIM: tl.constexpr,
):
    pid = tl.program_id(0)
    if ROPE:  # BLOCK_N // 2 rows of a head's first half and their partners HEAD_DIM // 2 on
        HALF: tl.constexpr = HEAD_DIM // 2
        QUADS: tl.constexpr = HALF // (BLOCK_N // 2)  # programs per head
        j = tl.arange(0, BLOCK_N)
        first = (pid // QUADS) * HEAD_DIM + (pid % QUADS) * (BLOCK_N // 2)
        offs_n = first + j % (BLOCK_N // 2) + tl.where(j < BLOCK_N // 2, 0, HALF)
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # padding rows repeat the last: no load masks
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # summed over K after the loop
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    h_end = tl.where(pid == 0, K, 0)  # program 0 stores h
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        kk = k + offs_k
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptr + kk)
            r = tl.load(res_ptr + kk)
            g = tl.load(g_ptr + kk)
        else:
            k_ok = kk < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + kk, mask=k_ok, other=0.0)
            r = tl.load(res_ptr + kk, mask=k_ok, other=0.0)
            g = tl.load(g_ptr + kk, mask=k_ok, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the model's add, rounded
        tl.store(h_ptr + kk, h, mask=kk < h_end)
        hf = h.to(tl.float32)
        squares += hf * hf
        acc += w.to(tl.float32) * (hf * g.to(tl.float32))[None, :]
        w_ptrs += BLOCK_K
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
    out = (tl.sum(acc, axis=1) * rstd).to(out_ptr.dtype.element_ty)  # [BLOCK_N] the projection
    if ROPE:  # out * cos + rotate_half(out) * sin, from the rounded projection, as the model
        half_rows: tl.constexpr = BLOCK_N // 2
        pair = tl.reshape(out.to(tl.float32), (2, half_rows))  # [first half; its partners]
        side = tl.arange(0, 2)[:, None]  # [2, 1]: 0 = first half
        x1 = tl.sum(tl.where(side == 0, pair, 0.0), axis=0)  # [BLOCK_N // 2]
        x2 = tl.sum(tl.where(side == 0, 0.0, pair), axis=0)
        rotated = tl.where(side == 0, -x2[None, :], x1[None, :])  # rotate_half
        cols = offs_n % HEAD_DIM
        c = tl.reshape(tl.load(cos_ptr + cols).to(tl.float32), (2, half_rows))
        s = tl.reshape(tl.load(sin_ptr + cols).to(tl.float32), (2, half_rows))
        roped = tl.reshape(pair * c + rotated * s, (BLOCK_N,)).to(out_ptr.dtype.element_ty)
        out = tl.where(offs_n < rope_cols, roped, out)
    tl.store(out_ptr + offs_n, out, mask=offs_n < N)


@triton.jit
def _store_add_rms_norm(x, r, g_ptr, h_ptr, y_ptr, row, K, kk, ok, eps):
    """Row ``row``'s ``h = x + r`` and ``y = rms_norm(h) * g`` (``x``, ``r``: ``[BLOCK_K]`` of
    the model's dtype, ``kk``/``ok`` their columns and mask), stored rounded as the model rounds
    them: the sum, then the normalised row before ``* g``."""
    h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(h_ptr + row * K + kk, h, mask=ok)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / K + eps)
    normed = (hf * rstd).to(x.dtype)  # the model rounds the normalised row, then multiplies by g
    g = tl.load(g_ptr + kk, mask=ok, other=0.0)
    y = (normed.to(tl.float32) * g.to(tl.float32)).to(x.dtype)
    tl.store(y_ptr + row * K + kk, y, mask=ok)


@triton.jit
def add_rms_norm_kernel(
    x_ptr,  # [M, K]
    res_ptr,  # [M, K]
    g_ptr,  # [K]
    h_ptr,  # [M, K] out: x + residual
    y_ptr,  # [M, K] out: the normalised row times g
    K,
    stride_x,
    stride_r,
    eps,
    BLOCK_K: tl.constexpr,  # >= K
):
    row = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    ok = kk < K
    x = tl.load(x_ptr + row * stride_x + kk, mask=ok, other=0.0)
    r = tl.load(res_ptr + row * stride_r + kk, mask=ok, other=0.0)
    _store_add_rms_norm(x, r, g_ptr, h_ptr, y_ptr, row, K, kk, ok, eps)


@triton.jit
def reduce_add_rms_norm_kernel(
    part_ptr,  # [SPLIT_K, M, K] float32 partials of the projection whose sum is x
    res_ptr,  # [M, K]
    g_ptr,  # [K]
    h_ptr,  # [M, K] out: x + residual
    y_ptr,  # [M, K] out: the normalised row times g
    M,
    K,
    stride_r,
    eps,
    SPLIT_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= K
):
    row = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    ok = kk < K
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # split_k_reduce_kernel's order: the same bits
        acc += tl.load(part_ptr + (s * M + row) * K + kk, mask=ok, other=0.0)
    r = tl.load(res_ptr + row * stride_r + kk, mask=ok, other=0.0)
    x = acc.to(r.dtype)  # the projection's output, rounded as the reduce stores it
    _store_add_rms_norm(x, r, g_ptr, h_ptr, y_ptr, row, K, kk, ok, eps)


GEMV_BLOCK_N = 8  # rows of W per program (small_linear's one-row FMA choice)
GEMV_TILE_BYTES = 1024  # bytes of each W row per K step
GEMV_STAGES = 3
WIDE_GEMV_MIN_N = 8192  # from this width (no RoPE): WIDE_GEMV's launch


@dataclass(frozen=True, slots=True)
class GemvLaunch:
    """Launch choices of :func:`add_rms_norm_gemv`: rows of ``W`` per program, bytes of each row
    per K step, pipeline stages, warps."""

    block_n: int
    tile_bytes: int
    stages: int
    warps: int


NARROW_GEMV = GemvLaunch(GEMV_BLOCK_N, GEMV_TILE_BYTES, GEMV_STAGES, 4)
# A gated MLP's gate/up (the 1B's 16384 x 2048): 32-row programs with 512-byte steps and 2 warps
# stream it in 17.8-17.9 us against 18.7-18.9 with NARROW_GEMV, in the b=1 decode graph (H200,
# benchmarks/NOTES.md section 44; section 28's sweep of the kernel alone found the same pair best).
# The q/k/v GEMV (3072 rows, RoPE) keeps NARROW_GEMV: section 28's sweep had it best there.
WIDE_GEMV = GemvLaunch(32, 512, 3, 2)


def gemv_launch(n: int, rope: bool) -> GemvLaunch:
    """The one-row norm-GEMV's launch for an ``[N, K]`` weight (``rope``: the rotating q/k/v)."""
    return WIDE_GEMV if n >= WIDE_GEMV_MIN_N and not rope else NARROW_GEMV


def add_rms_norm_gemv(
    x: torch.Tensor,  # [1, K]
    residual: torch.Tensor,  # [1, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K], last stride 1
    rope: tuple[torch.Tensor, torch.Tensor, int] | None = None,  # cos [D], sin [D], rope_cols
) -> tuple[torch.Tensor, torch.Tensor]:  # out [1, N], h [1, K]
    """One row: ``h = x + residual``, ``out = rms_norm(h) * norm_weight @ weight.T``, one launch;
    with ``rope``, the first ``rope_cols`` outputs (whole heads of ``D``; ``N`` a multiple of
    ``D``, ``D`` of :func:`rope_fits`) leave rotated: ``out * cos + rotate_half(out) * sin`` per
    head. Shapes, dtypes and strides are the caller's to check (``paged_ops.norm_linear``)."""
    k = x.shape[1]
    n = weight.shape[0]
    launch = gemv_launch(n, rope is not None)
    block_k = min(launch.tile_bytes // x.element_size(), next_power_of_2(k))
    out = x.new_empty((1, n))  # [1, N]
    h = x.new_empty((1, k))  # [1, K]
    cos, sin, rope_cols = rope if rope is not None else (x, x, 0)
    grid = (cdiv(n, launch.block_n),)
    launcher(add_rms_norm_gemv_kernel)[grid](
        x, residual, norm_weight, weight, out, h, cos, sin, n, k, weight.stride(0), eps,
        rope_cols, BLOCK_N=launch.block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        NUM_STAGES=launch.stages, ROPE=rope is not None,
        HEAD_DIM=cos.shape[-1] if rope is not None else GEMV_BLOCK_N,
        num_warps=launch.warps, num_stages=launch.stages,
    )  # fmt: skip
    return out, h


def rope_fits(n: int, head_dim: int) -> bool:
    """Whether the one-row kernel can rotate an ``[N]`` output by heads of ``head_dim``: each
    program owns ``GEMV_BLOCK_N // 2`` rows of a head's first half and their partners."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half % (GEMV_BLOCK_N // 2) == 0 and n % head_dim == 0


def _row_warps(block_k: int) -> int:
    """Warps of a one-program-per-row norm kernel over ``block_k`` columns. The warps split the
    row's sum of squares, so kernels whose rows must agree bitwise share this rule."""
    return max(1, min(16, block_k // 256))


def add_rms_norm(
    x: torch.Tensor,  # [M, K], last stride 1
    residual: torch.Tensor,  # [M, K], last stride 1
    norm_weight: torch.Tensor,  # [K]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # h [M, K], y [M, K]
    """``h = x + residual`` and ``y = rms_norm(h) * norm_weight`` (the model's rounding), one
    launch of one program per row."""
    m, k = x.shape
    h = x.new_empty((m, k))
    y = x.new_empty((m, k))
    if m == 0:
        return h, y
    block_k = next_power_of_2(k)
    launcher(add_rms_norm_kernel)[(m,)](
        x, residual, norm_weight, h, y, k, x.stride(0), residual.stride(0), eps,
        BLOCK_K=block_k, num_warps=_row_warps(block_k),
    )  # fmt: skip
    return h, y


def reduce_add_rms_norm(
    partials: torch.Tensor,  # [SPLIT_K, M, K] float32, contiguous
    residual: torch.Tensor,  # [M, K], last stride 1
    norm_weight: torch.Tensor,  # [K]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # h [M, K], y [M, K]
    """``x = partials.sum(0)`` rounded to residual's dtype (as ``split_k_reduce_kernel`` stores
    it), ``h = x + residual`` and ``y = rms_norm(h) * norm_weight`` as :func:`add_rms_norm`
    gives them: one launch of one program per row, with :func:`add_rms_norm`'s warps (the row's
    sum of squares reduced in the same order: the same bits; 8 at the 1B's 2,048, H200 probe,
    NOTES.md section 39)."""
    split, m, k = partials.shape
    block_k = next_power_of_2(k)
    h = residual.new_empty((m, k))
    y = residual.new_empty((m, k))
    if m == 0:
        return h, y
    launcher(reduce_add_rms_norm_kernel)[(m,)](
        partials, residual, norm_weight, h, y, m, k, residual.stride(0), eps,
        SPLIT_K=split, BLOCK_K=block_k, num_warps=_row_warps(block_k),
    )  # fmt: skip
    return h, y
