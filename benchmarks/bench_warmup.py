"""Warm-up of paged_ops' LLM on a first start and on later starts, each in a fresh process.

``bench_generate.py --warmup-starts N`` calls :func:`measure_starts`: it runs this file N times as
a child process with ``bench_generate``'s own command line. Each child builds the benchmark's model
and the LLM of its default cases (``make_llm``: same backend, batch bucket, token budget, KV cache)
and reports the LLM's construction time (``warmup_s``, what the issue's "warm-up" means) and its
breakdown (``LLM.warmup_breakdown``), plus the model build and one short ``generate`` after it.
Every child shares one ``PAGED_OPS_CACHE_DIR`` (a new empty temp dir unless
``--warmup-cache-dir``) and gets none of the tools' own cache variables, so the first start
compiles everything (Inductor, Triton, FlashInfer JIT) and later ones only find it on disk:
nothing else carries over between processes.

    python benchmarks/bench_generate.py --systems none --warmup-starts 2 --out warmup.json
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402

MARK = "PAGED_OPS_WARMUP_START "  # the child's result line on stdout
LAUNCH_VAR = "PAGED_OPS_WARMUP_LAUNCHED_AT"  # the parent's time.time() when it started the child
EXIT_MARK = "PAGED_OPS_WARMUP_EXIT "  # the child's atexit hooks: "<stretch name> <seconds>"


def measure_starts(argv: list[str], num_starts: int, cache_dir: str | None = None) -> dict:
    """Run ``num_starts`` children with ``bench_generate``'s ``argv`` sharing one cache dir."""
    from paged_ops.engine.compile_cache import TOOL_DIRS  # each tool's own cache variable

    root = cache_dir or tempfile.mkdtemp(prefix="paged_ops_warmup_")
    env = {k: v for k, v in os.environ.items() if k not in TOOL_DIRS}
    env["PAGED_OPS_CACHE_DIR"] = root
    print(
        f"warm-up starts ({num_starts}, fresh processes, PAGED_OPS_CACHE_DIR={root}):", flush=True
    )
    starts = []
    for i in range(num_starts):
        t0 = time.perf_counter()
        env[LAUNCH_VAR] = repr(time.time())
        proc = subprocess.run(
            [sys.executable, __file__, *argv], env=env, stdout=subprocess.PIPE, text=True
        )
        wall = time.perf_counter() - t0
        lines = [x for x in proc.stdout.splitlines() if x.startswith(MARK)]
        if proc.returncode or not lines:
            tail = proc.stdout.strip().splitlines()[-5:]
            starts.append({"error": f"exit code {proc.returncode}", "stdout_tail": tail})
            print(f"  start {i + 1}: failed ({proc.returncode}): {tail}", flush=True)
            continue
        start = dict(json.loads(lines[-1].removeprefix(MARK)), process_s=wall)
        start["timeline_s"] = timeline(start.pop("marks"), proc.stdout, wall)
        starts.append(start)
        print(f"  start {i + 1}: LLM warm-up {start['breakdown_text']}; "
              f"model {start['model_s']:.1f} s, first generate {start['first_generate_s']:.2f} "
              f"s, process {wall:.1f} s, compile worker pools "
              f"{start['compile_worker_pools']}", flush=True)  # fmt: skip
        parts = ", ".join(f"{k} {v:.1f}" for k, v in start["timeline_s"].items())
        print(f"    process timeline (s): {parts}", flush=True)
    out: dict = {"cache_dir": root, "starts": starts}
    for i, key in enumerate(("warmup_first_start_s", "warmup_second_start_s")):
        out[key] = starts[i].get("warmup_s") if i < len(starts) else None
    shown = [f"{s['warmup_s']:.1f} s" if "warmup_s" in s else "failed" for s in starts]
    print(f"  LLM warm-up per start: {', '.join(shown)}", flush=True)
    return out


