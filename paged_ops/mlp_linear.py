"""``paged_ops::silu_mul_linear``: a gated MLP's activation and down projection in one op,
``out = (silu(gate) * up) @ W^T``.

The engine's graph pass (:func:`paged_ops.engine.mlp_fusion.fuse_silu_mul_linears`, with
``LLM(small_linears=...)``, on by default for CUDA models) puts it where a Llama-style MLP's
``down_proj(act(gate) * up)`` reads the two halves of the gate/up projection. Up to ``SMALL_M_MAX``
(16) rows it is one launch of ``small_linear``'s GEMV kernel with the ``SILU_MUL`` prologue (one
row: no split-K, so no reduce kernel either; several rows: split-K and its reduce for a deep K)
(:mod:`paged_ops.backends.triton_linear_kernels`): the product is formed from the loaded gate and
up tiles in registers, never stored. Above ``SMALL_M_MAX`` rows it is one SiLU-mul kernel (float32,
rounded once, as Inductor's fused kernel) and then ``small_linear`` (cuBLAS, or the split-K GEMM
where that serves the shape). Without triton (or on a CPU without ``TRITON_INTERPRET=1``) it is
the model's own math in torch. It is one opaque node for
torch.compile (fake kernel from shapes only); it records no autograd (the engine runs under
``inference_mode``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# small_linear's dispatch rule: the same kernel, so the same conditions
from paged_ops.linear import _triton_kernels, _use_triton, project_rows
from paged_ops.triton_dispatch import runs_kernels_on

_lib = torch.library.Library("paged_ops", "FRAGMENT")  # noqa: TOR901 (kept alive for the process)
_lib.define("silu_mul_linear(Tensor gate, Tensor up, Tensor weight) -> Tensor")


def _check(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> None:
    if gate.dim() < 1 or up.shape != gate.shape:
        raise ValueError(
            f"gate and up must have one shape [..., I], got {tuple(gate.shape)} and "
            f"{tuple(up.shape)}"
        )
    width = gate.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != width:
        raise ValueError(f"weight must be [N, I] with I = {width}, got {tuple(weight.shape)}")
    for name, t in (("up", up), ("weight", weight)):
        if t.dtype != gate.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from gate's {gate.dtype}")
        if t.device != gate.device:
            raise ValueError(f"{name} device {t.device} differs from gate's {gate.device}")


def _impl(
    gate: torch.Tensor,  # [..., I]
    up: torch.Tensor,  # [..., I]
    weight: torch.Tensor,  # [N, I]
) -> torch.Tensor:  # [..., N]
    _check(gate, up, weight)
    width = gate.shape[-1]
    gate2d = gate.reshape(-1, width)  # [M, I]; a view of the gate/up output's first half
    if _use_triton(gate2d, weight):
        out = _triton_kernels().silu_mul_linear(gate2d, up.reshape(-1, width), weight)  # [M, N]
        return out.view(*gate.shape[:-1], weight.shape[0])
    kernels = _triton_kernels()
    if kernels is None or not runs_kernels_on(gate2d):
        return F.linear(F.silu(gate) * up, weight)
    product = kernels.silu_mul(gate2d, up.reshape(-1, width))  # [M, I], one launch
    out = project_rows(product, weight)  # [M, N]; small_linear's kernel choice
    return out.view(*gate.shape[:-1], weight.shape[0])


for _device in ("CPU", "CUDA"):
    _lib.impl("silu_mul_linear", _impl, _device)


@torch.library.register_fake("paged_ops::silu_mul_linear", lib=_lib)
def _fake(gate, up, weight):  # noqa: ANN001
    return gate.new_empty((*gate.shape[:-1], weight.shape[0]))  # [..., N]


def silu_mul_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A gated MLP's down projection of ``silu(gate) * up`` (Llama's ``down_proj(act(gate) * up)``).

    Args:
        gate: ``[..., I]``, the gate projection's output; any strides (e.g. the first half of the
            fused gate/up output ``[1, T, 2I]``).
        up: ``[..., I]``, the up projection's output: gate's shape, dtype and device; any strides.
        weight: ``[N, I]`` (``nn.Linear.weight``, no bias); last stride 1 for the kernel.

    Returns:
        ``[..., N]`` in gate's dtype. Up to 16 rows on CUDA (or under ``TRITON_INTERPRET=1`` on
        float16/float32) it is one Triton GEMV that forms ``silu(gate) * up`` in float32, rounds
        it once to the dtype (as Inductor's fused pointwise kernel does) and accumulates in
        float32; more rows there run one SiLU-mul kernel of that rounding, then
        ``small_linear``; elsewhere ``F.linear(F.silu(gate) * up, weight)``.

    Raises:
        ValueError: shapes that do not match, tensors on different devices.
        TypeError: dtypes differ.

    Example:
        >>> gate, up = gate_up.split(mlp.intermediate_size, -1)  # [1, T, I] each
        >>> out = paged_ops.silu_mul_linear(gate, up, mlp.down_proj.weight)  # [1, T, hidden]
    """
    _check(gate, up, weight)
    return torch.ops.paged_ops.silu_mul_linear.default(gate, up, weight)
