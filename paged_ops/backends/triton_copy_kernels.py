"""Triton kernel of :mod:`paged_ops.mapped_copy`: a word-by-word copy, one tile per program."""

from __future__ import annotations

import triton
import triton.language as tl


# n unspecialised: the metadata buffer and every batch's ids share one compiled variant, built at
# the engine's warm-up (its first metadata copy), so no step waits for Triton's JIT
@triton.jit(do_not_specialize=["n"])
def copy_words_kernel(
    src_ptr,  # [n] int32 words (device memory, or pinned host memory through its mapped address)
    dst_ptr,  # [n] int32 words (the same)
    n,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
