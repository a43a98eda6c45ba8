"""``paged_ops::small_linear``: ``x @ W^T + b`` with a Triton GEMV for decode-sized batches.

At batch 1..16 a decode step's projections stream their weights once for a few tokens; cuBLAS
reaches about half of an H100/H200's copy bandwidth on them. The op runs the Triton kernel of
:mod:`paged_ops.backends.triton_linear_kernels` when it applies (``M <= SMALL_M_MAX`` rows, a
float16/bfloat16/float32 input on CUDA, or a float16/float32 one on CPU under
``TRITON_INTERPRET=1`` (whose bfloat16 dots are wrong), a weight whose last stride is 1, triton
installed); on a Hopper GPU, a 16-bit batch of 64-256 rows through a deep, narrow weight (a gated
MLP's down projection) that a CUDA graph records runs the split-K TMA GEMM of
:mod:`paged_ops.backends.triton_gemm_kernels` (:func:`split_k_gemm_applies`, :func:`graph_kernels`);
everything else goes to ``torch.nn.functional.linear``, so it is
correct for any ``M``. Like the attention ops it is defined with the low-level
``torch.library.Library`` API and is one opaque node for torch.compile (fake kernel from shapes
only); triton loads on the first call that uses it, never at ``import paged_ops``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from paged_ops.triton_dispatch import kernel_module, num_sms_of, runs_kernels_on

SMALL_M_MAX = 16  # rows (tokens) up to which the Triton GEMV runs; above it cuBLAS's GEMM
SPLIT_K_GEMM_ROWS = (64, 256)  # rows (inclusive) at which a deep, narrow weight takes the TMA GEMM
GATED_GEMM_MIN_ROWS = 33  # rows from which a gated MLP's gate/up + SiLU-mul take the gated GEMM
_graph_kernels = 0  # open graph_kernels() blocks

_lib = torch.library.Library("paged_ops", "FRAGMENT")  # noqa: TOR901 (kept alive for the process)
_lib.define("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x's last dim must equal weight's K: x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if x.dtype != weight.dtype:
        raise TypeError(f"x and weight dtypes differ: x {x.dtype}, weight {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x and weight devices differ: x {x.device}, weight {weight.device}")
    if bias is None:
        return
    if bias.shape != (weight.shape[0],):
        raise ValueError(
            f"bias must have shape [N] = ({weight.shape[0]},), got {tuple(bias.shape)}"
        )
    if bias.dtype != x.dtype:
        raise TypeError(f"bias dtype {bias.dtype} differs from x's {x.dtype}")
    if bias.device != x.device:
        raise ValueError(f"bias device {bias.device} differs from x's {x.device}")


def _triton_kernels():  # noqa: ANN202 (a module, or None without triton)
    return kernel_module("paged_ops.backends.triton_linear_kernels")


def _use_triton(x2d: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton GEMV serves ``x2d [M, K] @ weight[N, K]^T`` (else F.linear)."""
    return (
        runs_kernels_on(x2d)
        and 1 <= x2d.shape[0] <= SMALL_M_MAX
        and weight.shape[0] > 0
        and weight.shape[1] > 0
        and weight.stride(1) == 1
        and _triton_kernels() is not None
    )


def split_k_gemm_applies(
    m: int, n: int, k: int, dtype: torch.dtype, capability: tuple[int, int]
) -> bool:
    """Whether ``x[m, k] @ W[n, k]^T`` is one the split-K TMA GEMM serves faster than cuBLAS: a
    Hopper GPU (``capability`` 9.x: TMA and wgmma), float16/bfloat16, ``SPLIT_K_GEMM_ROWS`` rows,
    and a weight at least twice as deep as it is wide with ``k >= 4096`` (the down projection of
    a gated MLP). Measured on an H200 (benchmarks/NOTES.md section 32): the 1B's 2048 x 8192
    down projection 18.8 / 14.3 / 12.7 us against cuBLAS's 21.8 / 17.3 / 14.4 at 256 / 128 / 64
    rows; its q/k/v, o and gate/up (``k <= n``) stay faster on cuBLAS. The op also needs the
    launch rule to split ``K`` (``gemm_config``), TMA-ready tensors and triton."""
    lo, hi = SPLIT_K_GEMM_ROWS
    return (
        capability[0] == 9
        and dtype in (torch.float16, torch.bfloat16)
        and lo <= m <= hi
        and k >= 4096
        and k >= 2 * n
    )


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _tma_ready(t: torch.Tensor) -> bool:
    """A 2-D tensor TMA can describe: unit last stride, 16-byte aligned base and row stride."""
    return (
        t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
    )


