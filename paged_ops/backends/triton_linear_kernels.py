"""Triton matrix-vector kernels for small-batch decode: ``out[M, N] = x[M, K] @ W[N, K]^T (+ bias)``.

At decode time a model's linear layers stream their weights once per step for a handful of tokens
(``M <= 16``), so they are bound by memory bandwidth, not FLOPs. The kernel is built for that:

- Each program owns ``BLOCK_N`` output columns (rows of ``W``, contiguous along ``K``) and streams
  ``[BLOCK_N, BLOCK_K]`` weight tiles with 16-byte vector loads, software-pipelined ``num_stages``
  deep; ``x`` is tiny and re-read from L2 by every program.
- The product of a tile is a constexpr choice: ``USE_DOT`` runs ``tl.dot(W_tile, x_tile^T)`` with
  ``M`` padded to 16 (weights as the mma's M side, "swap AB"); otherwise a broadcast multiply
  adds ``[BLOCK_N, BLOCK_M, BLOCK_K]`` float32 products into an accumulator of that shape, summed
  over ``K`` once after the loop (FMA, ``BLOCK_M = next_power_of_2(M)``; a sum per tile cost a
  cross-thread reduction every iteration: 4-5% slower than cuBLAS at M=1 where the deferred sum
  is 4-5% faster, benchmarks/NOTES.md section 22). The K loop is a
  ``tl.range(num_stages=...)`` loop, so Triton pipelines the loads (cp.async) on both paths (sm_90
  PTX of triton 3.6; without it the FMA path had no loads in flight across iterations).
- ``SPLIT_K > 1`` gives each of ``SPLIT_K`` programs per column block a contiguous slice of ``K``;
  they write float32 partials ``[SPLIT_K, M, N]`` and a second kernel sums them in a fixed order
  (deterministic, no atomics), adds the bias and casts. It is for narrow, deep weights (down_proj:
  N=2048, K=8192) whose column blocks alone do not fill the GPU.
- ``SILU_MUL`` (:func:`silu_mul_linear`, a gated MLP's down projection): the input is
  ``silu(gate) * up``, formed from the two loaded tiles in registers (float32, rounded once to the
  dtype, as Inductor's fused pointwise kernel rounds it) instead of loaded, so a decode step has
  no SiLU-mul kernel (and launch boundary) of its own before the GEMV. Every column block reads
  the gate and up of its K slice (from L2: at M=1 two input elements per ``BLOCK_N`` weights,
  where a plain GEMV reads one) and recomputes their product, a few exponentials per thread and
  K step.
- ``PDL`` (``LinearConfig.pdl``, sm_90+): launched with programmatic dependent launch, a program
  asks L2 for its first weight lines, waits for the previous kernel (``griddepcontrol.wait``),
  then lets the next kernel launch. Measured in a decode step's chain of kernels, it changed
  nothing (benchmarks/NOTES.md section 22); on the engine's one-row GEMVs (with the norm-fused
  one) it cost 10-14% at batch 1 (section 27). It stays an explicit choice.

Padded columns and rows are clamped to the last real one (loads stay in bounds without masks; their
results are never stored), and ``K`` is masked only when it is not a multiple of the K step
(``EVEN_K``). Every launch choice comes from shapes (:func:`linear_config`), so a call never syncs
with the host and can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from paged_ops.backends.triton_launch import cdiv, launcher, next_power_of_2
from paged_ops.triton_dispatch import num_sms_of

SMEM_BUDGET = 128 * 1024  # bytes of pipelined stage buffers the default configs stay under


@triton.jit
def _prefetch_l2(ptrs, mask):
    """Ask L2 for the 128-byte line holding each of ``ptrs`` (where ``mask``); nothing waits for
    it. GPU only (inline PTX): the launcher never sets PDL under the interpreter."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r",
        [ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _input_offsets(rows_m, offs_k, stride_m, stride_k, USE_DOT: tl.constexpr):
    """Element offsets of an input tile: ``[BLOCK_K, BLOCK_M]`` for the dot path (x^T, the mma's
    N side), ``[BLOCK_M, BLOCK_K]`` for the FMA path."""
    if USE_DOT:
        offs = rows_m[None, :] * stride_m + offs_k[:, None] * stride_k
    else:
        offs = rows_m[:, None] * stride_m + offs_k[None, :] * stride_k
    return offs


@triton.jit
def small_linear_kernel(
    x_ptr,  # [M, K]; the gate when SILU_MUL
    up_ptr,  # [M, K] when SILU_MUL, else a dummy
    w_ptr,  # [N, K]
    b_ptr,  # [N] or a dummy when not HAS_BIAS
    out_ptr,  # [M, N] in x's dtype, or [SPLIT_K, M, N] float32 partials when SPLIT_K > 1
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_um,  # up's strides (unused without SILU_MUL)
    stride_uk,
    stride_wn,
    stride_wk,
    k_per_split,  # a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % (BLOCK_K * SPLIT_K) == 0: no K masks
    IEEE: tl.constexpr,  # float32 inputs: exact products (tl.dot would round them to TF32)
    NUM_STAGES: tl.constexpr,
    SILU_MUL: tl.constexpr = False,  # the input is silu(x) * up
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (sm_90+)
    PREFETCH_K: tl.constexpr = 0,  # PDL: K elements of each weight row asked of L2 before waiting
    LINE: tl.constexpr = 64,  # weight elements per 128-byte line
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    # Clamped indices: padding rows/columns repeat the last real one, so loads need no mask.
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    rows_m = tl.minimum(offs_m, M - 1)
    k_start = pid_k * k_per_split
    if PDL:
        # The weights do not depend on the kernel before this one: ask L2 for the first
        # PREFETCH_K of this program's rows while that kernel finishes, then wait for its output
        # (x) to be visible, then let the next kernel launch (it waits for this one the same way).
        if PREFETCH_K > 0:
            pf_k = k_start + tl.arange(0, PREFETCH_K // LINE) * LINE  # [PREFETCH_K / LINE]
            pf_ok = (pf_k < K) & (pf_k < k_start + k_per_split)
            lines = w_ptr + rows_n[:, None] * stride_wn + pf_k[None, :] * stride_wk  # [BN, P]
            _prefetch_l2(lines, pf_ok[None, :] & (offs_n[:, None] < N))
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_k = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :] * stride_wk  # [BLOCK_N, BLOCK_K]
    # input tiles: [BLOCK_K, BLOCK_M] on the dot path, [BLOCK_M, BLOCK_K] on the FMA path
    x_ptrs = x_ptr + _input_offsets(rows_m, offs_k, stride_xm, stride_xk, USE_DOT)
    if SILU_MUL:
        up_ptrs = up_ptr + _input_offsets(rows_m, offs_k, stride_um, stride_uk, USE_DOT)
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        # products summed over K only after the loop: no cross-thread reduction per tile
        acc3 = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, k_per_split, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
            if SILU_MUL:
                up = tl.load(up_ptrs)
        else:
            k_ok = offs_k + k < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            x_ok = k_ok[:, None] if USE_DOT else k_ok[None, :]
            x = tl.load(x_ptrs, mask=x_ok, other=0.0)
            if SILU_MUL:
                up = tl.load(up_ptrs, mask=x_ok, other=0.0)  # silu(0) * 0: masked K adds 0
        if SILU_MUL:
            gate = x.to(tl.float32)
            x = (gate * tl.sigmoid(gate) * up.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if USE_DOT:
            acc = tl.dot(w, x, acc, input_precision="ieee") if IEEE else tl.dot(w, x, acc)
        else:
            acc3 += w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :]  # [BN, BM, BK]
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
        if SILU_MUL:
            up_ptrs += BLOCK_K * stride_uk
    if not USE_DOT:
        acc = tl.sum(acc3, axis=2)  # [BLOCK_N, BLOCK_M]
    out_mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    out_ptrs = out_ptr + offs_m[None, :] * N + offs_n[:, None]  # [BLOCK_N, BLOCK_M] of [M, N]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows_n).to(tl.float32)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptrs + pid_k * M * N, acc, mask=out_mask)


@triton.jit
def split_k_reduce_kernel(
    part_ptr,  # [SPLIT_K, M*N] float32
    b_ptr,  # [N] or a dummy when not HAS_BIAS
    out_ptr,  # [M, N] contiguous, x's dtype
    MN,
    N,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (sm_90+)
):
    if PDL:
        tl.extra.cuda.gdc_wait()  # the partials are the GEMV's output
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the same bits every run
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True, slots=True)
class LinearConfig:
    """Launch choices of :func:`small_linear`; derived from shapes by :func:`linear_config`.

    ``use_dot`` needs ``block_n >= 16`` and ``block_k >= 16`` (mma tile sizes); the FMA path keeps
    ``block_n * next_power_of_2(M) * block_k`` float32 products per tile in registers.
    """

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    use_dot: bool = True
    # Programmatic dependent launch (sm_90+, CUDA only): the kernel may start while the one
    # before it finishes; it asks L2 for the first ``prefetch_k`` elements of its weight rows,
    # then waits for the earlier kernel's output before reading ``x``.
    pdl: bool = False
    prefetch_k: int = 0

    def block_m(self, m: int) -> int:
        return 16 if self.use_dot else next_power_of_2(m)

    def fma_regs(self, m: int) -> int:
        """float32 products of one tile per thread on the FMA path (> 128 spills on sm_90)."""
        return self.block_n * self.block_m(m) * self.block_k // (32 * self.num_warps)

    def check(self) -> None:
        for name in ("block_n", "block_k", "split_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"LinearConfig.{name} must be a power of two >= 1, got {value}")
        if self.use_dot and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(
                f"LinearConfig(use_dot=True) needs block_n >= 16 and block_k >= 16 (mma tiles), "
                f"got block_n={self.block_n}, block_k={self.block_k}"
            )
        if self.num_stages < 1:
            raise ValueError(f"LinearConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.prefetch_k and (not self.pdl or self.prefetch_k & (self.prefetch_k - 1)):
            raise ValueError(
                f"LinearConfig.prefetch_k must be 0, or a power of two with pdl=True, "
                f"got prefetch_k={self.prefetch_k}, pdl={self.pdl}"
            )


def linear_config(
    m: int, n: int, k: int, dtype: torch.dtype, num_sms: int, silu_mul: bool = False
) -> LinearConfig:
    """Default launch choices for ``x[m, k] @ W[n, k]^T`` on a GPU with ``num_sms`` SMs.

    From the H100 sweep (benchmarks/results/linear_sweep_h100.json, 1B shapes at M=1 and M=8): the
    dot path with 64-row weight tiles won every shape, even where that leaves most SMs without a
    column block (q/k/v: 48 blocks; each then streams a long run of K); 256 16-bit (128 float32)
    elements of K per step; a deep K (>= 8192, the down projection) split in 4 with 128-wide steps.
    One row (``m == 1``) of a projection-sized weight (``n <= 32768``) takes the FMA path with
    the sum deferred to after the loop: 8-row weight tiles, 1 KiB of each row per step, 3 stages
    (H100, a 16-layer 1B chain in one CUDA graph, benchmarks/NOTES.md section 22: 957.8 us vs
    cuBLAS 1,006.2 and the dot path's 1,017.0). At two or more rows it loses to the dot path.
    With the ``SILU_MUL`` prologue (``silu_mul``: the down projection of a gated MLP) one row
    takes no split and 16-row tiles with 4 stages: each split's programs form the SiLU-mul of
    their K slice from two input tiles, and the partials' round trip and reduce launch cost more
    than the extra programs gain (H200, the 1B's 2048 x 8192 down projection: 14.1 us with the
    split-in-4 rule and its reduce, 11.3 us; benchmarks/NOTES.md section 27).
    ``num_sms`` is kept for callers (and a future rule); the sweeps found no use for it.
    """
    del num_sms
    if m == 1 and n <= 32768:
        block_k = min(1024 // dtype.itemsize, max(16, next_power_of_2(k)))
        if silu_mul:
            return LinearConfig(block_n=16, block_k=block_k, split_k=1, num_stages=4, use_dot=False)
        split = 4 if k >= 8192 else 1
        return LinearConfig(block_n=8, block_k=block_k, split_k=split, num_stages=3, use_dot=False)
    deep = k >= 8192
    block_k = min((256 if deep else 512) // dtype.itemsize, max(16, next_power_of_2(k)))
    config = LinearConfig(block_n=64, block_k=block_k, split_k=4 if deep else 1, num_warps=4)
    stage_bytes = (config.block_n + config.block_m(m)) * block_k * dtype.itemsize
    stages = max(2, min(4, SMEM_BUDGET // stage_bytes))
    return replace(config, num_stages=stages)


@functools.lru_cache(maxsize=4096)
def _default_config(
    m: int, n: int, k: int, dtype: torch.dtype, num_sms: int, silu_mul: bool
) -> LinearConfig:
    """:func:`linear_config`'s choice, kept per shape: eager steps launch per layer."""
    return linear_config(m, n, k, dtype, num_sms, silu_mul=silu_mul)


def _pdl_launch(pdl: bool) -> dict:
    """Launch keywords: ``launch_pdl`` only when set (a plain launch passes nothing new)."""
    return {"launch_pdl": True} if pdl else {}


def small_linear(
    x: torch.Tensor,  # [M, K], M <= 16
    weight: torch.Tensor,  # [N, K], any strides
    bias: torch.Tensor | None = None,  # [N]
    config: LinearConfig | None = None,
) -> torch.Tensor:  # [M, N], x's dtype
    """Launch the GEMV kernel (and the split-K reduce): ``x @ weight.T + bias``, shapes unchecked.

    Inputs are validated by :func:`paged_ops.linear.small_linear`; this is the raw launcher that
    benchmarks call with an explicit ``config`` to sweep launch choices.
    """
    return _launch(x, None, weight, bias, config)


def silu_mul_linear(
    gate: torch.Tensor,  # [M, K], M <= 16
    up: torch.Tensor,  # [M, K], any strides
    weight: torch.Tensor,  # [N, K], any strides
    config: LinearConfig | None = None,
) -> torch.Tensor:  # [M, N], gate's dtype
    """Launch the GEMV kernel with the ``SILU_MUL`` prologue: ``(silu(gate) * up) @ weight.T``,
    shapes unchecked (:func:`paged_ops.mlp_linear.silu_mul_linear` validates them)."""
    return _launch(gate, up, weight, None, config)


def _launch(
    x: torch.Tensor,  # [M, K]; the gate when up is given
    up: torch.Tensor | None,  # [M, K], or None
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    config: LinearConfig | None,
) -> torch.Tensor:  # [M, N], x's dtype
    m, k = x.shape
    n = weight.shape[0]
    if config is None:  # the rule's configs are valid; a caller's is checked
        config = _default_config(m, n, k, x.dtype, num_sms_of(x.device), up is not None)
    else:
        config.check()
    if x.device.type != "cuda":  # the interpreter has no grid dependency control
        config = replace(config, pdl=False, prefetch_k=0)
    line = 128 // weight.element_size()
    prefetch_k = max(config.prefetch_k, line) if config.prefetch_k else 0
    block_m = config.block_m(m)
    split = config.split_k
    step = config.block_k * split
    k_per_split = cdiv(k, step) * config.block_k
    out = x.new_empty((m, n))  # [M, N]
    target = out if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    has_bias = bias is not None
    grid = (cdiv(n, config.block_n), split)
    up_strides = (0, 0) if up is None else up.stride()
    launcher(small_linear_kernel)[grid](
        x, x if up is None else up, weight, bias if has_bias else x, target,
        m, n, k, x.stride(0), x.stride(1), *up_strides, weight.stride(0), weight.stride(1),
        k_per_split,
        HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split, USE_DOT=config.use_dot, EVEN_K=k % step == 0,
        IEEE=x.dtype == torch.float32, NUM_STAGES=config.num_stages, SILU_MUL=up is not None,
        PDL=config.pdl, PREFETCH_K=prefetch_k, LINE=line, num_warps=config.num_warps,
        num_stages=config.num_stages, **_pdl_launch(config.pdl),
    )  # fmt: skip
    if split > 1:
        block = 1024
        launcher(split_k_reduce_kernel)[(cdiv(m * n, block),)](
            target, bias if has_bias else target, out, m * n, n,
            HAS_BIAS=has_bias, SPLIT_K=split, BLOCK=block, PDL=config.pdl, num_warps=4,
            **_pdl_launch(config.pdl),
        )  # fmt: skip
    return out


@triton.jit
def silu_mul_kernel(
    gate_ptr,  # [M, I], unit last stride
    up_ptr,  # [M, I], unit last stride
    out_ptr,  # [M, I] contiguous
    width,  # I
    stride_gm,
    stride_um,
    BLOCK: tl.constexpr,
):
    """Program ``(m, j)``: ``silu(gate) * up`` of row ``m``'s ``j``-th ``BLOCK`` columns, in
    float32 and rounded once (the GEMV prologue's and Inductor's rounding)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    gate = tl.load(gate_ptr + row * stride_gm + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_um + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * width + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # [M, I] each -> [M, I]
    """``silu(gate) * up`` in one launch (gated MLPs of steps above ``SMALL_M_MAX`` rows, before
    their down projection); shapes unchecked (:mod:`paged_ops.mlp_linear` validates them)."""
    rows, width = gate.shape
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    out = gate.new_empty((rows, width))
    if rows == 0 or width == 0:
        return out
    block = min(1024, next_power_of_2(width))
    launcher(silu_mul_kernel)[(rows, cdiv(width, block))](
        gate, up, out, width, gate.stride(0), up.stride(0), BLOCK=block, num_warps=4
    )
    return out
