"""A test kernel around the triton backend's ``_fp8_pairs_to_float16`` (imported only by tests that
have Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_ops.backends import triton_kernels as kernels
from paged_ops.fp8 import fp8_format


@triton.jit
def _convert_kernel(
    x_ptr, lo_ptr, hi_ptr, n, FP8_MAN: tl.constexpr, FP8_BIAS: tl.constexpr,
    FP8_SUB_ULP: tl.constexpr, BY_HAND: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0)
    lo, hi = kernels._fp8_pairs_to_float16(x, FP8_MAN, FP8_BIAS, FP8_SUB_ULP, BY_HAND)
    tl.store(lo_ptr + offs, lo, mask=offs < n)
    tl.store(hi_ptr + offs, hi, mask=offs < n)


def fp8_pairs_to_float16(
    pairs: torch.Tensor, fp8_dtype: torch.dtype, by_hand: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pairs`` [n] int16 (two FP8 values each) -> (low byte's value, high byte's value) as
    float16 [n] each, as the attention kernel decodes V (``by_hand``: the interpreter's integer
    path; else the GPU's inline PTX)."""
    lo = torch.empty(pairs.shape, dtype=torch.float16, device=pairs.device)
    hi = torch.empty_like(lo)
    fmt = fp8_format(fp8_dtype)
    n = pairs.numel()
    _convert_kernel[(triton.cdiv(n, 1024),)](
        pairs, lo, hi, n, FP8_MAN=fmt["FP8_MAN"], FP8_BIAS=fmt["FP8_BIAS"],
        FP8_SUB_ULP=fmt["FP8_SUB_ULP"], BY_HAND=by_hand,
    )  # fmt: skip
    return lo, hi


def all_pairs_and_values(fp8_dtype: torch.dtype, device: str = "cpu"):
    """Every int16 pattern [65536], each byte's exact value as float16 [65536, 2] (low byte
    first) and which patterns hold no NaN [65536]."""
    pairs = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    values = pairs.view(torch.uint8).view(-1, 2).view(fp8_dtype).to(torch.float16)
    return pairs.to(device), values.to(device), values.isfinite().all(1).to(device)
