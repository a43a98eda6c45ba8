"""Where a decode step's GPU time goes, by op class: matmuls, attention, KV write, fused pointwise.

Builds the ``bench_generate.py`` model (Llama-3.2-1B shape, random bf16 weights), serves a batch of
128-token prompts with ``LLM.generate`` under ``torch.profiler`` and sums each CUDA kernel's time
into a class by its name. Prints a table per batch size and writes JSON:

    python benchmarks/profile_decode.py --batches 1,8 --out benchmarks/results/profile_decode.json

Kernel time per step = class total / number of steps of the profiled call (prefill steps included:
with 128-token prompts and a 4096-token step budget, 8 of the 72 steps at 256 requests).
``--graph-replays N`` also profiles N replays of the batch's decode CUDA graph alone: the kernels
of a pure decode step. The top kernels of each class are printed (the JSON lists them all), so a
new kernel name that falls into "other" shows up.

    python benchmarks/profile_decode.py --batches 1,64,256 --graph-replays 20

``--timeline`` also reads the profiled call's kernels as a timeline: how long the GPU sat idle
between kernels (the union of kernel intervals against the call's span), the gaps by size, and
the largest gaps with the kernels on either side (is the device waiting for the host, and where):

    python benchmarks/profile_decode.py --batches 256 --new-tokens 256 --timeline
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402

# (class, substrings of a kernel name), first match wins
OP_CLASSES = (
    ("inductor_fused", ("triton_poi", "triton_red", "triton_per")),  # names list the fused ops
    ("kv_write", ("write_kv", "append_paged_kv", "scatter_kv")),
    ("attention", ("paged_attention", "prefill_attention", "reduce_segments", "BatchDecode", "BatchPrefill",
                   "flashinfer", "MergeStates", "PersistentVariableLength")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitK", "gemv", "small_linear",
                "linear_kernel")),
    ("collective", ("nccl", "AllReduce", "AllGather", "Broadcast", "all_reduce", "all_gather")),
    ("copy_fill", ("Memcpy", "Memset", "memcpy", "memset", "copy", "fill", "elementwise")),
)  # fmt: skip


def op_class(name: str) -> str:
    for cls, keys in OP_CLASSES:
        if any(k in name for k in keys):
            return cls
    return "other"


def profile_batch(llm, cfg, b: int, prompt_len: int, new_tokens: int, replays: int = 0,
                  timeline: bool = False) -> dict:  # fmt: skip
    from torch.profiler import ProfilerActivity, profile

    from paged_ops import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    llm.generate(bg.prompts(b, prompt_len, cfg.vocab_size, variant=5), params, use_tqdm=False)
    bg.sync()
    t0 = time.perf_counter()
    llm.generate(bg.prompts(b, prompt_len, cfg.vocab_size, variant=6), params, use_tqdm=False)
    bg.sync()
    wall = time.perf_counter() - t0
    cuda = torch.cuda.is_available()
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU  # CPU: a smoke test
    with profile(activities=[activity]) as prof:
        llm.generate(bg.prompts(b, prompt_len, cfg.vocab_size, variant=7), params, use_tqdm=False)
        bg.sync()
    steps = llm.last_metrics.num_steps
    row = dict(batch=b, steps=steps, wall_ms_per_step=wall / steps * 1e3,
               tok_s=b * new_tokens / wall)  # fmt: skip
    print(f"\n--- b={b}: {steps} steps, {wall / steps * 1e3:.3f} ms/step wall "
          f"({row['tok_s']:,.0f} tok/s) ---")  # fmt: skip
    row |= kernel_table(prof, steps, cuda)
    if timeline:
        row["timeline"] = gap_table(prof, steps)
    runner = llm.runner
    if replays and runner.use_graphs and b <= runner.buckets[-1]:
        # decode steps alone (prefill steps do not mix into the figures): the batch's graph
        # replayed on a prepared full step, every sequence at the run's final length with blocks
        # of its own (the metadata a run leaves is not one: section 21 of NOTES.md)
        bucket = next(x for x in runner.buckets if x >= b)
        graph = runner._graphs[bucket][0]
        blocks = full_decode_step(llm.pa, bucket, prompt_len + new_tokens)
        graph.replay()
        bg.sync()
        with profile(activities=[activity]) as prof:
            for _ in range(replays):
                graph.replay()
            bg.sync()
        print(f"  decode graph of bucket {bucket} alone, {replays} replays, "
              f"{bucket} sequences at {prompt_len + new_tokens} tokens:")  # fmt: skip
        row["decode_graph"] = dict(bucket=bucket, replays=replays,
                                   context=prompt_len + new_tokens,
                                   **kernel_table(prof, replays, cuda))  # fmt: skip
        if cuda:
            row["decode_graph"]["sequence"] = replay_sequence(prof, replays)
        llm.pa.allocator.free(blocks)
    return row


def full_decode_step(pa, num_seqs: int, length: int) -> list[int]:
    """Prepare a decode step of ``num_seqs`` sequences, each at ``length`` tokens with blocks of
    its own (allocated: free them after); returns the blocks."""
    from paged_ops.metadata import SequenceSlice

    per_seq = -(-length // pa.block_size)
    blocks = pa.allocator.allocate(num_seqs * per_seq)
    slices = [SequenceSlice(blocks[i * per_seq : (i + 1) * per_seq], length - 1, 1)
              for i in range(num_seqs)]  # fmt: skip
    pa.prepare_slices(slices, num_tokens=num_seqs, num_seqs=num_seqs)
    return blocks


def kernel_table(prof, steps: int, cuda: bool) -> dict:
    """Kernel time per step by class from a profile of ``steps`` steps; printed and returned."""
    per_class: dict[str, float] = defaultdict(float)
    kernels: dict[str, list] = defaultdict(list)
    for evt in prof.key_averages():
        us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        if us <= 0:
            continue
        cls = op_class(evt.key)
        per_class[cls] += us / steps
        kernels[cls].append((us / steps, evt.count / steps, evt.key[:90]))
    total = sum(per_class.values())
    print(f"  kernels {total:.1f} us/step")
    for cls, us in sorted(per_class.items(), key=lambda kv: -kv[1]):
        print(f"  {cls:15s} {us:8.1f} us/step  {100 * us / total:5.1f}%")
        for u, c, n in sorted(kernels[cls], reverse=True)[:4]:
            print(f"      {u:7.1f} us  x{c:5.1f}  {n}")
    return dict(kernel_us_per_step=total,
                classes={k: round(v, 2) for k, v in sorted(per_class.items())},
                top_kernels={k: [dict(us_per_step=round(u, 2), calls_per_step=round(c, 2), name=n)
                                 for u, c, n in sorted(v, reverse=True)]
                             for k, v in kernels.items()})  # fmt: skip


def replay_sequence(prof, replays: int) -> list[dict]:
    """One graph replay's kernels in launch order (printed and returned): for each position the
    median duration and the median idle time before it over ``replays`` profiled replays."""
    spans = kernel_intervals(prof)
    per = len(spans) // max(replays, 1)
    if not per or per * replays != len(spans):
        print(f"  sequence: {len(spans)} kernels over {replays} replays do not split evenly")
        return []
    rows = []
    for i in range(per):
        durs = sorted(spans[r * per + i][1] - spans[r * per + i][0] for r in range(replays))
        gaps = sorted(spans[r * per + i][0] - spans[r * per + i - 1][1] if i else 0
                      for r in range(replays))  # fmt: skip
        rows.append(dict(name=spans[i][2][:80], us=durs[replays // 2] / 1e3,
                         gap_us=max(gaps[replays // 2], 0) / 1e3))  # fmt: skip
    total, idle = sum(r["us"] for r in rows), sum(r["gap_us"] for r in rows)
    print(f"  one replay in order: {per} kernels, {total:.1f} us busy, {idle:.1f} us between them")
    for i, r in enumerate(rows):
        print(f"    {i:4d} {r['us']:7.2f} us  gap {r['gap_us']:5.2f}  {r['name'][:70]}")
    return rows


GAP_BINS_US = (2, 10, 50, 200, 1000)  # gap size classes: < 2 us, 2-10, ..., >= 1000


def kernel_intervals(prof) -> list[tuple[int, int, str]]:
    """``(start_ns, end_ns, name)`` of every device kernel/memcpy/memset in ``prof``, by start."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == DeviceType.CUDA and e.duration_ns() > 0:
            out.append((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()))
    return sorted(out)


