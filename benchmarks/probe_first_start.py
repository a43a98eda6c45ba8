"""Where an LLM's start goes: ``bench_generate.py``'s LLM (1B shape, random bf16 weights, an LLM
for the largest of ``--batches``, the bench's settings plus ``--llm``) is built once, with every
in-process Triton JIT compile of a ``@triton.jit`` kernel timed by kernel and by the warm-up step
it happened in (a compile that Triton's on-disk cache serves takes milliseconds), and each warm-up
step's wall time (its ``(T, S)``, whether it was a graph capture). Then, on a GPU, one prompt step
of ``--profile-prompts`` new prompts is profiled (its kernels by name, torch.profiler).

Run it with an empty ``PAGED_OPS_CACHE_DIR`` for a first start: the kernels that compile in the
warm-up's steps after the first (``more shapes``) are the ones the child prebuild
(``paged_ops.engine.variant_prebuild``) does not build beside the compile.

    PAGED_OPS_CACHE_DIR=$(mktemp -d) python benchmarks/probe_first_start.py --llm fold_conds=False \\
        --out results/first_start.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402


class StartRecorder:
    """Times Triton's JIT compiles (``JITFunction._do_compile``) and the runner's forward calls
    (``ModelRunner._call``) while installed; ``step`` names the warm-up step being run."""

    def __init__(self) -> None:
        self.compiles: list[dict[str, Any]] = []  # kernel, seconds, step
        self.steps: list[dict[str, Any]] = []  # step "T/S", seconds, capturing
        self.step = "setup"
        self._undo: list[tuple[object, str, object]] = []
        self.profile_steps: set[str] = set()  # "T/S" labels whose first run goes under cProfile
        self.step_profiles: dict[str, list[dict[str, Any]]] = {}  # label -> top functions

    def install(self) -> None:
        from paged_ops.engine.runner import ModelRunner

        try:
            from triton.runtime.jit import JITFunction
        except ImportError:  # CPU without triton: steps only
            JITFunction = None  # noqa: N806
        recorder = self
        if JITFunction is not None:
            do_compile = JITFunction._do_compile

            def timed_compile(fn, *args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return do_compile(fn, *args, **kwargs)
                finally:
                    recorder.compiles.append(
                        dict(kernel=fn.fn.__name__, s=time.perf_counter() - t0, step=recorder.step)
                    )

            self._patch(JITFunction, "_do_compile", timed_compile)
        call = ModelRunner._call

        def timed_call(runner, num_tokens, logit_rows=None):
            recorder.step = f"{num_tokens}/{runner.pa.metadata.seq_lens.shape[0]}"
            cuda = runner.device.type == "cuda"
            capturing = cuda and torch.cuda.is_current_stream_capturing()
            if cuda and not capturing:  # (no sync inside a capture: it would invalidate it)
                torch.cuda.synchronize()
            profiled = recorder.step in recorder.profile_steps - set(recorder.step_profiles)
            profiler = cProfile.Profile() if profiled and not capturing else None
            t0 = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            out = call(runner, num_tokens, logit_rows)
            if cuda and not capturing:
                torch.cuda.synchronize()
            if profiler is not None:
                profiler.disable()
                recorder.step_profiles[recorder.step] = top_functions(profiler)
            recorder.steps.append(
                dict(step=recorder.step, s=time.perf_counter() - t0, capturing=capturing)
            )
            return out

        self._patch(ModelRunner, "_call", timed_call)

    def _patch(self, owner: object, name: str, value: object) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def uninstall(self) -> None:
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        self._undo.clear()

    def by_kernel(self) -> dict[str, dict[str, float]]:
        """Compiles per kernel: count and seconds, most seconds first."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: dict(count=0, s=0.0))
        for c in self.compiles:
            out[c["kernel"]]["count"] += 1
            out[c["kernel"]]["s"] += c["s"]
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["s"]))

    def compile_s_by_step(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for c in self.compiles:
            out[c["step"]] += c["s"]
        return dict(out)


def top_functions(profiler: cProfile.Profile, count: int = 30) -> list[dict[str, Any]]:
    """The ``count`` functions with the most cumulative time in ``profiler``'s run:
    ``{"function", "cum_s", "own_s", "calls"}``."""
    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(dict(function=f"{Path(file).name}:{line}({name})", cum_s=round(cum, 4),
                         own_s=round(own, 4), calls=calls))  # fmt: skip
    return sorted(rows, key=lambda r: -r["cum_s"])[:count]


def prompt_step_kernels(llm, cfg, prompts: int, prompt_len: int) -> dict[str, Any]:
    """One step of ``prompts`` new prompts (one token each) under torch.profiler: its kernels by
    name (CUDA only; two warm steps with other prompts first)."""
    from torch.profiler import ProfilerActivity, profile

    from paged_ops import SamplingParams

    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    for variant in (5, 6):
        llm.generate(bg.prompts(prompts, prompt_len, cfg.vocab_size, variant=variant), one,
                     use_tqdm=False)  # fmt: skip
    torch.cuda.synchronize()
    ps = bg.prompts(prompts, prompt_len, cfg.vocab_size, variant=7)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(ps, one, use_tqdm=False)
        torch.cuda.synchronize()
    kernels: dict[str, dict[str, float]] = defaultdict(lambda: dict(count=0, ms=0.0))
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name]["count"] += 1
            kernels[e.name]["ms"] += e.device_time_total / 1e3
    ordered = dict(sorted(kernels.items(), key=lambda kv: -kv[1]["ms"]))
    return dict(tokens=prompts * prompt_len, kernel_ms=sum(k["ms"] for k in ordered.values()),
                kernels=ordered)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llm", default="", help='more LLM keywords, "fold_conds=False,..."')
    parser.add_argument("--batches", default="1,64,256", help="the LLM is sized for the largest")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--profile-prompts", type=int, default=32,
                        help="GPU: profile one step of this many new prompts (0: none)")  # fmt: skip
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile + CUDA graphs (as bench_generate.py)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    parser.add_argument(
        "--profile-steps",
        default="",
        help='warm-up steps "T/S,..." whose first run goes under cProfile',
    )
    parser.add_argument("--out", default=None)
    own = parser.parse_args()
    argv = ["--systems", "paged_ops", "--backend", own.backend, "--batches", own.batches,
            "--llm", own.llm, "--compile" if own.compile else "--no-compile"]  # fmt: skip
    args = bg.parse_args(argv + (["--tiny"] if own.tiny else []))
    batches = [int(b) for b in own.batches.split(",")]
    cfg = bg.llama_1b_config(args.layers, tiny=own.tiny, head_dim=args.head_dim)
    model = bg.build_model(cfg, bg.DEVICE)
    recorder = StartRecorder()
    recorder.profile_steps = {st for st in own.profile_steps.split(",") if st}
    recorder.install()
    try:
        t0 = time.perf_counter()
        llm = bg.make_llm(cfg, batches, own.prompt_len, args.new_tokens, args, model=model)
        total = time.perf_counter() - t0
    finally:
        recorder.uninstall()
    from paged_ops.engine.runner import format_breakdown

    print(f"LLM ready in {total:.1f} s; {format_breakdown(llm.warmup_breakdown)}")
    print("in-process Triton JIT compiles (count, s) by kernel:")
    for name, k in recorder.by_kernel().items():
        print(f"  {name:40s} {k['count']:4d} {k['s']:7.2f}")
    per_step = recorder.compile_s_by_step()
    print("warm-up steps T/S: wall s (of which Triton compiles)")
    for st in recorder.steps:
        mark = "  (capture)" if st["capturing"] else ""
        print(f"  {st['step']:12s} {st['s']:7.3f} ({per_step.get(st['step'], 0.0):.2f}){mark}")
    for label, rows in recorder.step_profiles.items():
        print(f"step {label} under cProfile, by cumulative time:")
        for r in rows:
            print(
                f"  {r['cum_s']:8.3f} s cum {r['own_s']:8.3f} s own {r['calls']:7d}  {r['function']}"
            )
    result: dict[str, Any] = dict(
        settings=dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                      torch=torch.__version__, batches=batches, llm_kwargs=args.llm,
                      host_probe_ms=bg.host_probe_ms()),
        ready_s=total, warmup_breakdown=llm.warmup_breakdown, compiles=recorder.compiles,
        compiles_by_kernel=recorder.by_kernel(), steps=recorder.steps,
        step_profiles=recorder.step_profiles,
    )  # fmt: skip
    if bg.DEVICE.type == "cuda" and own.profile_prompts:
        step = prompt_step_kernels(llm, cfg, own.profile_prompts, own.prompt_len)
        result["prompt_step"] = step
        print(f"a {step['tokens']}-token prompt step: {step['kernel_ms']:.2f} ms of kernels")
        for name, k in list(step["kernels"].items())[:25]:
            print(f"  {k['ms']:8.3f} ms {k['count']:5d}  {name[:110]}")
    if own.out:
        Path(own.out).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
