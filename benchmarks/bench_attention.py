"""Paged attention, every backend side by side in one run: decode KV-read bandwidth, prefill FLOP/s.

Each backend is driven the same way, as a model would drive it: a ``PagedAttention`` built with
``backend=name`` (which creates FlashInfer's planners), ``prepare_slices`` to build the step's metadata
and plan, then the ``paged_ops::paged_attention`` op on each layer's cache. Decode steps are timed as
CUDA-graph replays (as the engine serves them); prefill and mixed steps eagerly (they are not
captured). Small shapes cycle over several layers' caches so the KV read does not come from L2.

FP8 KV cache rows (``--kv-dtypes`` with an fp8 name, or ``--fp8-only``): decode with bf16 queries
over a bf16 cache and over FP8 caches (e4m3, e5m2) written by ``paged_ops.write_kv`` from the same
random K/V (per-head spread 0.5x-2x of randn; scales per KV head from the data's amax, ``amax /
(fp8_max / 2)``), on every backend that serves them. Each row reports its time, speedups (triton
FP8 vs triton bf16 and vs FlashInfer on the same FP8 dtype) and the FP8 output's relative error
against the bf16-cache output of the same backend, ``||o_fp8 - o_bf16|| / ||o_bf16||``.

    python benchmarks/bench_attention.py [--quick] [--out benchmarks/results/attention.json]
    python benchmarks/bench_attention.py --fp8-only --out fp8.json     # just the FP8 comparison
    python benchmarks/bench_attention.py --fp8-only --fp8-rounds 5 ...   # 5 alternating rounds
    TRITON_INTERPRET=1 python benchmarks/bench_attention.py --device cpu --dtype float16 \\
        --fp8-only --fp8-shapes 2x64 --fp8-head-dims 64 --calls 1 --repeats 1   # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

import paged_ops
from paged_ops import PagedAttention, SequenceSlice, available_backends, blocks_needed
from paged_ops.fp8 import fp8_max, is_fp8, resolve_kv_cache_dtype

HQ, HKV, BLOCK = 32, 8, 16
DEVICE = "cuda"  # --device
DTYPE = torch.bfloat16  # --dtype: queries (and the unquantized cache)
L2_BYTES = 60 * 2**20  # H200; an H100 has 50 MiB
FP8_SHAPES = "64x4096,256x4096,8x16384,1x16384"  # batch x context
KV_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}  # fmt: skip


def decode_cases(quick: bool) -> list[dict]:
    batches, contexts = (
        ([1, 8, 64], [4096, 16384]) if quick else ([1, 8, 64, 256], [512, 4096, 16384])
    )
    cases = [dict(kind="decode", D=128, q=[1] * b, kv=[c] * b) for b in batches for c in contexts]
    cases += [dict(kind="decode", D=d, q=[1] * 64, kv=[4096] * 64) for d in (64, 256)]
    return cases


def prefill_cases() -> list[dict]:
    chunked = [512] * 4 + [1] * 64  # 4 prompt chunks of 512 after 1536 cached, 64 decodes at 4096
    return [
        dict(kind="prefill", D=128, q=[2048] * 4, kv=[2048] * 4),
        dict(kind="mixed", D=128, q=chunked, kv=[2048] * 4 + [4096] * 64),
    ]


def fp8_cases(shapes: str, head_dims: str) -> list[dict]:
    """Decode cases ``batch x context`` (e.g. "64x4096,1x16384") for each head size."""
    cases = []
    for d in (int(x) for x in head_dims.split(",")):
        for shape in shapes.split(","):
            b, c = (int(x) for x in shape.lower().split("x"))
            cases.append(dict(kind="decode", D=d, q=[1] * b, kv=[c] * b))
    return cases


def build(
    backend: str,
    case: dict,
    num_layers: int,
    kv_cache_dtype: torch.dtype | None = None,
    fill=None,  # (pa, slices) -> None writes the cache; None: random normal values
) -> tuple[PagedAttention, torch.Tensor]:
    """A PagedAttention holding the case's sequences in shuffled blocks; returns it and a query."""
    need = [blocks_needed(n, BLOCK) for n in case["kv"]]
    pa = PagedAttention(
        num_layers=num_layers, num_q_heads=HQ, num_kv_heads=HKV, head_dim=case["D"],
        block_size=BLOCK, num_blocks=sum(need), max_num_seqs=len(need),
        max_num_tokens=sum(case["q"]), max_model_len=max(case["kv"]), dtype=DTYPE,
        device=DEVICE, backend=backend, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    perm = torch.randperm(sum(need), generator=case.get("perm_generator")).tolist()
    slices, start = [], 0
    for q_len, kv_len, n in zip(case["q"], case["kv"], need, strict=True):
        slices.append(SequenceSlice(perm[start : start + n], kv_len - q_len, q_len))
        start += n
    if fill is None:
        pa.kv_cache.data.normal_()  # never time on zeros
    else:
        fill(pa, slices)
    pa.prepare_slices(slices)  # the first plan JIT-compiles FlashInfer's kernels: not timed
    t0 = time.perf_counter()
    for _ in range(3):
        pa.prepare_slices(slices)
    case["host_prepare_ms"] = (time.perf_counter() - t0) / 3 * 1e3
    g = case.get("query_generator")
    query = torch.randn(sum(case["q"]), HQ, case["D"], generator=g, device=DEVICE, dtype=DTYPE)
    return pa, query


def attention_calls(
    pa: PagedAttention,
    query: torch.Tensor,
    calls: int,
    scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,  # per layer (k, v); FP8 only
):
    md, layers = pa.metadata, pa.kv_cache.layers
    scale = query.shape[-1] ** -0.5

    def run() -> None:
        for i in range(calls):
            j = i % len(layers)
            k_scale, v_scale = scales[j] if scales is not None else (None, None)
            torch.ops.paged_ops.paged_attention.default(
                query, layers[j], md.cu_seqlens_q, md.seq_lens, md.block_table,
                scale, True, 0, 0.0, None, None, k_scale, v_scale, pa.layer_backends[0],
                pa.layer_plan_handles[0],
            )  # fmt: skip

    return run


def median_seconds(run, calls: int, graph: bool, repeats: int = 7) -> float:
    if DEVICE == "cpu":  # smoke tests of the script (Triton interpreter): wall time, no graphs
        run()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) / calls)
        return statistics.median(times)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up (JIT, autotune) outside any capture
    torch.cuda.current_stream().wait_stream(side)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        run = g.replay
    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def empty_cache() -> None:
    if DEVICE != "cpu":
        torch.cuda.empty_cache()


