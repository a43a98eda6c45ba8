"""A split-K Triton GEMM with TMA tile loads for a narrow, deep projection at 64-256 rows:
``out[M, N] = x[M, K] @ W[N, K]^T (+ bias)``.

Where it is used (:func:`paged_ops.linear.split_k_gemm_applies`): a Hopper GPU, a decode-sized
batch of 64-256 rows and a weight whose ``K`` is deep against its ``N`` (a gated MLP's down
projection, 2048 x 8192 in Llama-3.2-1B). There cuBLAS picks 64x64 tiles and no split (H200,
benchmarks/NOTES.md section 32: 21.8 / 17.3 / 14.4 us at M = 256 / 128 / 64, 394 TFLOP/s at
most), while this kernel with 64-row tiles, a K split that makes about one wave of CTAs and a
fixed-order reduce takes 18.8 / 14.3 / 12.7 us. At the other projections of the model (q/k/v,
o, gate/up: ``K <= N``) cuBLAS stays faster (7.8 vs 8.6 us for q/k/v at 256 rows), so they keep
it.

- Each program owns a ``[BLOCK_M, BLOCK_N]`` output tile and one of ``SPLIT_K`` contiguous slices
  of ``K``; ``x`` and ``W`` tiles come by TMA (host-built tensor descriptors; rows and columns past
  the tensor read as zeros, so ``M`` and ``K`` need no masks) through a ``num_stages``-deep
  pipeline into ``tl.dot`` (wgmma on sm_90).
- Programs are numbered M-fastest, so the CTAs that share a weight tile run side by side and the
  tile is read from HBM once.
- ``SPLIT_K > 1``: float32 partials ``[SPLIT_K, M, N]`` summed in a fixed order by
  :func:`~paged_ops.backends.triton_linear_kernels.split_k_reduce_kernel` (deterministic, no
  atomics), which adds the bias and casts; with one slice the program adds the bias and stores.

The gated GEMM (:func:`gated_gemm_kernel`, :func:`gated_gemm`) is the same TMA pipeline with two
weight tiles per K step: a gated MLP's gate and up rows of one stacked ``[2I, K]`` weight into two
float32 accumulators, and ``silu(gate) * up`` formed in the epilogue, so the ``[M, 2I]`` product
is never stored (H200, in the model's graphs: 27.3 vs 27.75 us per layer at 256 rows, 16-24 us
less at 4,096; a standalone probe, 8-13% at 64-4,096 rows; benchmarks/NOTES.md section 43;
:func:`paged_ops.linear.gated_gemm_applies`).

Every launch choice comes from shapes (:func:`gemm_config`, :func:`gated_gemm_config`), so a call
never syncs with the host and can be captured in a CUDA graph (the descriptors are kernel
parameters, built on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_ops.backends.triton_launch import cdiv, launcher
from paged_ops.backends.triton_linear_kernels import split_k_reduce_kernel
from paged_ops.triton_dispatch import num_sms_of


@triton.jit
def split_k_gemm_kernel(
    x_desc,  # [M, K] tensor descriptor, block [BLOCK_M, BLOCK_K]
    w_desc,  # [N, K] tensor descriptor, block [BLOCK_N, BLOCK_K]
    b_ptr,  # [N], or a dummy when not HAS_BIAS
    out_ptr,  # [SPLIT_K, M, N] float32 partials, or [M, N] x's dtype when SPLIT_K == 1
    M,
    N,
    k_per_split,  # a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pm = pid % num_m  # M fastest: CTAs sharing a weight tile run together (one HBM read)
    pn = pid // num_m
    k0 = tl.program_id(1) * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k0, k0 + k_per_split, BLOCK_K, num_stages=NUM_STAGES):
        a = x_desc.load([pm * BLOCK_M, k])  # [BLOCK_M, BLOCK_K]; past M or K: zeros
        w = w_desc.load([pn * BLOCK_N, k])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(a, w.T, acc)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1 and HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    part = tl.program_id(1).to(tl.int64) * M * N
    tl.store(out_ptr + part + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """Launch choices of :func:`split_k_gemm`; derived from shapes by :func:`gemm_config`."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def gemm_config(m: int, n: int, k: int, num_sms: int) -> GemmConfig:
    """Default launch choices for ``x[m, k] @ W[n, k]^T`` (16-bit) on a GPU with ``num_sms`` SMs.

    From the H200 sweep of ``benchmarks/probe_tma_gemm.py`` (2048 x 8192, every tile, split,
    warp and stage count that fits): 64-row tiles, 128 of K per step, 4 warps and 4 stages won
    at 64, 128 and 256 rows; 128-wide column tiles from 128 rows, 64-wide below; the split that
    brings the CTAs to about one per SM (2 at 256 rows, 4 at 64 and 128), keeping at least four
    K steps per slice.
    """
    block_n = 128 if m > 64 else 64
    config = GemmConfig(block_n=block_n)
    tiles = cdiv(m, config.block_m) * cdiv(n, block_n)
    split = 1
    while split < 8 and tiles * split * 2 <= num_sms and k // (split * 2) >= 4 * config.block_k:
        split *= 2
    return GemmConfig(block_n=block_n, split_k=split)


