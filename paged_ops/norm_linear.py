"""``paged_ops::add_rms_norm_linear``: a decoder layer's residual add, RMSNorm and the projection
that reads the norm, in one op: ``h = x + residual``, ``out = (rms_norm(h) * g) @ W^T``.

The engine's graph passes (:func:`paged_ops.engine.norm_fusion.fuse_norm_linears` and
:func:`paged_ops.engine.rope_fusion.fuse_rope_projections`, with ``LLM(small_linears=...)``, on by
default for CUDA models) put it where a Llama-style ``RMSNorm`` of a residual sum feeds
projections, with ``cos``/``sin`` where that projection is a stacked q/k/v whose q and k are
rotated next. A step of one token runs one Triton kernel (the GEMV does the add and the norm:
:mod:`paged_ops.backends.triton_norm_linear_kernels`); more tokens run the add + norm kernel,
then ``small_linear`` (a Triton GEMV up to 16 rows, else ``F.linear``), then with ``cos``/``sin``
one rotation kernel (:func:`paged_ops.backends.triton_rope_kernels.rotate_columns`). Without
triton (or on a CPU without ``TRITON_INTERPRET=1``) it is the model's own math in torch. It is one opaque node for
torch.compile (fake kernel from shapes only); it records no autograd (the engine runs under
``inference_mode``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_ops.linear import project_rows
from paged_ops.triton_dispatch import kernel_module, runs_kernels_on

_lib = torch.library.Library("paged_ops", "FRAGMENT")  # noqa: TOR901 (kept alive for the process)
_lib.define(
    "add_rms_norm_linear(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor weight,"
    " Tensor? cos=None, Tensor? sin=None, int rope_cols=0) -> (Tensor, Tensor)"
)


def _check(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rope_cols: int = 0,
) -> None:
    if x.dim() < 1 or residual.shape != x.shape:
        raise ValueError(
            f"x and residual must have one shape [..., K], got {tuple(x.shape)} and "
            f"{tuple(residual.shape)}"
        )
    k = x.shape[-1]
    if norm_weight.shape != (k,):
        raise ValueError(
            f"norm_weight must have shape [K] = ({k},), got {tuple(norm_weight.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight must be [N, K] with K = {k}, got {tuple(weight.shape)}")
    tensors = [("residual", residual), ("norm_weight", norm_weight), ("weight", weight)]
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin go together: give both or neither")
    if cos is not None:
        _check_rope(x, weight, cos, sin, rope_cols)
        tensors += [("cos", cos), ("sin", sin)]
    elif rope_cols != 0:
        raise ValueError(f"rope_cols={rope_cols} needs cos and sin")
    for name, t in tensors:
        if t.dtype != x.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from x's {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} device {t.device} differs from x's {x.device}")


def _check_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_cols: int
) -> None:
    d = cos.shape[-1] if cos.dim() else 0
    if cos.shape != (*x.shape[:-1], d) or sin.shape != cos.shape or d < 2 or d % 2:
        raise ValueError(
            f"cos and sin must be [..., D] with x's leading dims {tuple(x.shape[:-1])} and an even "
            f"D, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if not 0 < rope_cols <= weight.shape[0] or rope_cols % d:
        raise ValueError(
            f"rope_cols must be a multiple of the head size {d} in (0, N = {weight.shape[0]}], "
            f"got {rope_cols}"
        )


def _torch_math(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h`` and the normalised ``h`` times ``norm_weight``, as transformers' Llama ``RMSNorm``
    computes them (float32 statistics, the row rounded to the dtype before the weight)."""
    h = x + residual
    hf = h.to(torch.float32)
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return h, norm_weight * normed.to(x.dtype)


