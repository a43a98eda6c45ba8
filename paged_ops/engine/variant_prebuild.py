"""Compile the triton attention's kernel variants beside the first start's model compile.

Each launch configuration of the triton backend is a kernel variant that Triton compiles the
first time a step picks it (~0.5 s each on an H100 host); the warm-up's steps after the first
(``ModelRunner._warm_up_shapes``) meet them one at a time, 2.7-4.1 s of a first start on an H100
(benchmarks/NOTES.md sections 18-20). The first step's compile before them is 26-35 s of mostly
single-threaded Python (Dynamo, AOTAutograd, Inductor), and Triton's MLIR, LLVM and ``ptxas``
stages release the GIL, so a thread can build the variants meanwhile: :func:`start` calls the
backend's ``paged_attention`` once per distinct configuration, on the layer's own cache (read
only: attention never writes it) and metadata from a builder of its own with the engine's
sizes, so every argument that Triton specialises on (dtypes, strides, the block table's width,
the sequence and token counts, pointer alignment) is what the engine's step passes. The warm-up
joins the thread after its first step; a variant the thread did not build (an error, a
specialisation it did not foresee) compiles in the step that meets it, as without it.

``PAGED_OPS_PREBUILD_VARIANTS=0`` turns it off (to measure it).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

import torch

from paged_ops.metadata import MetadataBuilder
from paged_ops.module import PagedAttention

logger = logging.getLogger("paged_ops")

Step = tuple[int, int]  # (T tokens, S sequences)


def enabled() -> bool:
    return os.environ.get("PAGED_OPS_PREBUILD_VARIANTS", "1") != "0"


def _steps_per_variant(pa: PagedAttention, steps: Sequence[Step]) -> list[tuple[int, Step]]:
    """``(layer, step)`` for each distinct (layer kind, launch configuration) of ``steps`` on the
    layers that the triton backend serves for some step kind."""
    from paged_ops.backends import triton as triton_backend

    table = pa.backend_table()
    max_kv_len = pa.builder.max_blocks_per_seq * pa.block_size
    num_sms = triton_backend._num_sms(pa.kv_cache.device)
    out, seen = [], set()
    for layer, spec in enumerate(pa.layer_specs):
        if not any(names[layer] == "triton" for names in table.values()):
            continue
        config_of = triton_backend.layer_launch_config(spec, max_kv_len, num_sms)
        for step in steps:
            key = (spec, config_of(*step))
            if key not in seen:
                seen.add(key)
                out.append((layer, step))
    return out


def _build(pa: PagedAttention, work: list[tuple[int, Step]], built: list[int]) -> None:
    try:
        _build_all(pa, work, built)
    except Exception as e:  # noqa: BLE001 - the steps compile what is missing, as without it
        logger.debug("variant prebuild stopped: %r", e)


def _build_all(pa: PagedAttention, work: list[tuple[int, Step]], built: list[int]) -> None:
    from paged_ops.backends import triton as triton_backend
    from paged_ops.engine.runner import warm_up_slices  # (the runner imports this module)

    src = pa.builder
    builder = MetadataBuilder(
        max_num_tokens=src.max_num_tokens,
        max_num_seqs=src.max_num_seqs,
        max_blocks_per_seq=src.max_blocks_per_seq,
        block_size=src.block_size,
        num_blocks=src.num_blocks,
        device=src.device,
    )
    device = pa.kv_cache.device
    with torch.inference_mode():
        for layer, (tokens, seqs) in work:
            spec = pa.layer_specs[layer]
            cache, k_scale, v_scale = pa.layer_inputs(layer)  # [N, 2, B, Hkv, D], read only
            slices = warm_up_slices(0, tokens, seqs, pa)  # as the warm-up's own steps
            md = builder.build(slices, num_tokens=tokens, num_seqs=seqs)
            query = torch.zeros(tokens, spec.num_q_heads, spec.head_dim, dtype=spec.dtype,
                                device=device)  # [T, Hq, D]  # fmt: skip
            extra = torch.zeros(spec.num_q_heads, dtype=torch.float32, device=device)  # [Hq]
            try:
                triton_backend.paged_attention(
                    query, cache, md.cu_seqlens_q, md.seq_lens, md.block_table,
                    scale=spec.head_dim**-0.5, causal=spec.causal,
                    window=int(spec.sliding_window or 0), softcap=float(spec.softcap or 0.0),
                    sinks=extra if spec.has_sinks else None,
                    alibi_slopes=extra if spec.has_alibi else None,
                    k_scale=k_scale, v_scale=v_scale,
                )  # fmt: skip
            except Exception as e:  # noqa: BLE001 - the step that meets it compiles it
                logger.debug("variant prebuild of %s at %s failed: %r", spec, (tokens, seqs), e)
                continue
            built[0] += 1


def start(pa: PagedAttention, steps: Sequence[Step]) -> tuple[threading.Thread, list[int]] | None:
    """Start building the variants of ``steps`` (the warm-up's, with its graph buckets) in a
    daemon thread; returns it and a one-element count of the variants built, or None when there
    is nothing to do (no triton layer, off, not CUDA)."""
    if pa.kv_cache.device.type != "cuda" or not enabled():
        return None
    work = _steps_per_variant(pa, steps)
    if not work:
        return None
    built = [0]
    thread = threading.Thread(
        target=_build, args=(pa, work, built), name="paged_ops-variant-prebuild", daemon=True
    )
    thread.start()
    return thread, built
