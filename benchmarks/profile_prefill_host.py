"""Where a batch-1 prefill step's host time goes: the ``bench_generate.py`` LLM (1B shape, random
bf16 weights, an LLM for 256 sequences, the bench's settings plus ``--llm``) serves one new
128-token prompt (no prefix cache hit) for one token, many times; reports the wall time per call, the GPU's kernel time in one
call (torch.profiler: how host-bound the step is) and a cProfile of the calls grouped by where
the Python time is spent (paged_ops, Inductor's generated code, triton, torch) with the top
functions.

    python benchmarks/profile_prefill_host.py --llm fold_conds=False --out results/x.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402


def area(filename: str) -> str:
    """The part of the stack a cProfile entry's file belongs to."""
    for marker, name in (
        ("paged_ops/engine", "paged_ops.engine"),
        ("paged_ops/backends", "paged_ops.backends"),
        ("paged_ops", "paged_ops (ops)"),
        ("torchinductor", "inductor generated code"),
        ("_inductor", "torch._inductor runtime"),
        ("_dynamo", "torch._dynamo (guards, eval frame)"),
        ("triton", "triton"),
        ("transformers", "transformers"),
        ("torch", "torch (other)"),
    ):
        if marker in filename:
            return name
    return "built-ins / other" if filename.startswith("~") else "other python"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llm", default="")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--tiny", action="store_true", help="a tiny eager model (CPU smoke test)")
    parser.add_argument("--ab-launcher", action="store_true",
                        help="alternate calls with paged_ops' Launcher on and off (the "
                             "triton_launch.ENABLED switch) and report both")  # fmt: skip
    parser.add_argument("--out", default=None)
    own = parser.parse_args()
    argv = ["--backend", own.backend, "--llm", own.llm] + (["--no-compile"] if own.tiny else [])
    args = bg.parse_args(argv)
    from paged_ops import SamplingParams
    from paged_ops.backends import triton_launch

    cfg = bg.llama_1b_config(16, tiny=own.tiny)
    llm = bg.make_llm(cfg, [1, 64, 256], own.prompt_len, 256, args)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    calls = iter(range(10**6))

    def call(_: int) -> None:  # a new prompt every call: no prefix cache hit, a whole prefill
        prompt = bg.prompts(1, own.prompt_len, cfg.vocab_size, variant=100 + next(calls))[0]
        llm.generate([prompt], params, use_tqdm=False)

    for i in range(10):
        call(i)
    bg.sync()

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    walls, ttfts = [], []
    ab: dict[bool, list[float]] = {True: [], False: []}
    for i in range(own.calls * (2 if own.ab_launcher else 1)):
        on = triton_launch.ENABLED = not own.ab_launcher or i % 2 == 0
        t = time.perf_counter()
        call(i)
        bg.sync()
        ms = (time.perf_counter() - t) * 1e3
        ab[on].append(ms)
        walls.append(ms)
        ttfts.append(llm.last_metrics.mean_time_to_first_token_s * 1e3)
    triton_launch.ENABLED = True
    wall, ttft = median(walls), median(ttfts)
    if own.ab_launcher:
        print(f"--llm {own.llm or '(none)'}: host probe {bg.host_probe_ms():.1f} ms; wall per "
              f"call, alternating calls: Launcher {median(ab[True]):.2f} ms, Triton's own launch "
              f"{median(ab[False]):.2f} ms (medians of {own.calls})", flush=True)  # fmt: skip

    from torch.profiler import ProfilerActivity, profile

    on_cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]) as prof:
        call(0)
        bg.sync()
    kernel_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3

    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(own.calls):
        call(i)
    bg.sync()
    profiler.disable()
    stats = pstats.Stats(profiler)
    by_area: Counter = Counter()
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
        by_area[area(filename)] += tottime
    total = sum(by_area.values())
    print(f"--llm {own.llm or '(none)'}: host probe {bg.host_probe_ms():.1f} ms; wall "
          f"{wall:.2f} ms per call (median of {own.calls}), TTFT {ttft:.2f} ms, GPU kernels "
          f"{kernel_ms:.2f} ms per call", flush=True)  # fmt: skip
    print("cProfile self time by area (profiled, so inflated; the shares are what count):")
    for name, t in by_area.most_common():
        print(f"  {name:38s} {t / own.calls * 1e3:8.2f} ms/call  {t / total:6.1%}")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(45)
    print(text.getvalue())
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
    print(text.getvalue())
    if own.out:
        with open(own.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if on_cuda else "cpu", llm=own.llm, wall_ms=wall,
                           ab_launcher_ms={"on": median(ab[True]), "off": median(ab[False])}
                           if own.ab_launcher else None,
                           ttft_ms=ttft, kernel_ms=kernel_ms,
                           area_ms={k: v / own.calls * 1e3 for k, v in by_area.items()}),
                      f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