def _split_k_gemm_config(x2d: torch.Tensor, weight: torch.Tensor):  # -> GemmConfig | None
    """The split-K TMA GEMM's launch config for ``x2d [M, K] @ weight[N, K]^T`` when that kernel
    serves it, else None (CUDA only; ``PAGED_OPS_SPLIT_K_GEMM=0`` turns it off, for A/B runs)."""
    if not x2d.is_cuda or os.environ.get("PAGED_OPS_SPLIT_K_GEMM", "1") == "0":
        return None
    m, k = x2d.shape
    index = x2d.device.index if x2d.device.index is not None else torch.cuda.current_device()
    if not (
        split_k_gemm_applies(m, weight.shape[0], k, x2d.dtype, _capability(index))
        and _tma_ready(x2d)
        and _tma_ready(weight)
    ):
        return None
    gemm = kernel_module("paged_ops.backends.triton_gemm_kernels")
    if gemm is None:
        return None
    config = gemm.gemm_config(m, weight.shape[0], k, num_sms_of(x2d.device))
    # its gain is the split: a shape whose tiles alone fill the GPU stays on cuBLAS (the 8B's
    # 4096 x 14336 down projection at 192-256 rows: 2-4% slower unsplit, section 32)
    return config if config.split_k > 1 else None


def gated_gemm_applies(m: int, dtype: torch.dtype, capability: tuple[int, int]) -> bool:
    """Whether a gated MLP's ``silu(x @ Wg^T) * (x @ Wu^T)`` for ``m`` rows of ``x`` is one the
    gated TMA GEMM (:func:`~paged_ops.backends.triton_gemm_kernels.gated_gemm`) serves faster than
    cuBLAS's gate/up GEMM and the SiLU-mul kernel after it: a Hopper GPU (``capability`` 9.x),
    float16/bfloat16, at least ``GATED_GEMM_MIN_ROWS`` rows. Measured on an H200 at the 1B's
    16384 x 2048 gate/up weight (benchmarks/NOTES.md section 43): standalone 19.4 / 21.3 / 28.5 /
    450.6 us against 21.7 / 24.0 / 31.0 / 478.9 at 64 / 128 / 256 / 4,096 rows, a tie at 32;
    inside the model's graphs 27.3 vs 27.75 us at 256 rows and 16-24 us less at 4,096."""
    return (
        capability[0] == 9 and dtype in (torch.float16, torch.bfloat16) and m >= GATED_GEMM_MIN_ROWS
    )


