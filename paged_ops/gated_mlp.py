"""``paged_ops::add_rms_norm_gated_mlp``: a decoder layer's residual add and RMSNorm, its gated
MLP (gate/up projection, SiLU-mul, down projection) and optionally the next layer's add, norm
and first projection, in one op::

    h = x + residual
    gate, up = (rms_norm(h) * g) @ W_gate_up^T    # [..., I] each: the stacked weight's halves
    down = (silu(gate) * up) @ W_down^T
    # without next_weight: return (down, h)
    h2 = down + h                                 # with next_weight: the next layer's start
    out = (rms_norm(h2) * g2) @ W_next^T          # return (out, h2)

Its value is that of the ops it replaces (``add_rms_norm_linear`` of the gate/up weight, then
``silu_mul_linear``, or ``silu_mul_add_rms_norm_linear`` with ``next_weight``), bitwise, but at
one place: in a CUDA graph step of at least ``GATED_GEMM_MIN_ROWS`` rows on Hopper
(:func:`paged_ops.linear.gated_gemm_config`) the gate/up projection and the SiLU-mul are one
Triton kernel (:func:`~paged_ops.backends.triton_gemm_kernels.gated_gemm`) that keeps both
halves' tiles in registers and stores only the product: no ``[M, 2I]`` round trip, one launch
fewer (H200, inside the model's graphs: 27.3 vs 27.75 us per layer at 256 rows, a decode graph
1.8% shorter; 16-24 us less per layer at 4,096 rows; benchmarks/NOTES.md section 43). Its halves
are rounded to the dtype before the SiLU-mul, as the stored gate/up output is, so the results
differ from the other route only by the GEMM's accumulation order.

The engine's graph pass (:func:`paged_ops.engine.mlp_fusion.fuse_gated_mlps`, with
``LLM(small_linears=...)`` and without ``fold_conds``) puts it where a ``norm_projections`` of
one stacked gate/up weight feeds only the MLP's down projection. It is one opaque node for
torch.compile (fake kernel from shapes only); it records no autograd.
"""

from __future__ import annotations

import torch

from paged_ops import linear
from paged_ops import mlp_linear as _mlp  # noqa: F401 (registers paged_ops::silu_mul_linear)
from paged_ops import mlp_norm_linear as _mlp_norm
from paged_ops import norm_linear as _norm
from paged_ops.triton_dispatch import kernel_module, runs_kernels_on

_lib = torch.library.Library("paged_ops", "FRAGMENT")  # noqa: TOR901 (kept alive for the process)
_lib.define(
    "add_rms_norm_gated_mlp(Tensor x, Tensor residual, Tensor norm_weight, float eps,"
    " Tensor gate_up_weight, Tensor down_weight, Tensor? next_norm_weight=None,"
    " float next_eps=0.0, Tensor? next_weight=None) -> (Tensor, Tensor)"
)


def _check(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    next_norm_weight: torch.Tensor | None,
    next_weight: torch.Tensor | None,
) -> None:
    _norm._check(x, residual, norm_weight, gate_up_weight)
    rows = gate_up_weight.shape[0]
    if rows % 2:
        raise ValueError(
            f"gate_up_weight must stack the gate and up weights, [2I, K]: got {rows} rows (odd)"
        )
    if down_weight.dim() != 2 or down_weight.shape[1] != rows // 2:
        raise ValueError(
            f"down_weight must be [H, I] with I = {rows // 2}, got {tuple(down_weight.shape)}"
        )
    if down_weight.dtype != x.dtype:
        raise TypeError(f"down_weight dtype {down_weight.dtype} differs from x's {x.dtype}")
    if down_weight.device != x.device:
        raise ValueError(f"down_weight device {down_weight.device} differs from x's {x.device}")
    if (next_norm_weight is None) != (next_weight is None):
        raise ValueError("next_norm_weight and next_weight go together: give both or neither")
    if next_weight is None:
        return
    if down_weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"with next_weight the down projection joins the residual: down_weight must have "
            f"K = {x.shape[-1]} rows, got {tuple(down_weight.shape)}"
        )
    _norm._check(x, residual, next_norm_weight, next_weight)