def gap_table(prof, steps: int, top: int = 12) -> dict:
    """Idle time of the device between kernels over the profiled call (printed and returned):
    busy = the union of kernel intervals, idle = span - busy, gaps binned by size, and the
    ``top`` largest gaps with the kernel before and after each."""
    spans = kernel_intervals(prof)
    if not spans:
        return {}
    busy, gaps, end, last = 0, [], spans[0][0], spans[0][2]
    for start, stop, name in spans:
        if start > end:
            gaps.append((start - end, last, name))
        if stop > end:
            busy += stop - max(start, end)
            end, last = stop, name
    span = end - spans[0][0]
    bins = dict.fromkeys([f"<{GAP_BINS_US[0]}us"] + [f">={b}us" for b in GAP_BINS_US], (0, 0.0))
    for ns, _, _ in gaps:
        us = ns / 1e3
        label = f"<{GAP_BINS_US[0]}us"
        for b in GAP_BINS_US:
            if us >= b:
                label = f">={b}us"
        n, total = bins[label]
        bins[label] = (n + 1, total + us)
    print(f"  timeline: span {span / 1e6:.2f} ms, kernels busy {busy / 1e6:.2f} ms, idle "
          f"{(span - busy) / 1e6:.2f} ms ({100 * (span - busy) / span:.1f}%), "
          f"{(span - busy) / 1e3 / steps:.1f} us idle per step")  # fmt: skip
    for label, (n, total) in bins.items():
        print(f"    gaps {label:>8s}: {n:7d}, {total / steps:8.1f} us per step")
    deciles = {}  # per tenth of the span: calls and mean us per call of each class
    for start, stop, name in spans:
        cls = op_class(name)
        tenth = min(9, (start - spans[0][0]) * 10 // max(span, 1))
        n, total = deciles.setdefault(cls, [[0, 0.0] for _ in range(10)])[tenth]
        deciles[cls][tenth] = [n + 1, total + (stop - start) / 1e3]
    for cls in ("attention", "matmul", "inductor_fused"):
        if cls in deciles:
            cells = " ".join(f"{t / max(n, 1):6.1f}x{n:<5d}" for n, t in deciles[cls])
            print(f"    {cls:15s} us per call x calls, by tenth of the span: {cells}")
    largest = sorted(gaps, reverse=True)[:top]
    for ns, before, after in largest:
        print(f"    {ns / 1e3:9.1f} us after {before[:60]!r} before {after[:60]!r}")
    return dict(span_ms=span / 1e6, busy_ms=busy / 1e6, idle_ms=(span - busy) / 1e6,
                idle_us_per_step=(span - busy) / 1e3 / steps,
                gap_bins={k: dict(count=n, us_per_step=round(t / steps, 2))
                          for k, (n, t) in bins.items()},
                largest=[dict(us=round(ns / 1e3, 1), before=b[:120], after=a[:120])
                         for ns, b, a in largest],
                by_tenth={cls: [dict(calls=n, us_per_call=round(t / max(n, 1), 2)) for n, t in cells]
                          for cls, cells in deciles.items()})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--max-model-len", type=int, default=400,
                        help="as bench_generate's 128 + 256 + 16")  # fmt: skip
    parser.add_argument("--graph-replays", type=int, default=0,
                        help="also profile this many replays of the batch's decode graph alone "
                             "(decode steps without the prefill steps)")  # fmt: skip
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="the device's idle time between kernels, gaps by size, the largest",
    )
    parser.add_argument("--llm", default="", help='more LLM keywords, "compile_regions=True,..."')
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import compare_engines

    llm_kwargs = compare_engines.llm_keywords(args.llm)

    from paged_ops import LLM

    cfg = bg.llama_1b_config(args.layers, tiny=args.tiny)
    batches = [int(x) for x in args.batches.split(",")]
    on_cuda = bg.DEVICE.type == "cuda"
    model = bg.build_model(cfg, bg.DEVICE)
    t0 = time.perf_counter()
    llm = LLM(model, backend=args.backend, max_num_seqs=max(2, *batches),
              max_model_len=args.max_model_len, max_num_tokens=4096,
              num_blocks=2 * max(batches) * -(-args.max_model_len // 16) + 8,
              compile=on_cuda, cuda_graphs=on_cuda, **llm_kwargs)  # fmt: skip
    print(f"LLM ready in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = [profile_batch(llm, cfg, b, args.prompt_len, args.new_tokens, args.graph_replays,
                          args.timeline) for b in batches]  # fmt: skip
    result = dict(device=torch.cuda.get_device_name() if on_cuda else platform.processor(),
                  torch=torch.__version__, backend=args.backend, layers=args.layers,
                  prompt_len=args.prompt_len, new_tokens=args.new_tokens, llm_kwargs=llm_kwargs,
                  rows=rows)  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
