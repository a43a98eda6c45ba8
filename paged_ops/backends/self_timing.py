"""A quick self-timing of "auto"'s candidates on a GPU the cost table does not know.

One representative step per kind (decode 16 x 1024, prefill 2 x 1024, mixed 2 x 256-token chunks
next to 14 decodes at 1024; smaller when the PagedAttention's limits are), each backend's op timed
with CUDA events on a scratch cache (the real cache is never touched), FlashInfer's host ``plan()``
timed with a host clock. About 10-50 ms per layer group, once, at the first step the group runs
(outside any graph capture); the first FlashInfer call may also JIT-compile its kernels.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch

from paged_ops.backends import LayerSpec, get_backend
from paged_ops.backends.cost_table import AutoPolicy, choose_from_timings
from paged_ops.cache import blocks_needed
from paged_ops.metadata import STEP_KINDS, MetadataBuilder, SequenceSlice

_REPEATS = 5  # timed runs per backend and kind (median), after one untimed run


def _steps(max_seqs: int, max_len: int) -> dict[str, list[tuple[int, int]]]:
    """``{kind: [(context, new tokens) per sequence]}`` of the timed steps."""
    ctx, prompt = min(1024, max_len - 1), min(1024, max_len)
    decodes = max(1, min(16, max_seqs))
    chunk, mixed_decodes = min(256, max_len), max(0, min(14, max_seqs - 2))
    return {
        "decode": [(ctx, 1)] * decodes,
        "prefill": [(0, prompt)] * min(2, max_seqs),
        "mixed": [(0, chunk)] * min(2, max_seqs) + [(ctx, 1)] * mixed_decodes,
    }


def _time_us(fn: Any) -> float:
    """Median device time of ``fn()`` in microseconds (CUDA events)."""
    fn()  # untimed: JIT builds, autotuning, first-touch allocations
    times = []
    for _ in range(_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def measure_policy(
    spec: LayerSpec,
    device: torch.device,
    *,
    num_layers: int,
    planners: Mapping[str, Any],
    block_size: int,
    max_num_seqs: int,
    max_blocks_per_seq: int,
) -> AutoPolicy:
    """Time triton and the host-planned candidates in ``planners`` on each step kind; choose.

    Args:
        spec: the layer group's features; num_layers: its layer count.
        planners: ``{backend: planner}`` of the group (re-planned by the next real step).
        block_size, max_num_seqs, max_blocks_per_seq: the owner's limits (the planners' sizes).
    """
    steps = _steps(max_num_seqs, max_blocks_per_seq * block_size)
    seqs_needed = max(len(s) for s in steps.values())
    blocks_per_seq = blocks_needed(max(c + n for s in steps.values() for c, n in s), block_size)
    num_blocks = seqs_needed * blocks_per_seq
    max_tokens = max(sum(n for _, n in s) for s in steps.values())
    builder = MetadataBuilder(
        max_num_tokens=max_tokens,
        max_num_seqs=max_num_seqs,
        max_blocks_per_seq=max_blocks_per_seq,
        block_size=block_size,
        num_blocks=num_blocks,
        device=device,
    )
    kv_dtype = spec.kv_dtype or spec.dtype
    cache = torch.zeros(  # [N, 2, B, Hkv, D]
        num_blocks, 2, block_size, spec.num_kv_heads, spec.head_dim, device=device
    ).to(kv_dtype)
    scales = (
        (torch.ones((), device=device), torch.ones((), device=device))
        if kv_dtype != spec.dtype
        else (None, None)
    )
    constants = dict(
        scale=spec.head_dim**-0.5,
        causal=spec.causal,
        window=spec.sliding_window or 0,
        softcap=spec.softcap or 0.0,
        sinks=None,
        alibi_slopes=None,
        k_scale=scales[0],
        v_scale=scales[1],
    )
    kernel_us: dict[str, dict[str, float]] = {}
    plan_us: dict[str, dict[str, float]] = {}
    prefill_flops = 0.0
    for kind in STEP_KINDS:
        slices = [
            SequenceSlice(range(i * blocks_per_seq, (i + 1) * blocks_per_seq), ctx, n)
            for i, (ctx, n) in enumerate(steps[kind])
        ]
        md = builder.build(slices)
        if kind == "prefill":
            prefill_flops = 4.0 * spec.num_q_heads * spec.head_dim * md.attention_pairs
        query = torch.randn(
            md.padded_num_tokens, spec.num_q_heads, spec.head_dim, device=device
        ).to(spec.dtype)
        kernel_us[kind], plan_us[kind] = {}, {}
        for name in ("triton", *planners):
            planner = planners.get(name)
            if planner is not None:
                host = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    planner.plan(md)
                    host.append((time.perf_counter() - t0) * 1e6)
                plan_us[kind][name] = statistics.median(host)
            handle = -1 if planner is None else planner.handle
            call = functools.partial(
                get_backend(name).paged_attention,
                *(query, cache, md.cu_seqlens_q, md.seq_lens, md.block_table),
                plan_handle=handle,
                **constants,
            )
            kernel_us[kind][name] = _time_us(call)
    return choose_from_timings(kernel_us, plan_us, prefill_flops, num_layers)