def timeline(marks: dict[str, float], stdout: str, wall: float) -> dict[str, float]:
    """Seconds per stretch of a child's life, from its marks (seconds since the parent launched
    it) and the exit marks its ``atexit`` hooks printed: the last stretches are Python's
    shutdown of threads (executors) before the ``atexit`` hooks, the hooks (Inductor's compile
    worker pool), and the rest (module teardown, CUDA context, process exit)."""
    for line in stdout.splitlines():
        if line.startswith(EXIT_MARK):
            name, at = line.removeprefix(EXIT_MARK).rsplit(" ", 1)
            marks[name] = float(at)
    marks["process end"] = wall
    out, last = {}, 0.0
    for name, at in marks.items():
        out[name] = round(at - last, 3)
        last = at
    return out


def compile_worker_pools() -> int:
    """How many pools of compile workers Inductor started in this process (its pool shuts down
    at exit, which waits for workers still booting)."""
    module = sys.modules.get("torch._inductor.async_compile")
    return len(getattr(module, "_pool_set", ())) if module is not None else 0


def compile_phases(top: int = 12) -> dict[str, float]:
    """The slowest of torch.compile's timed phases in this process (seconds, summed per name):
    Dynamo's trace, AOTAutograd, Inductor's lowering and codegen, cache loads, ..."""
    from torch._dynamo.utils import compilation_time_metrics

    totals = {name: round(sum(ts), 3) for name, ts in compilation_time_metrics.items()}
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])[:top])


def child(argv: list[str]) -> None:
    """One start: build the LLM of ``bench_generate``'s default cases, print its warm-up."""
    launched = float(os.environ.get(LAUNCH_VAR, time.time()))
    marks: dict[str, float] = {}  # name of the stretch that ends -> seconds since the launch

    def mark(name: str) -> None:
        marks[name] = time.time() - launched

    def exit_mark(name: str) -> None:
        print(f"{EXIT_MARK}{name} {time.time() - launched:.4f}", flush=True)

    mark("Python start + imports")  # torch, transformers, bench_generate
    atexit.register(exit_mark, "atexit hooks")  # runs last of the hooks
    if torch.cuda.is_available():
        torch.empty(1, device="cuda")  # the context, before the model's first allocation
    mark("CUDA init")
    from paged_ops import SamplingParams
    from paged_ops.engine.compile_cache import compile_cache_status
    from paged_ops.engine.runner import format_breakdown

    mark("paged_ops imports")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("paged_ops").setLevel(logging.INFO)  # the cache dirs and the breakdown
    args = bg.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    cfg = bg.llama_1b_config(args.layers, tiny=args.tiny)
    t0 = time.perf_counter()
    model = bg.build_model(cfg, bg.DEVICE)
    bg.sync()
    model_s = time.perf_counter() - t0
    mark("model")
    llm = bg.make_llm(cfg, batches, args.prompt_len, args.new_tokens, args, args.kv_dtypes[0],
                      model)  # fmt: skip
    mark("LLM(...)")
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ps = bg.prompts(max(batches), args.prompt_len, cfg.vocab_size)
    _, first = bg.timed(lambda: len(llm.generate(ps, params, use_tqdm=False)))
    mark("first generate")
    result = dict(
        warmup_s=llm.warmup_s,
        breakdown=llm.warmup_breakdown,
        breakdown_text=format_breakdown(llm.warmup_breakdown),
        model_s=model_s,
        first_generate_s=first,
        compile_caches=llm.compile_caches,
        cache_status=compile_cache_status(),
        compile_phases_s=compile_phases(),
        backend=llm.pa.layer_backends[0],
        backend_table=llm.pa.backend_table(),
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        compile_worker_pools=compile_worker_pools(),
    )
    mark("report")
    result["marks"] = marks
    print(MARK + json.dumps(result), flush=True)
    atexit.register(exit_mark, "thread shutdown")  # runs first of the hooks, after the threads


if __name__ == "__main__":
    child(sys.argv[1:])