def _impl(
    x: torch.Tensor,  # [..., K]
    residual: torch.Tensor,  # [..., K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    gate_up_weight: torch.Tensor,  # [2I, K]
    down_weight: torch.Tensor,  # [H, I]
    next_norm_weight: torch.Tensor | None = None,  # [K]
    next_eps: float = 0.0,
    next_weight: torch.Tensor | None = None,  # [N, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # (down [..., H], h [..., K]) or (out [..., N], h2)
    _check(x, residual, norm_weight, gate_up_weight, down_weight, next_norm_weight, next_weight)
    k = x.shape[-1]
    x2d, r2d = x.reshape(-1, k), residual.reshape(-1, k)  # [M, K] each
    norm_kernels = kernel_module("paged_ops.backends.triton_norm_linear_kernels")
    config = None
    if (
        norm_kernels is not None
        and runs_kernels_on(x2d)
        and x2d.stride(-1) == 1
        and r2d.stride(-1) == 1
        and linear._graph_step(x2d)
    ):
        config = linear.gated_gemm_config(x2d, gate_up_weight)
    if config is None:  # the ops the graph had
        gate_up, h = torch.ops.paged_ops.add_rms_norm_linear.default(
            x, residual, norm_weight, eps, gate_up_weight
        )
        gate, up = gate_up.chunk(2, -1)  # [..., I] each: views
        if next_weight is None:
            return torch.ops.paged_ops.silu_mul_linear.default(gate, up, down_weight), h
        return torch.ops.paged_ops.silu_mul_add_rms_norm_linear.default(
            gate, up, down_weight, h, next_norm_weight, next_eps, next_weight
        )
    h, y = norm_kernels.add_rms_norm(x2d, r2d, norm_weight.contiguous(), eps)  # [M, K] each
    gemm = kernel_module("paged_ops.backends.triton_gemm_kernels")
    product = gemm.gated_gemm(y, gate_up_weight, config)  # [M, I]
    lead = x.shape[:-1]
    if next_weight is None:
        down = linear.project_rows(product, down_weight)  # [M, H], as silu_mul_linear projects
        return down.view(*lead, down_weight.shape[0]), h.view(x.shape)
    out, h2 = _mlp_norm.down_add_rms_norm_linear(
        product, down_weight, h, next_norm_weight, next_eps, next_weight
    )  # [M, N], [M, K]
    return out.view(*lead, next_weight.shape[0]), h2.view(x.shape)


for _device in ("CPU", "CUDA"):
    _lib.impl("add_rms_norm_gated_mlp", _impl, _device)


@torch.library.register_fake("paged_ops::add_rms_norm_gated_mlp", lib=_lib)
def _fake(x, residual, norm_weight, eps, gate_up_weight, down_weight, next_norm_weight=None,
          next_eps=0.0, next_weight=None):  # noqa: ANN001  # fmt: skip
    lead = x.shape[:-1]
    if next_weight is None:
        return x.new_empty((*lead, down_weight.shape[0])), x.new_empty(x.shape)
    return x.new_empty((*lead, next_weight.shape[0])), x.new_empty(x.shape)


def add_rms_norm_gated_mlp(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    next_norm_weight: torch.Tensor | None = None,
    next_eps: float = 0.0,
    next_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and RMSNorm, then a gated MLP of the normalised sum (Llama's
    ``down_proj(silu(gate_proj(y)) * up_proj(y))``), optionally followed by the next residual
    add, RMSNorm and a projection of that norm.

    Args:
        x: ``[..., K]``, e.g. the attention block's output ``[1, T, K]``.
        residual: ``[..., K]``, the residual stream, x's shape, dtype and device.
        norm_weight: ``[K]``, the MLP's RMSNorm weight; ``eps`` its epsilon.
        gate_up_weight: ``[2I, K]``, the gate weight's rows then the up weight's (no bias).
        down_weight: ``[H, I]``, the down projection's weight (no bias).
        next_norm_weight, next_weight: ``[K]`` and ``[N, K]``, the next RMSNorm's weight and the
            projection that reads it (``next_eps`` its epsilon); both or neither.

    Returns:
        Without ``next_weight``: ``(down, h)``, ``down`` ``[..., H]`` the MLP's output and
        ``h = x + residual`` ``[..., K]``. With it: ``(out, h2)``, ``h2 = down + h`` ``[..., K]``
        and ``out = (rms_norm(h2) * next_norm_weight) @ next_weight.T`` ``[..., N]``. All in
        x's dtype; equal to ``add_rms_norm_linear`` then ``silu_mul_linear`` (or
        ``silu_mul_add_rms_norm_linear``) up to the gated GEMM's accumulation order where that
        kernel serves (see the module docstring), bitwise elsewhere.

    Raises:
        ValueError: shapes that do not match (an odd ``gate_up_weight`` row count among them),
            ``next_norm_weight`` without ``next_weight``, tensors on different devices.
        TypeError: dtypes differ.
    """
    _check(x, residual, norm_weight, gate_up_weight, down_weight, next_norm_weight, next_weight)
    return torch.ops.paged_ops.add_rms_norm_gated_mlp.default(
        x, residual, norm_weight, eps, gate_up_weight, down_weight, next_norm_weight, next_eps,
        next_weight,
    )  # fmt: skip
