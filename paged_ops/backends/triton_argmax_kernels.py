"""Triton kernels of ``paged_ops::greedy_argmax``: the first index of each row's maximum.

A decode step's greedy choice reads ``[S, V]`` logits once (V ~ 10^5). Compiled by Inductor as
``max`` over 16 pieces per row it took 66.5 us per step at S=256 on an H200 (benchmarks/NOTES.md
section 21): 1-2 TB/s, two reductions over the data. Here each program streams its part of a row
in ``BLOCK``-wide tiles and keeps, per lane, the largest value seen and its first index
(elementwise: no cross-thread reduction inside the loop); one reduction at the end picks the row
part's maximum and, among the lanes holding it, the smallest index. Rows are split into ``P``
parts when ``S`` alone would leave SMs idle; a second kernel then combines the parts in order.

NaN counts as larger than any number (``torch.argmax``'s rule): the first NaN wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_ops.backends.triton_launch import launcher


@triton.jit
def _is_nan(x):
    return x != x


@triton.jit
def argmax_parts_kernel(
    logits_ptr,  # [S, V], any float dtype, row stride stride_s, unit column stride
    part_max_ptr,  # [S, P] float32 (unused when P == 1)
    part_idx_ptr,  # [S, P] int64, or [S] int64 (the result) when P == 1
    V,
    stride_s,
    part_width,  # columns per part, a multiple of BLOCK
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    lo = part * part_width
    base = logits_ptr + row.to(tl.int64) * stride_s
    cols = lo + tl.arange(0, BLOCK)  # [BLOCK]
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.full((BLOCK,), 2**31 - 1, tl.int32)
    for start in tl.range(0, part_width, BLOCK, num_stages=NUM_STAGES):
        idx = cols + start
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        # strictly greater keeps a lane's first index; a NaN beats everything but an earlier NaN
        take = (x > best) | (_is_nan(x) & ~_is_nan(best))
        take = take & (idx < V)
        best = tl.where(take, x, best)
        best_idx = tl.where(take, idx, best_idx)
    any_nan = tl.max(_is_nan(best).to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(_is_nan(best), float("-inf"), best), axis=0)
    hit = tl.where(any_nan, _is_nan(best), best == top)
    first = tl.min(tl.where(hit, best_idx, 2**31 - 1), axis=0)
    # an all -inf part (or one past V): its first column, so that a row of -inf gives index 0
    first = tl.where(first == 2**31 - 1, tl.minimum(lo, V - 1), first)
    if P == 1:
        tl.store(part_idx_ptr + row, first.to(tl.int64))
    else:
        value = tl.where(any_nan, float("nan"), top)
        tl.store(part_max_ptr + row * P + part, value)
        tl.store(part_idx_ptr + row * P + part, first.to(tl.int64))


@triton.jit
def argmax_combine_kernel(
    part_max_ptr,  # [S, P] float32
    part_idx_ptr,  # [S, P] int64
    out_ptr,  # [S] int64
    P: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, P)
    m = tl.load(part_max_ptr + row * P + offs)  # [P]
    nan = _is_nan(m)
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(nan, float("-inf"), m), axis=0)
    hit = tl.where(any_nan, nan, m == top)
    first_part = tl.min(tl.where(hit, offs, P), axis=0)
    tl.store(out_ptr + row, tl.load(part_idx_ptr + row * P + first_part))


def split_rows(vocab: int, parts: int, block: int) -> tuple[int, int]:
    """Columns per part (a multiple of ``block``) and the part count for ``parts`` asked: no
    part wholly past the vocabulary, and a power of two (the combine's ``tl.arange``)."""
    width = -(-vocab // (parts * block)) * block
    return width, 1 << (-(-vocab // width) - 1).bit_length()


def launch(
    logits: torch.Tensor,  # [S, V], unit stride along V
    out: torch.Tensor,  # [S] int64
    part_max: torch.Tensor | None,  # [S, P] float32 when P > 1
    part_idx: torch.Tensor | None,  # [S, P] int64 when P > 1
    width: int,  # columns per part (split_rows)
    parts: int,  # P (split_rows)
    block: int,
    stages: int,
    warps: int,
) -> torch.Tensor:  # out
    """The parts kernel over ``(S, P)`` programs (writing ``out`` itself when ``P == 1``), then
    the combine; buffers given, so a caller may keep them across calls (a timing loop)."""
    rows, vocab = logits.shape
    if parts == 1:
        launcher(argmax_parts_kernel)[(rows, 1)](
            logits, out, out, vocab, logits.stride(0), width,
            P=1, BLOCK=block, NUM_STAGES=stages, num_warps=warps,
        )  # fmt: skip
        return out
    launcher(argmax_parts_kernel)[(rows, parts)](
        logits, part_max, part_idx, vocab, logits.stride(0), width,
        P=parts, BLOCK=block, NUM_STAGES=stages, num_warps=warps,
    )  # fmt: skip
    launcher(argmax_combine_kernel)[(rows,)](part_max, part_idx, out, P=parts, num_warps=1)
    return out