def gated_gemm_config(x2d: torch.Tensor, weight: torch.Tensor):  # -> GemmConfig | None
    """The gated GEMM's launch config for ``x2d [M, K]`` (the normalised rows, contiguous) and
    a stacked ``[2I, K]`` gate/up ``weight`` when that kernel serves them, else None (CUDA only;
    ``PAGED_OPS_GATED_GEMM=0`` turns it off, for A/B runs)."""
    if not x2d.is_cuda or os.environ.get("PAGED_OPS_GATED_GEMM", "1") == "0":
        return None
    m, k = x2d.shape
    index = x2d.device.index if x2d.device.index is not None else torch.cuda.current_device()
    if not (
        gated_gemm_applies(m, x2d.dtype, _capability(index))
        and weight.shape[0] % 2 == 0
        and (k * x2d.element_size()) % 16 == 0
        and _tma_ready(weight)
    ):
        return None
    gemm = kernel_module("paged_ops.backends.triton_gemm_kernels")
    if gemm is None:
        return None
    return gemm.gated_gemm_config(m, weight.shape[0] // 2, k, num_sms_of(x2d.device))


@contextlib.contextmanager
def graph_kernels() -> Iterator[None]:
    """Within the block, ``small_linear`` launches what it launches while a CUDA graph is
    captured (the split-K GEMM where :func:`split_k_gemm_applies`) also outside a capture: the
    engine's warm-up, so that the kernels a capture records compile before it.

    Outside a capture and this block the split-K GEMM is not used: its launch (two Triton kernels
    and their TMA descriptors) costs ~8x cuBLAS's host time, 212 against 27 us per call on an
    H200 host, which a step launched from Python pays (a 128-token prefill: ~3 ms over 16 layers)
    for a device gain of 2-3 us per call (benchmarks/NOTES.md sections 32 and 35); inside a graph
    only the device time counts."""
    global _graph_kernels
    _graph_kernels += 1
    try:
        yield
    finally:
        _graph_kernels -= 1


def _graph_step(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` launches the kernels a CUDA graph records (:func:`graph_kernels`)."""
    return x.is_cuda and (_graph_kernels > 0 or torch.cuda.is_current_stream_capturing())


def project_rows(
    x2d: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    """``small_linear``'s choice of kernel for checked 2-D operands, without the op's dispatch
    and checks: for the ops that end in a projection (``add_rms_norm_linear``,
    ``silu_mul_linear``) at several rows, whose eager calls pay every microsecond per layer."""
    config = _split_k_gemm_config(x2d, weight) if _graph_step(x2d) else None
    if config is not None:
        gemm = kernel_module("paged_ops.backends.triton_gemm_kernels")
        return gemm.split_k_gemm(x2d, weight, bias, config=config)
    if not _use_triton(x2d, weight):
        return F.linear(x2d, weight, bias)
    return _triton_kernels().small_linear(x2d, weight, bias)


def _small_linear_impl(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [..., N]
    _check(x, weight, bias)
    x2d = x.reshape(-1, x.shape[-1])  # [M, K]; a view when x's layout allows
    return project_rows(x2d, weight, bias).view(*x.shape[:-1], weight.shape[0])


for _device in ("CPU", "CUDA"):
    _lib.impl("small_linear", _small_linear_impl, _device)


@torch.library.register_fake("paged_ops::small_linear", lib=_lib)
def _small_linear_fake(x, weight, bias):  # noqa: ANN001
    return x.new_empty((*x.shape[:-1], weight.shape[0]))  # [..., N]


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:  # noqa: ANN001
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
    x, weight = ctx.saved_tensors  # [..., K], [N, K]
    grad2d = grad.reshape(-1, grad.shape[-1])  # [M, N]
    grad_x = grad @ weight if ctx.needs_input_grad[0] else None  # [..., K]
    grad_w = grad2d.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    grad_b = grad2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b


torch.library.register_autograd(
    "paged_ops::small_linear", _backward, setup_context=_setup_context, lib=_lib
)


def small_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` (``nn.Linear``'s math), with a Triton GEMV for ``M <= 16`` rows
    (and a split-K GEMM for 64-256 rows of a down projection on Hopper).

    Args:
        x: ``[..., K]``; its leading dims are flattened to ``M`` rows.
        weight: ``[N, K]`` (``nn.Linear.weight``), x's dtype and device; any row stride (e.g. an
            ``as_strided`` view of a stacked buffer), last stride 1 for the Triton path.
        bias: ``[N]`` or ``None``, x's dtype.

    Returns:
        ``[..., N]`` in x's dtype, accumulated in float32. The Triton kernel runs for
        float16/bfloat16/float32 on CUDA (float16/float32 on CPU under ``TRITON_INTERPRET=1``)
        when ``M <= SMALL_M_MAX``; on a Hopper GPU 64-256 rows through a deep, narrow weight
        take the split-K TMA GEMM (:func:`split_k_gemm_applies`); everything else goes to
        ``torch.nn.functional.linear``.

    Raises:
        ValueError: weight not 2-D, ``K`` or bias shape mismatch, tensors on different devices.
        TypeError: dtypes differ.

    Example:
        >>> y = paged_ops.small_linear(hidden, layer.self_attn.o_proj.weight)  # [1, T, 2048]
    """
    _check(x, weight, bias)
    return torch.ops.paged_ops.small_linear.default(x, weight, bias)
