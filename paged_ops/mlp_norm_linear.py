"""``paged_ops::silu_mul_add_rms_norm_linear``: a gated MLP's down projection, then the next
layer's residual add, RMSNorm and the projection that reads the norm, in one op::

    d = (silu(gate) * up) @ W_down^T            # paged_ops::silu_mul_linear
    h = d + residual                            # paged_ops::add_rms_norm_linear(d, residual, ...)
    out = (rms_norm(h) * g) @ W^T

Its value is bitwise that of the two ops in sequence, and so is its kernel choice but at one
place: where the down projection takes the split-K TMA GEMM (64-256 rows on Hopper, in a CUDA
graph step: :func:`paged_ops.linear.project_rows`), the GEMM leaves its float32 partials and one
kernel sums them, adds the residual and normalises
(:func:`~paged_ops.backends.triton_norm_linear_kernels.reduce_add_rms_norm`) in place of the
split-K reduce and the add + RMSNorm kernel: one launch and one boundary fewer per layer (H200
probe: 2.1-2.7 vs 3.1-4.0 us at 64-256 rows of 2,048; benchmarks/NOTES.md section 39).

The engine puts it in the graph with ``LLM(down_norm_fusion)``, on by default where it applies
(~1-1.5% end to end on an H200 at 64-256 requests, NOTES section 40; no slower first start once
the variant prebuild builds its kernel's variants, section 41) where
:func:`paged_ops.engine.mlp_fusion.fuse_down_norms` finds a
``silu_mul_projection`` read only by the next layer's ``norm_projections`` of one weight. It is
one opaque node for torch.compile (fake kernel from shapes only); it records no autograd.
"""

from __future__ import annotations

import torch

from paged_ops import linear
from paged_ops import mlp_linear as _mlp  # noqa: F401 (registers paged_ops::silu_mul_linear)
from paged_ops import norm_linear as _norm  # noqa: F401 (registers paged_ops::add_rms_norm_linear)
from paged_ops.triton_dispatch import kernel_module, runs_kernels_on

_lib = torch.library.Library("paged_ops", "FRAGMENT")  # noqa: TOR901 (kept alive for the process)
_lib.define(
    "silu_mul_add_rms_norm_linear(Tensor gate, Tensor up, Tensor down_weight, Tensor residual,"
    " Tensor norm_weight, float eps, Tensor weight) -> (Tensor, Tensor)"
)


def _check(gate, up, down_weight, residual, norm_weight, weight) -> None:  # noqa: ANN001
    _mlp._check(gate, up, down_weight)
    lead = tuple(gate.shape[:-1])
    if tuple(residual.shape) != (*lead, down_weight.shape[0]):
        raise ValueError(
            f"residual must have shape {(*lead, down_weight.shape[0])} (gate's leading dims, "
            f"down_weight's rows), got {tuple(residual.shape)}"
        )
    _norm._check(residual, residual, norm_weight, weight, None, None, 0)


def _fused_route(gate2d: torch.Tensor, down_weight: torch.Tensor):  # -> GemmConfig | None
    """The split-K GEMM's config where ``silu_mul_linear`` would run its down projection there
    (more rows than its GEMV takes, a CUDA graph step, the GEMM's shapes), else None."""
    if linear._use_triton(gate2d, down_weight) or not linear._graph_step(gate2d):
        return None
    return linear._split_k_gemm_config(gate2d, down_weight)


def _impl(
    gate: torch.Tensor,  # [..., I]
    up: torch.Tensor,  # [..., I]
    down_weight: torch.Tensor,  # [H, I]
    residual: torch.Tensor,  # [..., H]
    norm_weight: torch.Tensor,  # [H]
    eps: float,
    weight: torch.Tensor,  # [N, H]
) -> tuple[torch.Tensor, torch.Tensor]:  # out [..., N], h [..., H]
    _check(gate, up, down_weight, residual, norm_weight, weight)
    width, hidden = gate.shape[-1], down_weight.shape[0]
    gate2d, up2d = gate.reshape(-1, width), up.reshape(-1, width)  # [M, I] each
    r2d = residual.reshape(-1, hidden)  # [M, H]
    mlp_kernels = linear._triton_kernels()
    norm_kernels = kernel_module("paged_ops.backends.triton_norm_linear_kernels")
    config = None
    if mlp_kernels is not None and norm_kernels is not None and runs_kernels_on(gate2d):
        config = _fused_route(gate2d, down_weight)
    if config is None or r2d.stride(-1) != 1:  # the two ops, as the graph had them
        down = torch.ops.paged_ops.silu_mul_linear.default(gate, up, down_weight)  # [..., H]
        return torch.ops.paged_ops.add_rms_norm_linear.default(
            down, residual, norm_weight, eps, weight
        )
    product = mlp_kernels.silu_mul(gate2d, up2d)  # [M, I], as silu_mul_linear forms it
    out, h = reduce_norm_project(product, down_weight, r2d, norm_weight, eps, weight, config)
    lead = gate.shape[:-1]
    return out.view(*lead, weight.shape[0]), h.view(*lead, hidden)