def rotate(
    out: torch.Tensor,  # [..., N]
    cos: torch.Tensor,  # [..., D]
    sin: torch.Tensor,  # [..., D]
    rope_cols: int,
) -> torch.Tensor:  # [..., N]
    """transformers' rotate-half RoPE (``apply_rotary_pos_emb``'s formula) on the first
    ``rope_cols`` columns of ``out`` taken as heads of ``D``; the other columns as they are."""
    d = cos.shape[-1]
    heads = out[..., :rope_cols].unflatten(-1, (-1, d))  # [..., H, D]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [..., 1, D]
    x1, x2 = heads[..., : d // 2], heads[..., d // 2 :]
    rotated = heads * c + torch.cat((-x2, x1), dim=-1) * s
    return torch.cat((rotated.flatten(-2), out[..., rope_cols:]), dim=-1)


def _kernels():  # noqa: ANN202 (a module, or None without triton)
    return kernel_module("paged_ops.backends.triton_norm_linear_kernels")


def _impl(
    x: torch.Tensor,  # [..., K]
    residual: torch.Tensor,  # [..., K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    cos: torch.Tensor | None = None,  # [..., D]
    sin: torch.Tensor | None = None,  # [..., D]
    rope_cols: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [..., N], h [..., K]
    _check(x, residual, norm_weight, weight, cos, sin, rope_cols)
    k = x.shape[-1]
    x2d = x.reshape(-1, k)  # [M, K]
    r2d = residual.reshape(-1, k)
    kernels = _kernels()
    if kernels is None or not runs_kernels_on(x2d) or x2d.stride(-1) != 1 or r2d.stride(-1) != 1:
        h, y = _torch_math(x, residual, norm_weight, eps)
        out = F.linear(y, weight)
        return (out if cos is None else rotate(out, cos, sin, rope_cols)), h
    norm_weight = norm_weight.contiguous()
    d = cos.shape[-1] if cos is not None else 0
    in_kernel = cos is None or kernels.rope_fits(weight.shape[0], d)
    if x2d.shape[0] == 1 and weight.stride(1) == 1 and in_kernel:
        rope = None if cos is None else (cos.reshape(d).contiguous(), sin.reshape(d).contiguous(),
                                         rope_cols)  # fmt: skip
        out, h = kernels.add_rms_norm_gemv(x2d, r2d, norm_weight, eps, weight, rope)  # [1, N]
        return out.view(*x.shape[:-1], weight.shape[0]), h.view(x.shape)
    h, y = kernels.add_rms_norm(x2d, r2d, norm_weight, eps)  # [M, K] each
    out = project_rows(y, weight)  # [M, N]; small_linear's kernel choice, checked above
    if cos is not None and weight.shape[0] % d == 0 and out.stride(-1) == 1:
        rope_kernels = kernel_module("paged_ops.backends.triton_rope_kernels")
        cos2d, sin2d = cos.reshape(-1, d), sin.reshape(-1, d)  # [M, D]
        if cos2d.stride(-1) != 1 or sin2d.stride(-1) != 1:
            cos2d, sin2d = cos2d.contiguous(), sin2d.contiguous()
        out = rope_kernels.rotate_columns(out, cos2d, sin2d, rope_cols)  # [M, N], one launch
    elif cos is not None:  # heads that do not tile the projection: the torch expression
        out = rotate(out, cos.reshape(-1, d), sin.reshape(-1, d), rope_cols)
    return out.view(*x.shape[:-1], weight.shape[0]), h.view(x.shape)


for _device in ("CPU", "CUDA"):
    _lib.impl("add_rms_norm_linear", _impl, _device)


@torch.library.register_fake("paged_ops::add_rms_norm_linear", lib=_lib)
def _fake(x, residual, norm_weight, eps, weight, cos=None, sin=None, rope_cols=0):  # noqa: ANN001
    return x.new_empty((*x.shape[:-1], weight.shape[0])), x.new_empty(x.shape)


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rope_cols: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add, an RMSNorm and a projection of the normalised sum; optionally the
    rotary embedding of the projection's query and key columns.

    Args:
        x: ``[..., K]``, e.g. the attention block's output ``[1, T, K]``.
        residual: ``[..., K]``, the residual stream, x's shape, dtype and device.
        norm_weight: ``[K]``, the RMSNorm's weight.
        eps: the RMSNorm's epsilon.
        weight: ``[N, K]`` (``nn.Linear.weight``, no bias); any row stride.
        cos, sin: ``[..., D]`` per token (x's leading dims), x's dtype: with them, the first
            ``rope_cols`` output columns, taken as heads of ``D``, leave rotated as transformers'
            ``apply_rotary_pos_emb`` rotates q and k (``out * cos + rotate_half(out) * sin``).
        rope_cols: columns to rotate, a multiple of ``D`` (e.g. the q and k heads of a stacked
            q/k/v projection); 0 without cos/sin.

    Returns:
        ``(out, h)``: ``out = (rms_norm(h) * norm_weight) @ weight.T`` ``[..., N]`` (rotated as
        above) and ``h = x + residual`` ``[..., K]``, both in x's dtype. One row on CUDA (or
        under ``TRITON_INTERPRET=1`` on float16/float32) is one Triton kernel that scales by the
        norm after its sum (bfloat16 noise against the model's rounding) and rotates in its
        epilogue (``D / 2`` a multiple of 4, ``N`` of ``D``); otherwise the model's math.

    Raises:
        ValueError: shapes that do not match, cos without sin, a bad ``rope_cols``, tensors on
            different devices.
        TypeError: dtypes differ.
    """
    _check(x, residual, norm_weight, weight, cos, sin, rope_cols)
    return torch.ops.paged_ops.add_rms_norm_linear.default(
        x, residual, norm_weight, eps, weight, cos, sin, rope_cols
    )
