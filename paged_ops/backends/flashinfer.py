"""FlashInfer backend: plan() on the host before the forward, run() inside the op.

- Prefill and mixed steps run ``BatchPrefillWithPagedKVCacheWrapper`` (causal, FA3 on sm90 through
  ``backend="auto"``); decode-only steps run ``BatchDecodeWithPagedKVCacheWrapper`` built with
  ``use_cuda_graph=True`` per batch bucket, on tensor cores when ``Hq / Hkv >= 4``.
- ``make_planner`` gives ``PagedAttention`` one planner per layer group; the op reaches it through
  ``plan_handle`` (see :mod:`paged_ops.backends.flashinfer_planner`).
- Head sizes 64/128/256, float16/bfloat16, causal or not, sliding window, softcap. No sinks, no
  ALiBi: "auto" gives such layers to triton, and ``backend="flashinfer"`` refuses them.
- FP8 KV cache (``float8_e4m3fn``/``float8_e5m2``) under float16/bfloat16 queries: the wrappers
  are planned with ``kv_data_type=<cache dtype>`` and read the stored values as they are; the
  prefill wrapper (and tensor-core decode) runs FA2, since FA3 takes an FP8 cache only with FP8
  queries. FlashInfer's own ``run(k_scale=, v_scale=)`` takes Python floats (a host value: a
  trace constant, a recompile per value, a device-to-host sync when the scale lives on the GPU,
  and per layer only), so it is never used. The float32 scale tensors (``[]`` per layer or
  ``[Hkv]`` per KV head) are folded on the device instead: ``query[:, h] * k_scale[h // G]``
  before the run (a score ``q . (stored * k) = (q * k) . stored``; multiplied in float32, rounded
  to the query dtype) and ``out[:, h] * v_scale[h // G]`` after it (the softmax weights sum to
  one). Both are plain torch ops: sync-free, inside torch.compile and CUDA graphs, so "auto"
  keeps FlashInfer for per-layer and per-head scales alike. The cost is two elementwise passes
  (query and output) per layer and the query's rounding after the scale (a relative 2^-9 for
  bfloat16, as for any bfloat16 query); a float16 query times ``k_scale`` must stay finite.
- KV writes quantize with :func:`paged_ops.fp8.quantize` (triton's write kernel on CUDA, else
  :func:`~paged_ops.backends.flashinfer_host.scatter_kv`).

flashinfer is optional: it is imported only when a planner is built or ``is_available()`` runs on a
machine with CUDA, never by ``import paged_ops``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from paged_ops.backends import LayerSpec, get_plan_state, register_plan_state
from paged_ops.backends import flashinfer_host as host
from paged_ops.backends.flashinfer_host import apply_v_scale_, fold_k_scale
from paged_ops.backends.flashinfer_planner import FlashInferPlanner, capturing


@functools.cache
def _flashinfer_importable() -> bool:
    try:
        importlib.import_module("flashinfer")
    except Exception:  # ImportError, or a broken install failing at import
        return False
    return True


def is_available() -> bool:
    """flashinfer is installed and importable, and CUDA is available."""
    return torch.cuda.is_available() and _flashinfer_importable()


def unsupported_reason(spec: LayerSpec, device: torch.device) -> str | None:
    """``None`` when FlashInfer can serve the layer on ``device``, else a sentence saying why not."""
    return host.unsupported_reason(spec, torch.device(device))


@functools.cache
def _triton_write_kv() -> Callable[..., None] | None:
    try:
        triton_backend = importlib.import_module("paged_ops.backends.triton")
    except ImportError:
        return None
    return triton_backend.write_kv if triton_backend.is_available() else None


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [N, 2, B, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [] or [Hkv] float32 (FP8 cache)
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write this step's K/V into the cache; CUDA-graph capturable, skips slot -1.

    Uses the triton backend's one-kernel write when it is available on a CUDA tensor, else a
    sync-free torch scatter (:func:`~paged_ops.backends.flashinfer_host.scatter_kv`). An FP8 cache
    stores :func:`paged_ops.fp8.quantize` of the K/V either way.
    """
    triton_write = _triton_write_kv() if kv_cache.is_cuda else None
    if triton_write is not None:
        triton_write(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    else:
        host.scatter_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def make_planner(owner: Any, cfg: Any) -> FlashInferPlanner:
    """One planner for the layers of ``owner`` (a PagedAttention) that share ``cfg`` (LayerConfig)."""
    planner = FlashInferPlanner(
        num_q_heads=owner.num_q_heads,
        num_kv_heads=owner.num_kv_heads,
        head_dim=owner.head_dim,
        block_size=owner.block_size,
        dtype=owner.dtype,
        kv_dtype=getattr(owner, "kv_cache_dtype", owner.dtype),
        device=owner.kv_cache.device,
        max_num_seqs=owner.builder.max_num_seqs,
        max_blocks_per_seq=owner.builder.max_blocks_per_seq,
        scale=float(owner.head_dim**-0.5 if cfg.scale is None else cfg.scale),
        causal=cfg.causal,
        window=int(cfg.sliding_window or 0),
        softcap=float(cfg.softcap or 0.0),
    )
    planner.handle = register_plan_state(planner)
    return planner


def prebuild(planners: list[FlashInferPlanner]) -> None:
    """JIT-compile every kernel these planners will use, all at once.

    FlashInfer otherwise compiles each variant on first use, one after the other (tens of seconds
    each). Each module is built by its own ``build_and_load`` (in threads), the way ``plan()`` will
    look for it: a combined ``flashinfer.jit.build_jit_specs`` build keeps its ninja log elsewhere,
    so the first ``plan()`` would rebuild everything. Typical use: ``prebuild(pa.planners)``.
    """
    from concurrent.futures import ThreadPoolExecutor

    specs = {spec.name: spec for p in planners for spec in p.jit_specs()}
    with ThreadPoolExecutor(max_workers=max(1, len(specs))) as pool:
        list(pool.map(lambda spec: spec.build_and_load(), specs.values()))


# Eager calls without a plan (the functional ``paged_ops.paged_attention``): one planner per
# geometry and constants, planned from the device tensors (a host sync; never inside a CUDA graph).
_unplanned: dict[tuple, FlashInferPlanner] = {}


def _run_unplanned(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    window: int,
    softcap: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if capturing():
        raise RuntimeError(
            "FlashInfer backend: a CUDA graph can only capture planned calls; use PagedAttention "
            "(prepare/prepare_slices plans the step) or backend='triton'"
        )
    num_seqs, width = block_table.shape
    geometry = (query.shape[1], kv_cache.shape[3], query.shape[2], kv_cache.shape[2])
    key = (*geometry, query.dtype, kv_cache.dtype, query.device, scale, causal, window, softcap)
    planner = _unplanned.get(key)
    if planner is None or planner.max_num_seqs < num_seqs or planner.max_blocks_per_seq < width:
        _unplanned[key] = FlashInferPlanner(  # staging buffers sized for the largest batch seen
            num_q_heads=geometry[0],
            num_kv_heads=geometry[1],
            head_dim=geometry[2],
            block_size=geometry[3],
            dtype=query.dtype,
            kv_dtype=kv_cache.dtype,
            device=query.device,
            max_num_seqs=max(num_seqs, planner.max_num_seqs if planner else 0),
            max_blocks_per_seq=max(width, planner.max_blocks_per_seq if planner else 0),
            scale=scale,
            causal=causal,
            window=window,
            softcap=softcap,
        )
    planner = _unplanned[key]
    host_cu, host_lens = cu_seqlens_q.cpu(), seq_lens.cpu()  # [S+1], [S]
    nonempty = torch.nonzero(host_lens > 0)  # padded sequences (length 0) trail the real ones
    real = int(nonempty[-1]) + 1 if len(nonempty) else 0
    shape = host.StepShape("prefill" if real else "empty", real, int(host_cu[real]))
    planner.plan_host(shape, host_cu, host_lens, block_table.cpu())
    return planner.run(query, kv_cache, seq_lens, out=out)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [N, 2, B, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_table: torch.Tensor,  # [S, max_blocks] int32
    *,
    scale: float,
    causal: bool,
    window: int,  # <= 0: off
    softcap: float,  # <= 0: off
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    k_scale: torch.Tensor | None = None,  # [] or [Hkv] float32 (FP8 cache)
    v_scale: torch.Tensor | None = None,
    plan_handle: int = -1,
    out: torch.Tensor | None = None,  # [T, Hq, D] contiguous: written and returned when given
) -> torch.Tensor:  # [T, Hq, D]
    """Attention through the wrapper planned under ``plan_handle`` (or an eager plan if -1).

    The planned path reads no tensor values on the host, so it runs inside torch.compile and,
    for decode steps, inside a CUDA graph. Padded query tokens get zeros. FP8 scales are folded
    on the device: ``k_scale`` into the query before the run, ``v_scale`` into the output after.
    """
    if sinks is not None or alibi_slopes is not None:
        raise ValueError(
            "backend 'flashinfer' does not support attention sinks or ALiBi; use "
            "backend='triton' or 'auto'"
        )
    constants = dict(scale=scale, causal=causal, window=window, softcap=softcap)
    num_kv_heads = kv_cache.shape[3]
    scaled_query = fold_k_scale(query, k_scale, num_kv_heads)  # query itself when None
    given = out
    if plan_handle < 0:
        out = _run_unplanned(
            scaled_query, kv_cache, cu_seqlens_q, seq_lens, block_table, **constants, out=given
        )
    else:
        planner: FlashInferPlanner = get_plan_state(plan_handle)
        planned = dict(
            scale=planner.scale,
            causal=planner.causal,
            window=planner.window,
            softcap=planner.softcap,
        )
        if constants != planned:
            raise RuntimeError(
                f"FlashInfer plan {plan_handle} was made for {planned}, the layer asks for "
                f"{constants}"
            )
        out = planner.run(scaled_query, kv_cache, seq_lens, out=given)
    apply_v_scale_(out, v_scale, num_kv_heads)  # padded rows stay zero
    if given is None and not query.is_contiguous():  # the fake kernel's empty_like(query) strides
        out = torch.empty_like(query).copy_(out)
    return out
