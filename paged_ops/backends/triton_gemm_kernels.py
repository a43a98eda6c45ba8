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
- ``SPLIT_K > 1``: each program stores its float32 partial (``[SPLIT_K, M, N]``) and counts
  itself in on an atomic counter per output tile; the program that counts last sums the tile's
  partials in slice order (deterministic: the same bits whichever finishes last), adds the bias,
  casts, stores and zeroes the counter for the next launch, so a split GEMM is one launch. The
  counters are a persistent buffer per device (:func:`_tile_counters`); where none can be made
  (first use inside a CUDA graph capture) or with ``GemmConfig(fused_reduce=False)``,
  :func:`~paged_ops.backends.triton_linear_kernels.split_k_reduce_kernel` sums them in a second
  launch. With one slice the program adds the bias and stores.

Every launch choice comes from shapes (:func:`gemm_config`), so a call never syncs with the host
and can be captured in a CUDA graph (the descriptors are kernel parameters, built on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_ops.backends.triton_linear_kernels import split_k_reduce_kernel
from paged_ops.triton_dispatch import num_sms_of


@triton.jit
def split_k_gemm_kernel(
    x_desc,  # [M, K] tensor descriptor, block [BLOCK_M, BLOCK_K]
    w_desc,  # [N, K] tensor descriptor, block [BLOCK_N, BLOCK_K]
    b_ptr,  # [N], or a dummy when not HAS_BIAS
    part_ptr,  # [SPLIT_K, M, N] float32 partials (SPLIT_K > 1), else unused
    out_ptr,  # [M, N] x's dtype (written here unless a reduce kernel follows)
    counter_ptr,  # [>= output tiles] int32, zero (FUSED_REDUCE), else unused
    M,
    N,
    k_per_split,  # a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
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
    tile = rm[:, None] * N + rn[None, :]  # [BLOCK_M, BLOCK_N] offsets into [M, N]
    if SPLIT_K == 1:
        _store_output(acc, b_ptr, out_ptr, tile, rn, mask, N, HAS_BIAS)
    else:
        mn = M * N
        tl.store(part_ptr + tl.program_id(1).to(tl.int64) * mn + tile, acc, mask=mask)
        if FUSED_REDUCE:
            # Every thread's partial is stored before one thread counts this slice in
            # (release); the program that counts last (acquire) sums the slices in order and
            # zeroes the counter for the next launch. The other slices' partials come from L2
            # (``.cg``: never a stale L1 line).
            tl.debug_barrier()
            done = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT_K - 1:
                tl.atomic_xchg(counter_ptr + pid, 0, sem="relaxed", scope="gpu")
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):  # fixed order: the same bits every run
                    total += tl.load(part_ptr + s * mn + tile, mask=mask, other=0.0,
                                     cache_modifier=".cg")  # fmt: skip
                _store_output(total, b_ptr, out_ptr, tile, rn, mask, N, HAS_BIAS)


@triton.jit
def _store_output(acc, b_ptr, out_ptr, tile, rn, mask, N, HAS_BIAS: tl.constexpr):
    """A finished ``[BLOCK_M, BLOCK_N]`` float32 tile: bias added, cast, stored."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + tile, acc.to(out_ptr.dtype.element_ty), mask=mask)


# device -> int32 counters of the fused split-K reduce, each zero between launches (the program
# that counts last zeroes it). Never freed or replaced: CUDA graphs keep their addresses. One
# stream at a time may run the fused form on a device (the engine's case); a larger need adds a
# larger buffer, outside a capture (the runner runs each step once before capturing it).
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _tile_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """``>= needed`` zeroed int32 counters on ``device``; None while a CUDA graph is being
    captured and none is large enough (that launch reduces in a second kernel instead)."""
    buffers = _COUNTERS.setdefault(device, [])
    if buffers and buffers[-1].numel() >= needed:
        return buffers[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    size = max(needed, 2 * buffers[-1].numel() if buffers else 0, 1024)
    buffers.append(torch.zeros(size, dtype=torch.int32, device=device))
    return buffers[-1]


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """Launch choices of :func:`split_k_gemm`; derived from shapes by :func:`gemm_config`."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    # the program that finishes a tile's last K slice sums the partials (no reduce kernel)
    fused_reduce: bool = True


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
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, block_n)
    split = 1
    while split < 8 and tiles * split * 2 <= num_sms and k // (split * 2) >= 4 * config.block_k:
        split *= 2
    return GemmConfig(block_n=block_n, split_k=split)


def split_k_gemm(
    x: torch.Tensor,  # [M, K], 16-bit, unit last stride, 16-byte aligned rows
    weight: torch.Tensor,  # [N, K], same
    bias: torch.Tensor | None = None,  # [N]
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [M, N], x's dtype
    """Launch the GEMM (and the split-K reduce): ``x @ weight.T + bias``, shapes unchecked.

    Inputs are validated by :func:`paged_ops.linear.small_linear`, which also decides when this
    kernel serves (TMA needs 16-byte aligned bases and row strides); benchmarks call it with an
    explicit ``config``.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = weight.shape[0]
    if config is None:
        config = gemm_config(m, n, k, num_sms_of(x.device))
    split = config.split_k
    k_per_split = triton.cdiv(k, split * config.block_k) * config.block_k
    x_desc = TensorDescriptor.from_tensor(x, [config.block_m, config.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)  # [M, N]
    part = out if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    counters = _tile_counters(x.device, tiles) if split > 1 and config.fused_reduce else None
    has_bias = bias is not None
    split_k_gemm_kernel[(tiles, split)](
        x_desc, w_desc, bias if has_bias else out, part, out,
        counters if counters is not None else part, m, n, k_per_split,
        HAS_BIAS=has_bias, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, SPLIT_K=split, FUSED_REDUCE=counters is not None,
        NUM_STAGES=config.num_stages, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split > 1 and counters is None:
        block = 1024
        split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
            part, bias if has_bias else part, out, m * n, n,
            HAS_BIAS=has_bias, SPLIT_K=split, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out