def split_k_gemm(
    x: torch.Tensor,  # [M, K], 16-bit, unit last stride, 16-byte aligned rows
    weight: torch.Tensor,  # [N, K], same
    bias: torch.Tensor | None = None,  # [N]
    config: GemmConfig | None = None,
    reduce: bool = True,
) -> torch.Tensor:  # [M, N], x's dtype; [SPLIT_K, M, N] float32 with reduce=False
    """Launch the GEMM (and the split-K reduce): ``x @ weight.T + bias``, shapes unchecked.

    Inputs are validated by :func:`paged_ops.linear.small_linear`, which also decides when this
    kernel serves (TMA needs 16-byte aligned bases and row strides); benchmarks call it with an
    explicit ``config``. ``reduce=False`` (a split of at least 2, no bias) returns the float32
    partials for a kernel that sums them itself
    (:func:`~paged_ops.backends.triton_norm_linear_kernels.reduce_add_rms_norm`).
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = weight.shape[0]
    if config is None:
        config = gemm_config(m, n, k, num_sms_of(x.device))
    split = config.split_k
    if not reduce and (split < 2 or bias is not None):
        raise ValueError(f"reduce=False needs split_k >= 2 and no bias, got {config}, bias {bias}")
    k_per_split = cdiv(k, split * config.block_k) * config.block_k
    x_desc = TensorDescriptor.from_tensor(x, [config.block_m, config.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)  # [M, N]
    target = out if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    has_bias = bias is not None
    grid = (cdiv(m, config.block_m) * cdiv(n, config.block_n), split)
    launcher(split_k_gemm_kernel)[grid](
        x_desc, w_desc, bias if has_bias else target, target, m, n, k_per_split,
        HAS_BIAS=has_bias, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, SPLIT_K=split, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if not reduce:
        return target  # [SPLIT_K, M, N] float32
    if split > 1:
        block = 1024
        launcher(split_k_reduce_kernel)[(cdiv(m * n, block),)](
            target, bias if has_bias else target, out, m * n, n,
            HAS_BIAS=has_bias, SPLIT_K=split, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


@triton.jit
def gated_gemm_kernel(
    x_desc,  # [M, K] tensor descriptor, block [BLOCK_M, BLOCK_K]
    w_desc,  # [2I, K] tensor descriptor (gate rows, then up rows), block [BLOCK_N, BLOCK_K]
    out_ptr,  # [M, I] contiguous, x's dtype
    M,
    I,  # noqa: E741 (the MLP's intermediate size)
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Program ``p``: the ``[BLOCK_M, BLOCK_N]`` tile of ``silu(x @ Wg^T) * (x @ Wu^T)``, both
    products accumulated in float32 from one load of x per K step, each rounded to x's dtype
    (as the unfused gate/up projection stores them), then SiLU-mul in float32, rounded once (as
    :func:`~paged_ops.backends.triton_linear_kernels.silu_mul_kernel` does)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pm = pid % num_m  # M fastest: CTAs sharing a weight tile run together (one HBM read)
    pn = pid // num_m
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        a = x_desc.load([pm * BLOCK_M, k])  # [BLOCK_M, BLOCK_K]; past M or K: zeros
        wg = w_desc.load([pn * BLOCK_N, k])  # [BLOCK_N, BLOCK_K] gate rows
        wu = w_desc.load([I + pn * BLOCK_N, k])  # [BLOCK_N, BLOCK_K] up rows; past 2I: zeros
        acc_g = tl.dot(a, wg.T, acc_g)
        acc_u = tl.dot(a, wu.T, acc_u)
    dtype = out_ptr.dtype.element_ty
    g = acc_g.to(dtype).to(tl.float32)
    u = acc_u.to(dtype).to(tl.float32)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < I)  # gate columns past I read up rows: not stored
    product = (g * tl.sigmoid(g) * u).to(dtype)  # [BLOCK_M, BLOCK_N]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * I + rn[None, :], product, mask=mask)


def gated_gemm_config(m: int, width: int, k: int, num_sms: int) -> GemmConfig:
    """Default launch choices of :func:`gated_gemm` for ``x[m, k]`` and a ``[2 * width, k]``
    gate/up weight (16-bit) on a GPU with ``num_sms`` SMs (``split_k`` is unused: 1).

    From the H200 sweep of ``benchmarks/probe_gated_gemm.py`` (the 1B's 16384 x 2048 weight,
    27 configs; benchmarks/NOTES.md section 43): 64 x 64 tiles with 4 warps and 4 stages up to
    128 rows (128 of K per step up to 64 rows: fewer, longer steps while the CTAs are few), then
    128 x 128 tiles, 64 of K, 8 warps, 4 stages (best at 256 and 4,096 rows)."""
    if m <= 64:
        return GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if m <= 128:
        return GemmConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4)
    return GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)


def gated_gemm(
    x: torch.Tensor,  # [M, K], 16-bit, unit last stride, 16-byte aligned rows
    weight: torch.Tensor,  # [2I, K] gate rows then up rows, same
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [M, I], x's dtype
    """``silu(x @ Wg^T) * (x @ Wu^T)`` for ``Wg, Wu = weight.chunk(2)`` in one launch: a gated
    MLP's gate/up projection and activation without the ``[M, 2I]`` round trip; shapes
    unchecked (the caller validates them and decides when this kernel serves)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    width = weight.shape[0] // 2
    if config is None:
        config = gated_gemm_config(m, width, k, num_sms_of(x.device))
    x_desc = TensorDescriptor.from_tensor(x, [config.block_m, config.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
    out = torch.empty((m, width), device=x.device, dtype=x.dtype)  # [M, I]
    grid = (cdiv(m, config.block_m) * cdiv(width, config.block_n),)
    launcher(gated_gemm_kernel)[grid](
        x_desc, w_desc, out, m, width, k,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        NUM_STAGES=config.num_stages, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
