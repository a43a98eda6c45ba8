"""Triton backend: KV-write kernel and one unified paged-attention kernel (+ split-KV reduce).

Runs on CUDA GPUs, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set before
this module is imported), which is how CI tests the kernels. Head sizes 1..256 (padded to a power of
two of at least 16 inside the kernels), any GQA group, any block size, float16/bfloat16/float32
(float32 uses IEEE dots, not TF32), sliding window, softcap, sinks and ALiBi, and FP8 caches
(float8_e4m3fn/float8_e5m2 with per-layer or per-head scales: the write kernel quantizes, the
attention kernel converts each K/V tile to the query's dtype in registers, k_scale joins the softmax
scale and v_scale the output). The interpreter's own fp8 conversions lose subnormals and round wrongly
across a binade, so the write kernel rounds with integer arithmetic everywhere and, under the
interpreter only, the attention kernel reads the cache as uint8 bit patterns and decodes them by hand.

Every launch decision reads shapes only (``T``, ``S``, the block-table width), never tensor values,
so a call is free of host syncs and can be compiled and CUDA-graph captured; a captured graph keeps
the tiles and the split-KV choice of its batch bucket. The kernels and their grids are described in
:mod:`paged_ops.backends.triton_kernels`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from paged_ops.backends import LayerSpec
from paged_ops.backends import triton_kernels as kernels
from paged_ops.backends.triton_launch import cdiv as _cdiv
from paged_ops.backends.triton_launch import launcher
from paged_ops.backends.triton_launch import next_power_of_2 as _next_power_of_2
from paged_ops.backends.triton_rope_kernels import rotate_heads
from paged_ops.fp8 import fp8_format, is_fp8

MAX_HEAD_DIM = 256
MAX_SEGMENTS = 64  # batch 1 x 16k: 8 KV heads x 64 segments ~ 4 waves on 132 SMs


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def is_available() -> bool:
    return torch.cuda.is_available() or _interpreting()


def unsupported_reason(spec: LayerSpec, device: torch.device) -> str | None:
    device = torch.device(device)
    if device.type == "cpu" and not _interpreting():
        return (
            "it runs on CUDA GPUs, or on CPU only under the Triton interpreter (TRITON_INTERPRET=1)"
        )
    if device.type not in ("cuda", "cpu"):
        return f"it runs on CUDA GPUs, not on {device.type}"
    if not 1 <= spec.head_dim <= MAX_HEAD_DIM:
        return f"head size {spec.head_dim} is outside 1..{MAX_HEAD_DIM}"
    if device.type == "cpu" and spec.dtype == torch.bfloat16:
        return "the Triton interpreter computes bfloat16 dots wrongly; use float16/float32 on CPU"
    if (
        spec.kv_dtype is not None
        and is_fp8(spec.kv_dtype)
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) < (8, 9)
    ):
        return "an FP8 cache needs compute capability 8.9 or newer (Ada, Hopper)"
    return None


def _d_pad(head_dim: int) -> int:
    return max(16, _next_power_of_2(head_dim))


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [N, 2, B, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [] or [Hkv] fp32 (FP8 cache)
    v_scale: torch.Tensor | None = None,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    fp8 = fp8_format(kv_cache.dtype)
    launcher(kernels.write_kv_kernel)[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        k_scale if k_scale is not None else slot_mapping,  # (a stand-in, never read)
        v_scale if v_scale is not None else slot_mapping,
        *key.stride(),
        *value.stride(),
        *kv_cache.stride(),
        _scale_stride(k_scale),
        _scale_stride(v_scale),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        H_PAD=_next_power_of_2(num_kv_heads),
        D_PAD=_d_pad(head_dim),
        QUANTIZE=is_fp8(kv_cache.dtype),
        USE_K_SCALE=k_scale is not None,
        USE_V_SCALE=v_scale is not None,
        FP8_MAX=fp8["FP8_MAX"],
        FP8_MAN=fp8["FP8_MAN"],
        FP8_MIN_NORMAL=fp8["FP8_MIN_NORMAL"],
        FP8_SUB_ULP=fp8["FP8_SUB_ULP"],
    )


def _scale_stride(scale: torch.Tensor | None) -> int:
    """0 for a per-layer scale ``[]`` (every head reads element 0), 1 for a per-head ``[Hkv]``."""
    return 0 if scale is None or scale.dim() == 0 else 1


KERNELS = ("unified", "prefill")  # LaunchConfig.kernel


@dataclass(frozen=True)
class LaunchConfig:
    """Tiles and split of one attention launch, chosen from shapes only."""

    block_m: int  # rows of the M tile: block_q query tokens x the GQA group
    block_q: int
    tile_n: int  # KV positions per inner-loop step
    num_segments: int  # 1 = one pass; > 1 = split-KV + reduce
    num_warps: int
    num_stages: int
    # "unified" or "prefill" (plain causal prefill/mixed steps; see launch_config)
    kernel: str = "unified"
    maxnreg: int | None = None  # register cap per thread (more programs per SM; unified kernel)
    kv_heads: int = 1  # KV heads per program (unified kernel): 2 pairs D=64 heads (FP8 decode)
    # 1: grid (KV heads, query blocks, segments): a block's head programs run together and read
    # the same KV pages (decode steps by default; the prefill kernel too)
    heads_fastest: int = 0
    # 1: query blocks launch last first, a sequence's blocks with the most keys first (prefill
    # kernel: the grid's last wave is then of short causal blocks)
    reverse_blocks: int = 0
    # 1: V of an FP8 cache read as int16 pairs of values (unified kernel, 16-bit queries, head
    # size a power of two, unit-stride cache rows): 16-bit transposing loads instead of 8-bit
    # reads a byte at a time (kernels._fp8_pairs_to_float16)
    v_pairs: int = 0
    # 1: the first S query blocks are each sequence's first block, later blocks after them
    # (unified kernel; decode steps by default): a one-token-per-sequence step's
    # working programs come first, with no empty ones among them (kernels._locate_query_block)
    first_blocks: int = 0


def parse_launch_overrides(spec: str) -> dict:
    """``"num_stages=3,maxnreg=128"`` -> ``LaunchConfig`` fields to replace (benchmarks, sweeps)."""
    fields = [f.name for f in dataclasses.fields(LaunchConfig)]
    changes: dict = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        if name not in fields or not value:
            raise ValueError(f"{item!r} is not field=value with a field of {fields}")
        changes[name] = value if name == "kernel" else int(value)
    return changes


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may opt in to on ``device`` (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block))


def _query_grid(
    cfg: LaunchConfig, num_tokens: int, num_seqs: int, head_programs: int
) -> tuple[tuple[int, int], bool]:
    """The attention grid's first two axes, (query blocks, head programs) or, where
    ``cfg.heads_fastest`` asks and the grid's y limit allows, (head programs, query blocks); and
    whether heads come first (the kernels' ``HEADS_FASTEST``)."""
    blocks = num_tokens // cfg.block_q + num_seqs + 1
    heads_first = bool(cfg.heads_fastest) and blocks <= 65535  # (a grid's y limit)
    return ((head_programs, blocks) if heads_first else (blocks, head_programs)), heads_first


def launch_config(
    *,
    num_tokens: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_kv_len: int,
    num_sms: int,
    num_segments: int | None = None,
    fp8_cache: bool = False,
    plain_causal: bool = False,
    query_bytes: int = 2,
    shared_memory: int = 0,
) -> LaunchConfig:
    """Pick tiles and split-KV from the step's shapes (``T``, ``S``) and the block-table capacity.

    Decode-like steps (``T <= 2 S``) use a 16-row M tile (one or a few tokens x the group); prefill
    and mixed steps a 64-row tile. When the one-pass grid would leave most SMs idle (small decode
    batches), the KV range is split into up to MAX_SEGMENTS segments. ``num_segments`` forces the split.
    An FP8 cache decodes with 128-wide KV tiles; at D=128 also 3 stages, at most 128 registers
    (four programs per SM) and the split that fills the waves best (``_fp8_decode_segments``;
    H100 sweeps, benchmarks/NOTES.md §10: 64 x 4096 291 -> 271 -> 207 us, 256 x 4096 1,094 ->
    949 -> 801 us); at D <= 64, 2 stages and no forced split (64 x 4096: 169 -> 137 us). A
    bf16/fp16 cache at D <= 64 decodes with 128-wide KV tiles too (H200 sweep, NOTES.md section
    12: 64 x 4096 154.6 -> 134.9 us, 8 x 16384 89.8 -> 71.9 us), except at D=64 in steps of at
    least four (sequence, KV head) programs per SM: two KV heads per program, 64-wide tiles
    (NOTES.md section 33).
    Prefill and mixed steps of plain causal layers (``plain_causal``: no window, softcap, sinks
    or ALiBi; on an FP8 cache only the long-prompt steps) with D <= 128 run the prefill kernel
    (masks only on the diagonal tiles, unpredicated loads): 64 x 64 tiles and 4 warps, or 128 x 128 and 8 warps when the step
    averages >= 1024 tokens per sequence; 2 stages (H200 sweep, benchmarks/NOTES.md section 11:
    4 x 2048 D=128 596 -> 409 us, 1 x 8192 2,331 -> 1,339 us). Its grid puts the KV heads first
    and the query blocks last first, so a causal prompt's longest blocks start first and the
    last wave is of short ones (H200, D=128, NOTES.md section 44: 4 x 2048 467 -> 446 us, 16 x
    512 183 -> 170, 1 x 8192 1,540 -> 1,507; a mixed step of 4 x 512 chunks and 64 decodes at
    4096 583 -> 501). With that order the long-prompt launch of 16-bit queries on a 16-bit
    cache takes 3 stages where its tiles fit the GPU's ``shared_memory`` (bytes a program may
    use; Hopper's 227 KiB at D=128: 4 x 2048 446 -> 429 us, 1 x 8192 1,513 -> 1,456; same
    output); ``query_bytes`` is the query's element size, 0 ``shared_memory`` keeps 2 stages.
    """
    group = num_q_heads // num_kv_heads
    decode_like = num_tokens <= 2 * num_seqs
    d_pad = _d_pad(head_dim)
    fp8_decode = fp8_cache and decode_like and d_pad <= 128
    # FP8 decode at D=64: two KV heads per program, so each K/V row read is 128 contiguous bytes
    # and the program is the D=128 one (H100, NOTES.md section 10: 64 x 4096 133.1 -> 111.2 us,
    # 256 x 4096 538.5 -> 390.7 us). Not for steps of fewer than 8 pair programs (1 x 16384:
    # 13.4 vs 18.1 us; 2 x 16384 equal): there the split is latency-bound and a pair program
    # does twice the work of a one-head program.
    pairs = fp8_decode and d_pad == 64 and num_kv_heads % 2 == 0 and num_seqs * num_kv_heads >= 16
    # A 16/32-bit cache at D=64 pairs its KV heads too, with 64-wide KV tiles, where a decode
    # step has at least four (sequence, KV head) programs per SM, so two pair programs: each
    # reads 256-byte rows, and half as many programs pay the per-program metadata round trips,
    # in the same shared memory (H200, with the K/V write, NOTES.md section 33: 256 x 128 27.7
    # -> 24.3 us, 256 x 384 58.7 -> 55.7, 72 x 256 13.5 -> 12.1; at 64 sequences of 8 KV heads,
    # 512 programs, it loses at every context: 64 x 256 9.5 -> 10.9, 64 x 384 14.2 -> 17.3).
    wide_rows = (
        decode_like
        and not fp8_cache
        and d_pad == 64
        and num_kv_heads % 2 == 0
        and num_seqs * num_kv_heads >= 4 * num_sms
    )
    kv_heads = 2 if pairs or wide_rows else 1
    rows_per_token = group * kv_heads
    block_m = max(16 if decode_like else 64, _next_power_of_2(rows_per_token))
    block_q = block_m // rows_per_token
    # D=256: 64-wide KV tiles for decode (H200 sweep: 655 -> 497 us at 64 x 4096, 348 -> 264 us at
    # 8 x 16384); prefill keeps 32 (its 64-row M tile and fp32 accumulator fill the registers).
    tile_n = 64 if d_pad <= 128 or decode_like else 32
    # its own stages, register cap and split rule
    fp8_decode_128 = fp8_decode and d_pad * kv_heads > 64
    if fp8_decode or (decode_like and d_pad <= 64):
        tile_n = 64 if wide_rows else 128
    if num_segments is None:
        programs = (num_tokens // block_q + num_seqs + 1) * (num_kv_heads // kv_heads)
        kv_tiles = _cdiv(max(max_kv_len, 1), tile_n)
        num_segments = 1
        if programs < num_sms and kv_tiles >= 4:
            want = _cdiv(4 * num_sms, programs)  # ~4 waves: measured best on H200
            num_segments = min(MAX_SEGMENTS, _next_power_of_2(want), kv_tiles // 2)
            num_segments = 1 << (num_segments.bit_length() - 1)  # a power of two for tl.arange
        if fp8_decode_128:
            # capped at 128 registers, four programs fit on an SM; split only where that fills
            # the waves better than one pass (each split costs ~5%: partials and their reduce)
            working = max(num_seqs, _cdiv(num_tokens, block_q)) * (num_kv_heads // kv_heads)
            num_segments = _fp8_decode_segments(working, kv_tiles, num_segments, 4 * num_sms)
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two >= 1, got {num_segments}")
    num_warps = 4 if block_m * d_pad * kv_heads <= 64 * 128 else 8
    num_stages = 3 if fp8_decode_128 else 2
    maxnreg = 128 if fp8_decode_128 and num_warps == 4 else None
    if plain_causal and not decode_like and d_pad <= 128 and num_segments == 1:
        if num_tokens >= 1024 * num_seqs:  # long prompts: 128 x 128 tiles, 8 warps
            wide = max(128, _next_power_of_2(group))
            # the Q tile and 3 stages of K and V tiles, 16-bit: 224 KiB at D=128 (Hopper: 227)
            deep = (wide + 3 * 2 * 128) * d_pad * 2 <= shared_memory
            stages = 3 if deep and query_bytes == 2 and not fp8_cache else 2
            return LaunchConfig(wide, wide // group, 128, 1, 8, stages, kernel="prefill",
                                heads_fastest=1, reverse_blocks=1)  # fmt: skip
        # An FP8 cache takes the prefill kernel for long prompts only: measured 1.24-1.32x faster
        # than the unified kernel there (H100, 4 x 2048 and 1 x 8192); short-prompt steps were not
        # measured apart, and one end-to-end run at 256 x 128 read 0.95x (NOTES.md section 10).
        if not fp8_cache:
            return LaunchConfig(block_m, block_q, 64, 1, 4, 2, kernel="prefill",
                                heads_fastest=1, reverse_blocks=1)  # fmt: skip
    # Decode: a query block's KV-head programs launch together, so they read the same KV pages
    # at the same time (H100, one run each: bf16 D=64 64 x 4096 194.0 -> 183.8 us, FP8 D=64
    # 111.4 -> 108.9, D=128 0-1.4% faster, one row 0.7% slower; NOTES.md section 10)
    # FP8 decode reads V as int16 pairs (16-bit transposing loads; paged_attention drops it where
    # the cache or query does not fit): the loop's SASS 1,499 -> 929 instructions per thread at
    # D=128 (NOTES.md section 10)
    return LaunchConfig(block_m, block_q, tile_n, num_segments, num_warps, num_stages,
                        maxnreg=maxnreg, kv_heads=kv_heads,
                        heads_fastest=int(decode_like), v_pairs=int(fp8_decode),
                        first_blocks=int(decode_like))  # fmt: skip


def layer_launch_config(
    spec: LayerSpec, max_kv_len: int, num_sms: int, shared_memory: int = 0
) -> Callable[[int, int], LaunchConfig]:
    """``(T, S) -> LaunchConfig``: what :func:`paged_attention` picks for a layer of ``spec`` in
    a step of ``T`` tokens and ``S`` sequences, with a block table of ``max_kv_len`` positions on
    a GPU of ``num_sms`` SMs and ``shared_memory`` bytes per program (``_shared_memory``; each
    distinct result is a kernel variant to compile)."""
    plain_causal = (
        spec.causal
        and not (spec.sliding_window or 0) > 0
        and not (spec.softcap or 0) > 0
        and not spec.has_sinks
        and not spec.has_alibi
    )
    fp8_cache = spec.kv_dtype is not None and is_fp8(spec.kv_dtype)

    def config_of(num_tokens: int, num_seqs: int) -> LaunchConfig:
        return launch_config(
            num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=spec.num_q_heads,
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, max_kv_len=max_kv_len,
            num_sms=num_sms, fp8_cache=fp8_cache, plain_causal=plain_causal,
            query_bytes=spec.dtype.itemsize, shared_memory=shared_memory,
        )  # fmt: skip

    return config_of


def _fp8_decode_segments(programs: int, kv_tiles: int, at_least: int, slots: int) -> int:
    """Split-KV segments for FP8 decode at D=128: the power of two (>= ``at_least``, each segment
    >= 4 KV tiles) with the fewest estimated waves per unit of work, ``ceil(P n / slots) / n``
    for ``P`` working programs and ``slots`` that run at once, plus 10% per doubling (partials,
    their reduce, and a partly filled wave running faster than a full one). H100, 64 x 4096
    (512 programs on 528 slots): 1 segment 207 us, 2 218 us, 4 230 us; uncapped (396 slots)
    1 segment 242 us, 2 226 us (benchmarks/NOTES.md section 10)."""

    def cost(n: int) -> float:
        return -(-programs * n // slots) / n * (1.0 + 0.1 * (n.bit_length() - 1))

    options = [at_least]
    while options[-1] * 2 <= min(MAX_SEGMENTS, kv_tiles // 4):
        options.append(options[-1] * 2)
    return min(options, key=cost)


def _v_pairs_fit(kv_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether an FP8 cache's layout lets the unified kernel read V as int16 pairs (``v_pairs``;
    the query must also take the float16 dots, ``F16_DOT``)."""
    return (
        head_dim == _d_pad(head_dim)
        and kv_cache.stride(-1) == 1
        and all(st % 2 == 0 for st in kv_cache.stride()[:-1])
        and kv_cache.data_ptr() % 2 == 0
    )


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [N, 2, B, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_table: torch.Tensor,  # [S, W] int32
    *,
    scale: float,
    causal: bool,
    window: int,  # <= 0: off
    softcap: float,  # <= 0: off
    sinks: torch.Tensor | None,  # [Hq] fp32
    alibi_slopes: torch.Tensor | None,  # [Hq] fp32
    k_scale: torch.Tensor | None = None,  # [] or [Hkv] fp32 (FP8 cache)
    v_scale: torch.Tensor | None = None,
    plan_handle: int = -1,
    num_segments: int | None = None,
    config: LaunchConfig | None = None,
    new_key: torch.Tensor | None = None,  # [T, Hkv, D]
    new_value: torch.Tensor | None = None,  # [T, Hkv, D]
    slot_mapping: torch.Tensor | None = None,  # [T] int64, -1 = none
    out: torch.Tensor | None = None,  # [T, Hq, D], query's dtype
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin [T, D]
) -> torch.Tensor:  # [T, Hq, D]
    """Paged attention with the op contract's semantics, into ``out`` if given.

    ``num_segments`` forces split-KV and ``config`` every launch choice (tests and tile sweeps);
    by default :func:`launch_config` picks them from shapes. ``new_key``/``new_value``/
    ``slot_mapping``: a decode step's K/V, written into the cache before it is read. The caller
    guarantees at most one query token per sequence; then the attention kernel writes them
    itself (one launch fewer per layer, benchmarks/NOTES.md sections 23-24), except on an FP8
    cache or with the prefill kernel, where :func:`write_kv` runs first. ``rope``: ``query`` and
    ``new_key`` come unrotated; the kernel that writes the K/V rotates both as it reads them
    (rotate-half, :mod:`paged_ops.rope`), anything else rotates them first.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if out is None:
        out = query.new_empty(query.shape)  # [T, Hq, D]
    if num_tokens == 0:
        return out
    fp8_cache = is_fp8(kv_cache.dtype)
    # what the prefill kernel serves: no window, softcap, sinks or ALiBi
    plain_causal = (
        bool(causal) and window <= 0 and softcap <= 0 and sinks is None and alibi_slopes is None
    )
    f16_dot = fp8_cache and query.dtype in (torch.float16, torch.bfloat16)
    pairs_fit = f16_dot and _v_pairs_fit(kv_cache, head_dim)
    cfg = config or launch_config(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_kv_len=block_table.shape[1] * block_size,
        num_sms=_num_sms(query.device),
        num_segments=num_segments,
        fp8_cache=fp8_cache,
        plain_causal=plain_causal,
        query_bytes=query.element_size(),
        shared_memory=_shared_memory(query.device),
    )
    group = num_q_heads // num_kv_heads
    if cfg.kernel not in KERNELS:
        raise ValueError(f"{cfg}: kernel must be one of {KERNELS}, got {cfg.kernel!r}")
    if (
        cfg.kv_heads < 1
        or num_kv_heads % cfg.kv_heads
        or (cfg.kernel != "unified" and cfg.kv_heads != 1)
    ):
        raise ValueError(
            f"{cfg}: kv_heads must divide num_kv_heads={num_kv_heads} (and be 1 for the "
            "prefill kernel)"
        )
    if cfg.reverse_blocks and cfg.kernel != "prefill":
        raise ValueError(f"{cfg}: reverse_blocks=1 orders the prefill kernel's grid only")
    rows_per_token = group * cfg.kv_heads
    if cfg.block_q < 1 or cfg.block_q * rows_per_token > cfg.block_m:
        raise ValueError(
            f"{cfg} does not fit the GQA group {group} x kv_heads {cfg.kv_heads}: need "
            "1 <= block_q * group * kv_heads <= block_m"
        )
    d_pad = _d_pad(head_dim)
    dummy = cu_seqlens_q  # stands in for absent optional tensors (never read)
    fp8 = fp8_format(kv_cache.dtype)
    decode_bits = fp8_cache and _interpreting()
    cache_arg = kv_cache.view(torch.uint8) if decode_bits else kv_cache
    if cfg.v_pairs and not pairs_fit:
        if config is not None:
            raise ValueError(
                f"{cfg} (v_pairs=1) needs an FP8 cache with unit-stride rows and even strides, "
                f"16-bit queries and a power-of-two head size; got cache "
                f"{kv_cache.dtype} strides {tuple(kv_cache.stride())}, query {query.dtype}, "
                f"head_dim {head_dim}"
            )
        cfg = dataclasses.replace(cfg, v_pairs=0)
    pairs_arg = kv_cache.view(torch.int16) if cfg.v_pairs else cache_arg
    if (new_key is None) != (new_value is None) or (new_key is None) != (slot_mapping is None):
        raise ValueError(
            "new_key, new_value and slot_mapping go together; got "
            f"new_key={new_key is not None}, new_value={new_value is not None}, "
            f"slot_mapping={slot_mapping is not None}"
        )
    write_kv_here = new_key is not None and not fp8_cache and cfg.kernel == "unified"
    rope_here = rope is not None and write_kv_here
    if rope is not None and not rope_here:  # the kernel rotates only what it writes: rotate first
        query, new_key = rotate_heads(query, new_key, *rope)
    if new_key is not None and not write_kv_here:  # the kernel cannot: the write kernel first
        assert new_value is not None and slot_mapping is not None
        write_kv(new_key, new_value, kv_cache, slot_mapping, k_scale, v_scale)
    new_k = new_key if write_kv_here else query
    new_v = new_value if write_kv_here else query
    write_args = (
        new_k,
        new_v,
        slot_mapping if write_kv_here else dummy,
        *new_k.stride(),
        *new_v.stride(),
    )
    # cos, sin [T, D] with unit stride along D (paged_ops.rope.rope_rows); else never read
    rope_args = (
        (*rope, rope[0].stride(0), rope[1].stride(0)) if rope_here else (dummy,) * 2 + (0, 0)
    )
    fp8_args = dict(
        USE_K_SCALE=k_scale is not None,
        USE_V_SCALE=v_scale is not None,
        FP8_CACHE=fp8_cache,
        FP8_BITS=decode_bits,
        FP8_MAN=fp8["FP8_MAN"],
        FP8_BIAS=fp8["FP8_BIAS"],
        FP8_SUB_ULP=fp8["FP8_SUB_ULP"],
        F16_DOT=f16_dot,
    )
    scale_args = (
        k_scale if k_scale is not None else dummy,
        v_scale if v_scale is not None else dummy,
        _scale_stride(k_scale),
        _scale_stride(v_scale),
    )
    if cfg.kernel == "prefill":  # (a forced config may ask for it where it does not apply)
        if not plain_causal:
            raise ValueError(
                f"{cfg} (kernel='prefill') serves plain causal attention only: no window, "
                "softcap, sinks or ALiBi"
            )
        if cfg.num_segments != 1:
            raise ValueError(f"{cfg} (kernel='prefill') takes one segment")
        grid, heads_fastest = _query_grid(cfg, num_tokens, num_seqs, num_kv_heads)
        launcher(kernels.prefill_attention_kernel)[grid](
            out,
            query,
            cache_arg,
            cu_seqlens_q,
            seq_lens,
            block_table,
            *scale_args,
            float(scale),
            num_seqs,
            num_tokens,
            out.stride(0),
            out.stride(1),
            *query.stride(),
            *kv_cache.stride(),
            block_table.stride(0),
            BLOCK_SIZE=block_size,
            GROUP=group,
            BLOCK_Q=cfg.block_q,
            BLOCK_M=cfg.block_m,
            TILE_N=cfg.tile_n,
            D_PAD=d_pad,
            HEAD_DIM=head_dim,
            IEEE_DOT=query.dtype == torch.float32,
            **fp8_args,
            HEADS_FASTEST=heads_fastest,
            REVERSE_BLOCKS=bool(cfg.reverse_blocks),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        return out
    nseg = cfg.num_segments
    if nseg > 1:
        # fp32 partials: unnormalised output, running max (log2 units) and sum per segment
        part_acc = torch.empty(
            num_tokens, num_q_heads, nseg, d_pad, dtype=torch.float32, device=query.device
        )
        part_m = torch.empty(
            num_tokens, num_q_heads, nseg, dtype=torch.float32, device=query.device
        )
        part_l = torch.empty_like(part_m)
        target = part_acc
    else:
        part_m = part_l = target = out
    axes, heads_fastest = _query_grid(cfg, num_tokens, num_seqs, num_kv_heads // cfg.kv_heads)
    launcher(kernels.paged_attention_kernel)[(*axes, nseg)](
        target,
        part_m,
        part_l,
        query,
        cache_arg,
        pairs_arg,
        cu_seqlens_q,
        seq_lens,
        block_table,
        sinks if sinks is not None else dummy,
        alibi_slopes if alibi_slopes is not None else dummy,
        *scale_args,
        *write_args,
        *rope_args,
        float(scale),
        float(softcap),
        int(window),
        num_seqs,
        num_tokens,
        num_q_heads,
        out.stride(0),
        out.stride(1),
        *query.stride(),
        *kv_cache.stride(),
        block_table.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=rows_per_token,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        TILE_N=cfg.tile_n,
        D_PAD=d_pad,
        HEAD_DIM=head_dim,
        CAUSAL=bool(causal),
        USE_WINDOW=window > 0,
        USE_SOFTCAP=softcap > 0,
        USE_SINKS=sinks is not None,
        USE_ALIBI=alibi_slopes is not None,
        NUM_SEGMENTS=nseg,
        IEEE_DOT=query.dtype == torch.float32,
        **fp8_args,
        KV_HEADS=cfg.kv_heads,
        HEADS_FASTEST=heads_fastest,
        V_PAIRS=bool(cfg.v_pairs),
        FIRST_BLOCKS=bool(cfg.first_blocks),
        WRITE_KV=write_kv_here,
        ROPE=rope_here,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )
    if nseg > 1:
        launcher(kernels.reduce_segments_kernel)[(num_tokens, num_q_heads)](
            out,
            part_acc,
            part_m,
            part_l,
            cu_seqlens_q,
            sinks if sinks is not None else dummy,
            num_seqs,
            num_q_heads,
            head_dim,
            out.stride(0),
            out.stride(1),
            NUM_SEGMENTS=nseg,
            D_PAD=d_pad,
            USE_SINKS=sinks is not None,
            num_warps=4,
        )
    return out


def write_kv_and_attend(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [N, 2, B, Hkv, D], written
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_table: torch.Tensor,  # [S, W] int32
    *,
    out: torch.Tensor,  # [T, Hq, D], written
    decode_step: bool,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin [T, D]
    **attention: Any,
) -> None:
    """:func:`write_kv` then :func:`paged_attention` into ``out``; in a decode step (at most one
    query token per sequence: the caller's guarantee) one launch, the attention kernel storing
    each token's K/V before reading it (``paged_attention``'s ``new_key``). ``rope``: query and
    key come unrotated (a decode step's kernel rotates them, other steps first)."""
    args = (cu_seqlens_q, seq_lens, block_table)
    if decode_step:
        paged_attention(query, kv_cache, *args, k_scale=k_scale, v_scale=v_scale, new_key=key,
                        new_value=value, slot_mapping=slot_mapping, out=out, rope=rope,
                        **attention)  # fmt: skip
        return
    if rope is not None:
        query, key = rotate_heads(query, key, *rope)
    write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    paged_attention(query, kv_cache, *args, k_scale=k_scale, v_scale=v_scale, out=out, **attention)
