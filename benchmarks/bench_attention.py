"""Paged attention, every backend side by side in one run: decode KV-read bandwidth, prefill FLOP/s.

Each backend is driven the same way, as a model would drive it: a ``PagedAttention`` built with
``backend=name`` (which creates FlashInfer's planners), ``prepare_slices`` to build the step's metadata
and plan, then the ``paged_ops::paged_attention`` op on each layer's cache. Decode steps are timed as
CUDA-graph replays (as the engine serves them); prefill and mixed steps eagerly (they are not
captured). Small shapes cycle over several layers' caches so the KV read does not come from L2.

    python benchmarks/bench_attention.py [--quick] [--out benchmarks/results/attention.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from paged_ops import PagedAttention, SequenceSlice, available_backends, blocks_needed

HQ, HKV, BLOCK = 32, 8, 16
DEVICE = "cuda"
L2_BYTES = 60 * 2**20  # H200; an H100 has 50 MiB


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


def build(backend: str, case: dict, num_layers: int) -> tuple[PagedAttention, torch.Tensor]:
    """A PagedAttention holding the case's sequences in shuffled blocks; returns it and a query."""
    need = [blocks_needed(n, BLOCK) for n in case["kv"]]
    pa = PagedAttention(
        num_layers=num_layers, num_q_heads=HQ, num_kv_heads=HKV, head_dim=case["D"],
        block_size=BLOCK, num_blocks=sum(need), max_num_seqs=len(need),
        max_num_tokens=sum(case["q"]), max_model_len=max(case["kv"]), dtype=torch.bfloat16,
        device=DEVICE, backend=backend,
    )  # fmt: skip
    pa.kv_cache.data.normal_()  # never time on zeros
    perm = torch.randperm(sum(need)).tolist()
    slices, start = [], 0
    for q_len, kv_len, n in zip(case["q"], case["kv"], need, strict=True):
        slices.append(SequenceSlice(perm[start : start + n], kv_len - q_len, q_len))
        start += n
    pa.prepare_slices(slices)  # the first plan JIT-compiles FlashInfer's kernels: not timed
    t0 = time.perf_counter()
    for _ in range(3):
        pa.prepare_slices(slices)
    case["host_prepare_ms"] = (time.perf_counter() - t0) / 3 * 1e3
    query = torch.randn(sum(case["q"]), HQ, case["D"], device=DEVICE, dtype=torch.bfloat16)
    return pa, query


def attention_calls(pa: PagedAttention, query: torch.Tensor, calls: int):
    md, layers = pa.metadata, pa.kv_cache.layers
    scale = query.shape[-1] ** -0.5

    def run() -> None:
        for i in range(calls):
            torch.ops.paged_ops.paged_attention.default(
                query, layers[i % len(layers)], md.cu_seqlens_q, md.seq_lens, md.block_table,
                scale, True, 0, 0.0, None, None, None, None, pa.layer_backends[0],
                pa.layer_plan_handles[0],
            )  # fmt: skip

    return run


def median_seconds(run, calls: int, graph: bool, repeats: int = 7) -> float:
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


def measure(backend: str, case: dict, calls: int) -> dict:
    d = case["D"]
    kv_bytes = sum(case["kv"]) * 2 * HKV * d * 2  # K and V, bf16, each read once
    layers = max(1, min(64, -(-4 * L2_BYTES // kv_bytes)))
    pa, query = build(backend, case, layers)
    graph = case["kind"] == "decode" and backend != "reference"
    sec = median_seconds(attention_calls(pa, query, calls), calls, graph)
    flops = sum(
        4 * HQ * d * sum(min(kv - q + i + 1, kv) for i in range(q))
        for q, kv in zip(case["q"], case["kv"], strict=True)
    )
    row = dict(
        backend=backend, kind=case["kind"], D=d, batch=len(case["q"]), context=max(case["kv"]),
        tokens=sum(case["q"]), us=sec * 1e6, kv_tb_per_s=kv_bytes / sec / 1e12,
        tflop_per_s=flops / sec / 1e12, timed_as="cuda_graph" if graph else "eager",
        host_prepare_ms=case["host_prepare_ms"],
    )  # fmt: skip
    del pa, query
    torch.cuda.empty_cache()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer decode shapes")
    parser.add_argument("--calls", type=int, default=20, help="op calls per timed region")
    parser.add_argument("--backends", default=None, help="comma list (default: all available)")
    parser.add_argument("--out", default="benchmarks/results/attention.json")
    parser.add_argument("--segments", default=None, help="triton split-KV sweep, e.g. 16,32,64")
    args = parser.parse_args()
    backends = args.backends.split(",") if args.backends else available_backends()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, backends {backends}")
    print(f"# bf16, Hq={HQ} Hkv={HKV} page={BLOCK}; decode: CUDA-graph replays, median of 7")
    rows, skipped = [], []

    def save() -> None:  # after every row, so a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           rows=rows, skipped=skipped), f, indent=1)  # fmt: skip

    cases = decode_cases(args.quick) + prefill_cases()
    for case in cases:
        for backend in backends:
            if backend == "reference" and (case["kind"] != "decode" or sum(case["kv"]) > 8 * 4096):
                continue  # the reference backend is a readable ground truth, not a contender
            try:
                r = measure(backend, dict(case), args.calls)
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
    if args.segments and "triton" in backends:
        rows += segment_sweep([int(n) for n in args.segments.split(",")], args.calls)
    save()


if __name__ == "__main__":
    main()