def down_add_rms_norm_linear(
    product: torch.Tensor,  # [M, I], silu(gate) * up
    down_weight: torch.Tensor,  # [H, I]
    residual: torch.Tensor,  # [M, H]
    norm_weight: torch.Tensor,  # [H]
    eps: float,
    weight: torch.Tensor,  # [N, H]
) -> tuple[torch.Tensor, torch.Tensor]:  # out [M, N], h [M, H]
    """The op's value from an already formed product of more than ``SMALL_M_MAX`` rows (the
    gated GEMM's output, :mod:`paged_ops.gated_mlp`): the split-K GEMM's partials summed by the
    norm kernel where the down projection takes that GEMM, else ``small_linear``'s projection
    and ``add_rms_norm_linear``; shapes checked by the caller."""
    config = _fused_route(product, down_weight)
    if config is None or residual.stride(-1) != 1:
        down = linear.project_rows(product, down_weight)  # [M, H], as silu_mul_linear projects
        return torch.ops.paged_ops.add_rms_norm_linear.default(
            down, residual, norm_weight, eps, weight
        )
    return reduce_norm_project(product, down_weight, residual, norm_weight, eps, weight, config)


def reduce_norm_project(
    product: torch.Tensor,  # [M, I]
    down_weight: torch.Tensor,  # [H, I]
    residual: torch.Tensor,  # [M, H], unit last stride
    norm_weight: torch.Tensor,  # [H]
    eps: float,
    weight: torch.Tensor,  # [N, H]
    config,  # noqa: ANN001 (a GemmConfig that splits K)
) -> tuple[torch.Tensor, torch.Tensor]:  # out [M, N], h [M, H]
    """The fused route: the down projection's split-K partials, one kernel that sums them, adds
    the residual and normalises, then the projection of the norm."""
    gemm = kernel_module("paged_ops.backends.triton_gemm_kernels")
    norm_kernels = kernel_module("paged_ops.backends.triton_norm_linear_kernels")
    partials = gemm.split_k_gemm(product, down_weight, config=config, reduce=False)  # [S, M, H]
    h, y = norm_kernels.reduce_add_rms_norm(partials, residual, norm_weight.contiguous(), eps)
    return linear.project_rows(y, weight), h  # [M, N], as add_rms_norm_linear projects


for _device in ("CPU", "CUDA"):
    _lib.impl("silu_mul_add_rms_norm_linear", _impl, _device)


@torch.library.register_fake("paged_ops::silu_mul_add_rms_norm_linear", lib=_lib)
def _fake(gate, up, down_weight, residual, norm_weight, eps, weight):  # noqa: ANN001
    lead = gate.shape[:-1]
    return gate.new_empty((*lead, weight.shape[0])), gate.new_empty((*lead, down_weight.shape[0]))


def silu_mul_add_rms_norm_linear(
    gate: torch.Tensor,
    up: torch.Tensor,
    down_weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated MLP's down projection, then a residual add, an RMSNorm and a projection of the
    normalised sum (the next decoder layer's first steps).

    Args:
        gate, up: ``[..., I]`` each, the gate and up projections' outputs (any strides).
        down_weight: ``[H, I]``, the down projection's weight (no bias).
        residual: ``[..., H]``, the residual stream the down projection's output joins.
        norm_weight: ``[H]``, the RMSNorm's weight.
        eps: the RMSNorm's epsilon.
        weight: ``[N, H]``, the projection of the normalised sum (no bias).

    Returns:
        ``(out, h)``: ``h = silu_mul_linear(gate, up, down_weight) + residual`` ``[..., H]`` and
        ``out = (rms_norm(h) * norm_weight) @ weight.T`` ``[..., N]``, bitwise equal to
        ``paged_ops.add_rms_norm_linear(paged_ops.silu_mul_linear(gate, up, down_weight),
        residual, norm_weight, eps, weight)``.

    Raises:
        ValueError: shapes that do not match, tensors on different devices.
        TypeError: dtypes differ.
    """
    _check(gate, up, down_weight, residual, norm_weight, weight)
    return torch.ops.paged_ops.silu_mul_add_rms_norm_linear.default(
        gate, up, down_weight, residual, norm_weight, eps, weight
    )