def layers_for(kv_bytes: int) -> int:
    """Layers' caches to cycle over so that a timed region reads >= 4x L2 from memory."""
    return max(1, min(64, -(-4 * L2_BYTES // kv_bytes)))


def measure(backend: str, case: dict, calls: int, repeats: int = 7) -> dict:
    d = case["D"]
    kv_bytes = sum(case["kv"]) * 2 * HKV * d * DTYPE.itemsize  # K and V, each read once
    pa, query = build(backend, case, layers_for(kv_bytes))
    graph = case["kind"] == "decode" and backend != "reference" and DEVICE != "cpu"
    sec = median_seconds(attention_calls(pa, query, calls), calls, graph, repeats)
    flops = sum(
        4 * HQ * d * sum(min(kv - q + i + 1, kv) for i in range(q))
        for q, kv in zip(case["q"], case["kv"], strict=True)
    )
    row = dict(
        backend=backend, kind=case["kind"], D=d, batch=len(case["q"]), context=max(case["kv"]),
        tokens=sum(case["q"]), us=sec * 1e6, kv_tb_per_s=kv_bytes / sec / 1e12,
        tflop_per_s=flops / sec / 1e12, timed_as="cuda_graph" if graph else "eager",
        host_prepare_ms=case["host_prepare_ms"], kv_dtype=KV_NAMES[DTYPE],
    )  # fmt: skip
    del pa, query
    empty_cache()
    return row


def forced_segments(pa: PagedAttention, query: torch.Tensor, calls: int, nseg: int):
    """Triton decode calls with a forced split-KV segment count."""
    from paged_ops.backends import triton as tb

    md, layers = pa.metadata, pa.kv_cache.layers

    def run() -> None:
        for i in range(calls):
            tb.paged_attention(
                query, layers[i % len(layers)], md.cu_seqlens_q, md.seq_lens, md.block_table,
                scale=query.shape[-1] ** -0.5, causal=True, window=0, softcap=0.0, sinks=None,
                alibi_slopes=None, num_segments=nseg,
            )  # fmt: skip

    return run


def segment_sweep(segments: list[int], calls: int) -> list[dict]:
    """Triton decode with forced split-KV segment counts, for small batches over long contexts."""
    rows = []
    for batch in (1, 8):
        case = dict(kind="decode", D=128, q=[1] * batch, kv=[16384] * batch)
        pa, query = build("triton", case, num_layers=max(1, 8 // batch))
        kv_bytes = batch * 16384 * 2 * HKV * 128 * 2
        for nseg in segments:
            sec = median_seconds(forced_segments(pa, query, calls, nseg), calls, graph=True)
            rows.append(dict(backend="triton", kind="decode_segments", D=128, batch=batch,
                             context=16384, segments=nseg, us=sec * 1e6,
                             kv_tb_per_s=kv_bytes / sec / 1e12))  # fmt: skip
            print(f"triton split-KV {batch} x 16384, {nseg:3} segments: {sec * 1e6:8.1f} us  "
                  f"{kv_bytes / sec / 1e12:.2f} TB/s")  # fmt: skip
    return rows


# ---- FP8 KV cache rows ----


def kv_source(case: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every cached token ``[sum(kv), Hkv, D]`` in DTYPE, the sequences' tokens back
    to back: randn times a per-KV-head factor from 0.5 to 2 (so per-head scales differ).
    Deterministic in ``seed``."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    n, d = sum(case["kv"]), case["D"]
    factor = torch.logspace(-1, 1, HKV, base=2.0, device=DEVICE, dtype=torch.float32)
    factor = factor.to(DTYPE)[:, None]  # [Hkv, 1]
    k = torch.randn(n, HKV, d, generator=g, device=DEVICE, dtype=DTYPE).mul_(factor)
    v = torch.randn(n, HKV, d, generator=g, device=DEVICE, dtype=DTYPE).mul_(factor)
    return k, v


def slot_mapping(slices: list[SequenceSlice], kv_lens: list[int]) -> torch.Tensor:
    """``[sum(kv)]`` int64 slots of every cached token, sequence after sequence."""
    offsets = torch.arange(BLOCK, dtype=torch.int64)
    parts = [
        (torch.tensor(list(sl.block_ids), dtype=torch.int64)[:, None] * BLOCK + offsets).flatten()[
            :kv_len
        ]
        for sl, kv_len in zip(slices, kv_lens, strict=True)
    ]
    return torch.cat(parts).to(DEVICE)


def data_scales(x: torch.Tensor, kv_dtype: torch.dtype, per_head: bool) -> torch.Tensor:
    """``amax / (fp8_max / 2)`` of ``x`` [T, Hkv, D], per KV head ``[Hkv]`` or one ``[]``."""
    amax = x.abs().amax(dim=(0, 2)) if per_head else x.abs().amax()
    return amax.float() / (fp8_max(kv_dtype) / 2)


def writer(k: torch.Tensor, v: torch.Tensor, kv_lens: list[int], per_head: bool):
    """A ``fill`` for :func:`build`: writes ``k``/``v`` into layer 0 with ``paged_ops.write_kv``
    (FP8: quantized with the data's scales, set on the PagedAttention), then copies layer 0 to the
    other layers (the timed calls cycle over them only to keep the reads out of L2)."""
    write_backend = "triton" if "triton" in available_backends() else "reference"

    def fill(pa: PagedAttention, slices: list[SequenceSlice]) -> None:
        k_scale = v_scale = None
        if is_fp8(pa.kv_cache_dtype):
            k_scale = data_scales(k, pa.kv_cache_dtype, per_head)
            v_scale = data_scales(v, pa.kv_cache_dtype, per_head)
            pa.set_kv_scales(k_scale, v_scale)  # every layer: the same data
        layer0 = pa.kv_cache.layers[0]
        slots = slot_mapping(slices, kv_lens)
        paged_ops.write_kv(k, v, layer0, slots, k_scale=k_scale, v_scale=v_scale,
                           backend=write_backend)  # fmt: skip
        if pa.kv_cache.num_layers > 1:  # byte-wise (any cache dtype)
            data = pa.kv_cache.data.view(torch.uint8)
            data[1:].copy_(data[0].expand_as(data[1:]))

    return fill


def layer_scales(pa: PagedAttention, per_head: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (k_scale, v_scale) as the op takes them: ``[Hkv]`` or ``[]``."""
    if pa.k_scales is None or pa.v_scales is None:
        return [(None, None)] * pa.kv_cache.num_layers
    if per_head:
        return [(pa.k_scales[i], pa.v_scales[i]) for i in range(pa.kv_cache.num_layers)]
    return [(pa.k_scales[i, 0], pa.v_scales[i, 0]) for i in range(pa.kv_cache.num_layers)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm())


def measure_kv(
    backend: str,
    case: dict,
    kv_dtype: torch.dtype,
    fill,
    calls: int,
    repeats: int,
    per_head: bool,
) -> tuple[dict, torch.Tensor]:
    """One FP8-section row: time of ``calls`` decode calls (CUDA-graph replays) and the output of
    layer 0 (all layers hold the same K/V) for the error columns."""
    d = case["D"]
    kv_bytes = sum(case["kv"]) * 2 * HKV * d * kv_dtype.itemsize
    pa, query = build(backend, case, layers_for(kv_bytes), kv_dtype, fill)
    scales = layer_scales(pa, per_head)
    graph = backend != "reference" and DEVICE != "cpu"
    sec = median_seconds(attention_calls(pa, query, calls, scales), calls, graph, repeats)
    md = pa.metadata
    out = torch.ops.paged_ops.paged_attention.default(
        query, pa.kv_cache.layers[0], md.cu_seqlens_q, md.seq_lens, md.block_table,
        d**-0.5, True, 0, 0.0, None, None, *scales[0], pa.layer_backends[0],
        pa.layer_plan_handles[0],
    )[: sum(case["q"])].float()  # fmt: skip
    row = dict(
        suite="fp8", backend=backend, kind="decode", D=d, batch=len(case["q"]),
        context=max(case["kv"]), tokens=sum(case["q"]), kv_dtype=KV_NAMES[kv_dtype],
        scales=("per_head" if per_head else "per_layer") if is_fp8(kv_dtype) else None,
        us=sec * 1e6, kv_tb_per_s=kv_bytes / sec / 1e12, kv_bytes=kv_bytes,
        layers_cycled=pa.kv_cache.num_layers, timed_as="cuda_graph" if graph else "eager",
        host_prepare_ms=case["host_prepare_ms"],
    )  # fmt: skip
    del pa, query
    empty_cache()
    return row, out


def _median_row(rounds: list[dict]) -> dict:
    """One row for a (backend, cache dtype) timed in several rounds: the median time (and its
    bandwidth), every round's time in ``us_rounds``."""
    row = dict(rounds[0])
    times = [r["us"] for r in rounds]
    row["us"] = statistics.median(times)
    row["kv_tb_per_s"] = row["kv_bytes"] / (row["us"] * 1e-6) / 1e12
    row["us_rounds"] = times
    return row


def _round_ratio(slow: dict, fast: dict) -> float:
    """``slow``'s time over ``fast``'s: the median of the per-round ratios (each round times both
    back to back, so a drift between rounds cancels)."""
    if len(slow["us_rounds"]) != len(fast["us_rounds"]):  # (a round that failed for one)
        return slow["us"] / fast["us"]
    return statistics.median(
        a / b for a, b in zip(slow["us_rounds"], fast["us_rounds"], strict=True)
    )


def fp8_suite(
    cases: list[dict],
    backends: list[str],
    kv_dtypes: list[torch.dtype],
    args: argparse.Namespace,
    rows: list[dict],
    skipped: list[dict],
    save,
) -> list[dict]:
    """Every case x backend x cache dtype; errors and speedups filled in per case."""
    per_head = args.fp8_scales == "head"
    fp8_rows: list[dict] = []
    for n, case in enumerate(cases):
        outputs: dict = {}
        timed: dict[tuple[str, str], list[dict]] = {}  # (backend, kv dtype) -> a row per round
        k, v = kv_source(case, seed=args.seed + n)
        fill = writer(k, v, case["kv"], per_head)
        runs = [
            (backend, kv_dtype)
            for backend in backends
            if not (
                backend == "reference" and (sum(case["kv"]) > 8 * 4096 or not args.fp8_reference)
            )
            for kv_dtype in kv_dtypes
        ]  # (the reference backend is a readable ground truth, not a contender)
        # rounds alternate the order, so neither backend is always timed first or last
        order = [
            r for rnd in range(args.fp8_rounds) for r in (runs if rnd % 2 == 0 else runs[::-1])
        ]
        failed: set[tuple[str, torch.dtype]] = set()
        for backend, kv_dtype in order:
            if (backend, kv_dtype) in failed:
                continue
            c = dict(case)
            # the same query and block layout for every backend and cache dtype of a case
            c["query_generator"] = torch.Generator(device=DEVICE).manual_seed(args.seed + n)
            c["perm_generator"] = torch.Generator().manual_seed(args.seed + n)
            label = f"{backend} {KV_NAMES[kv_dtype]} decode D={case['D']} " + (
                f"{len(case['q'])} x {max(case['kv'])}"
            )
            try:
                r, out = measure_kv(backend, c, kv_dtype, fill, args.calls, args.repeats,
                                    per_head)  # fmt: skip
            except Exception as e:  # a backend that cannot serve a case: say so, go on
                error = f"{type(e).__name__}: {e}"[:300]
                skipped.append(dict(suite="fp8", backend=backend, kind="decode", D=case["D"],
                                    batch=len(case["q"]), context=max(case["kv"]),
                                    kv_dtype=KV_NAMES[kv_dtype], error=error))  # fmt: skip
                print(f"skip {label}: {error}", flush=True)
                failed.add((backend, kv_dtype))
                empty_cache()
                continue
            outputs.setdefault((backend, kv_dtype), out)
            timed.setdefault((backend, KV_NAMES[kv_dtype]), []).append(r)
            print(f"fp8-suite D={r['D']:<3} {r['batch']:>4} x {r['context']:<6} "
                  f"{backend:10} {r['kv_dtype']:9} {r['us']:9.1f} us  "
                  f"{r['kv_tb_per_s']:5.2f} TB/s  (prepare {r['host_prepare_ms']:.2f} ms)",
                  flush=True)  # fmt: skip
        del k, v, fill
        empty_cache()
        case_rows = [_median_row(rounds) for rounds in timed.values()]
        # errors: vs the bf16 cache of the same backend, and vs triton's bf16-cache output
        by_key = {(r["backend"], r["kv_dtype"]): r for r in case_rows}
        base = KV_NAMES[DTYPE]
        for (backend, kv_dtype), out in outputs.items():
            r = by_key[backend, KV_NAMES[kv_dtype]]
            same = outputs.get((backend, DTYPE))
            r["rel_err_vs_bf16_cache"] = (
                rel_err(out, same) if same is not None and kv_dtype != DTYPE else None
            )
            tri = outputs.get(("triton", DTYPE))
            r["rel_err_vs_triton_bf16_cache"] = rel_err(out, tri) if tri is not None else None
        for r in case_rows:
            own_base = by_key.get((r["backend"], base))
            r["speedup_vs_own_bf16"] = _round_ratio(own_base, r) if own_base else None
            fi = by_key.get(("flashinfer", r["kv_dtype"]))
            r["speedup_vs_flashinfer_same_kv"] = (
                _round_ratio(fi, r) if fi and r["backend"] != "flashinfer" else None
            )
            if (
                fi
                and r["backend"] != "flashinfer"
                and len(r["us_rounds"]) > 1
                and len(r["us_rounds"]) == len(fi["us_rounds"])
            ):
                r["speedup_vs_flashinfer_rounds"] = [
                    a / b for a, b in zip(fi["us_rounds"], r["us_rounds"], strict=True)
                ]
        rows += case_rows
        fp8_rows += case_rows
        save()
        del outputs
    return fp8_rows


def fmt(x: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{spec}}"


def print_fp8_table(fp8_rows: list[dict]) -> None:
    """One line per case and cache dtype: triton and FlashInfer side by side."""
    q = KV_NAMES[DTYPE]
    print(f"\n# FP8 KV cache, decode, {q} queries: time per call (median); speedup = time of the "
          f"other / this; err = ||o - o_{q}cache|| / ||o_{q}cache||, same backend")  # fmt: skip
    print(f"{'D':>4} {'batch x ctx':>13} {'kv':>9} {'triton us':>10} {'fi us':>9} "
          f"{'tri/tri-bf16':>12} {'tri/fi':>7} {'fi/fi-bf16':>10} {'err triton':>11} "
          f"{'err fi':>9}")  # fmt: skip
    keys = dict.fromkeys((r["D"], r["batch"], r["context"]) for r in fp8_rows)
    for d, b, c in keys:
        here = {(r["backend"], r["kv_dtype"]): r for r in fp8_rows
                if (r["D"], r["batch"], r["context"]) == (d, b, c)}  # fmt: skip
        for kv in dict.fromkeys(r_kv for _, r_kv in here):
            tri, fi = here.get(("triton", kv)), here.get(("flashinfer", kv))
            print(f"{d:>4} {f'{b} x {c}':>13} {kv:>9} "
                  f"{fmt(tri and tri['us'], '.1f', 10)} {fmt(fi and fi['us'], '.1f', 9)} "
                  f"{fmt(tri and tri['speedup_vs_own_bf16'], '.2f', 12)} "
                  f"{fmt(tri and tri['speedup_vs_flashinfer_same_kv'], '.2f', 7)} "
                  f"{fmt(fi and fi['speedup_vs_own_bf16'], '.2f', 10)} "
                  f"{fmt(tri and tri['rel_err_vs_bf16_cache'], '.2e', 11)} "
                  f"{fmt(fi and fi['rel_err_vs_bf16_cache'], '.2e', 9)}")  # fmt: skip
    rounds = [r for r in fp8_rows if "speedup_vs_flashinfer_rounds" in r]
    if rounds:
        print("\n# triton / FlashInfer per round (median above; the rounds alternate the order)")
        for r in rounds:
            each = " ".join(f"{x:.3f}" for x in r["speedup_vs_flashinfer_rounds"])
            shape = f"{r['batch']} x {r['context']}"
            print(f"{r['D']:>4} {shape:>13} {r['kv_dtype']:>9} {r['backend']:>7}: {each}")


def parse_kv_dtypes(names: str) -> list[torch.dtype]:
    """ "bf16,fp8_e4m3,fp8_e5m2" -> cache dtypes; bf16/fp16/auto mean the query dtype (--dtype)."""
    out: list[torch.dtype] = []
    for name in (n.strip() for n in names.split(",")):
        dtype = DTYPE if name in ("auto", "bf16", "fp16", "bfloat16", "float16") else None
        dtype = dtype or resolve_kv_cache_dtype(name, DTYPE)
        if dtype not in out:
            out.append(dtype)
    if DTYPE not in out:
        out.insert(0, DTYPE)  # the bf16 cache: the baseline of every speedup and error
    return out


def override_fp8_launches(spec: str) -> dict:
    """Every triton launch on an FP8 cache takes the ``LaunchConfig`` fields of ``spec``
    ("num_stages=2,maxnreg=128"; an experiment before a launch rule changes)."""
    from paged_ops.backends import triton as tb

    changes = tb.parse_launch_overrides(spec)
    pick = tb.launch_config

    def with_changes(**shape):
        cfg = pick(**shape)
        return dataclasses.replace(cfg, **changes) if shape.get("fp8_cache") else cfg

    tb.launch_config = with_changes
    return changes


def main() -> None:
    global DEVICE, DTYPE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer decode shapes")
    parser.add_argument("--prefill-only", action="store_true",
                        help="only the prefill and mixed cases (triton vs FA3 in one short run)")  # fmt: skip
    parser.add_argument("--calls", type=int, default=20, help="op calls per timed region")
    parser.add_argument("--repeats", type=int, default=7, help="timed regions (median)")
    parser.add_argument("--backends", default=None, help="comma list (default: all available)")
    parser.add_argument("--out", default="benchmarks/results/attention.json")
    parser.add_argument("--segments", default=None, help="triton split-KV sweep, e.g. 16,32,64")
    parser.add_argument("--kv-dtypes", default=None,
                        help="cache dtypes of the FP8 rows, e.g. bf16,fp8_e4m3,fp8_e5m2 (an fp8 "
                             "name adds the FP8 section; bf16 is always included as baseline)")  # fmt: skip
    parser.add_argument("--fp8-only", action="store_true",
                        help="only the FP8 section (default --kv-dtypes bf16,fp8_e4m3,fp8_e5m2)")  # fmt: skip
    parser.add_argument("--fp8-shapes", default=FP8_SHAPES, help="FP8 rows: batch x context list")
    parser.add_argument("--fp8-head-dims", default="64,128", help="FP8 rows: head sizes")
    parser.add_argument("--fp8-scales", choices=("head", "layer"), default="head",
                        help="FP8 scales per KV head [Hkv] or one per layer []")  # fmt: skip
    parser.add_argument("--triton-fp8-override", default=None,
                        help="LaunchConfig fields for every triton launch on an FP8 cache, e.g. "
                             "num_stages=2,maxnreg=128 (an experiment, NOTES.md section 10)")  # fmt: skip
    parser.add_argument("--fp8-rounds", type=int, default=1,
                        help="FP8 rows: time every backend x cache dtype this many times, "
                             "alternating the order; rows report the median time and the "
                             "median of the per-round speedups")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cuda; cpu = smoke test (interpreter)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                        help="queries (float16 for CPU smoke tests under the interpreter)")  # fmt: skip
    args = parser.parse_args()
    # FP8 rows on the reference backend (float32 ground truth) only when asked for by name or on
    # CPU: on the GPU they cost time and add no comparison the table shows
    args.fp8_reference = args.device == "cpu" or "reference" in (args.backends or "").split(",")
    DEVICE, DTYPE = args.device, getattr(torch, args.dtype)
    fp8_override = (
        override_fp8_launches(args.triton_fp8_override) if args.triton_fp8_override else {}
    )
    if args.fp8_only and args.kv_dtypes is None:
        args.kv_dtypes = "bf16,fp8_e4m3,fp8_e5m2"
    kv_dtypes = parse_kv_dtypes(args.kv_dtypes) if args.kv_dtypes else [DTYPE]
    run_fp8 = args.fp8_only or any(is_fp8(d) for d in kv_dtypes)
    backends = args.backends.split(",") if args.backends else available_backends()
    device_name = torch.cuda.get_device_name() if DEVICE != "cpu" else "cpu"
    print(f"# {device_name}, torch {torch.__version__}, backends {backends}")
    print(f"# {KV_NAMES[DTYPE]}, Hq={HQ} Hkv={HKV} page={BLOCK}; decode: CUDA-graph replays, "
          f"median of {args.repeats}")  # fmt: skip
    rows, skipped = [], []
    settings = dict(dtype=args.dtype, hq=HQ, hkv=HKV, block_size=BLOCK, calls=args.calls,
                    repeats=args.repeats,
                    kv_dtypes=[KV_NAMES[d] for d in kv_dtypes] if run_fp8 else None,
                    fp8_scales=args.fp8_scales if run_fp8 else None,
                    fp8_rounds=args.fp8_rounds if run_fp8 else None,
                    triton_fp8_override=fp8_override,
                    fp8_kv_data="randn x per-KV-head factor 2**linspace(-1, 1); scale = amax / "
                                "(fp8_max / 2)" if run_fp8 else None)  # fmt: skip

    def save() -> None:  # after every row, so a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump(dict(device=device_name, torch=torch.__version__, settings=settings,
                           rows=rows, skipped=skipped), f, indent=1)  # fmt: skip

    cases = [] if args.fp8_only else decode_cases(args.quick) + prefill_cases()
    if args.prefill_only:
        cases = prefill_cases()
    for case in cases:
        for backend in backends:
            if backend == "reference" and (case["kind"] != "decode" or sum(case["kv"]) > 8 * 4096):
                continue  # the reference backend is a readable ground truth, not a contender
            try:
                r = measure(backend, dict(case), args.calls, args.repeats)
            except Exception as e:  # a backend that cannot serve a case: say so, go on
                error = f"{type(e).__name__}: {e}"[:300]
                skipped.append(dict(backend=backend, kind=case["kind"], D=case["D"], error=error))
                print(f"skip {backend} {case['kind']} D={case['D']}: {error}")
                continue
            rows.append(r)
            save()
            metric = (
                f"{r['kv_tb_per_s']:.2f} TB/s" if r["kind"] == "decode"
                else f"{r['tflop_per_s']:.0f} TFLOP/s"
            )  # fmt: skip
            print(f"{r['kind']:8} D={r['D']:<3} {r['batch']:>4} x {r['context']:<6} "
                  f"{backend:10} {r['us']:9.1f} us  {metric:>14}  "
                  f"(prepare {r['host_prepare_ms']:.2f} ms)")  # fmt: skip
    if args.segments and "triton" in backends and not args.fp8_only:
        rows += segment_sweep([int(n) for n in args.segments.split(",")], args.calls)
    if run_fp8:
        fp8_rows = fp8_suite(fp8_cases(args.fp8_shapes, args.fp8_head_dims), backends, kv_dtypes,
                             args, rows, skipped, save)  # fmt: skip
        print_fp8_table(fp8_rows)
    save()


if __name__ == "__main__":
    main()
