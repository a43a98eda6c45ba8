"""Where a speculative LLM's step time goes: host phases and device time, verify vs plain steps.

Serves one system of ``bench_speculative.py`` (default ``ngram-copy``: the copy target, whose n-gram
drafts are right unless the prompt was corrupted there) at each batch size and splits, per step
kind (a *verify* step checks drafts, a *plain* step decodes or prefills):

- device ms per step: CUDA events around each launch (the target's forward, sampling or
  verification, and a draft model's proposals). The first event is recorded before the launch's
  host work, so for a step that nothing ran ahead of (every verify step) the span includes that
  host work while the GPU waits; ``--kernels`` gives the kernels' own time;
- host ms per step of each phase: ``plan`` (who drafts; n-gram lookups), ``schedule`` /
  ``schedule_ahead``, ``fill`` (the drafts into the step; a draft model's proposal loop, which
  reads its drafts back), ``execute`` (metadata, graph replay or compiled call of the target),
  ``sample`` / ``verify`` (sampling, or the verdicts on the device), ``read_wait`` (the step's
  one host sync), ``resolve`` (verdicts), ``postprocess``.

A verify step is never overlapped, so its host phases add to the wall time; a plain step's mostly
hide behind the device (then ``read_wait`` is the device time not covered). This is the
measurement NOTES.md section 14 asks for before changing the verify path.

    python benchmarks/profile_verify.py --out benchmarks/results/profile_verify_h100.json
    python benchmarks/profile_verify.py --system draft-2layer --batches 1
    python benchmarks/profile_verify.py --batches 8 --kernels 25   # + the ops of most device time
    python benchmarks/profile_verify.py --tiny --new-tokens 32     # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402
import bench_speculative as bs  # noqa: E402
import profile_host as ph  # noqa: E402

from paged_ops import LLM, SamplingParams  # noqa: E402

# (phase, module, class or None for a module-level function, attribute)
PHASES = (
    ("plan", "paged_ops.engine.speculator", "Speculator", "plan"),
    ("schedule", "paged_ops.engine.scheduler", "Scheduler", "schedule"),
    ("schedule_ahead", "paged_ops.engine.scheduler", "Scheduler", "schedule_ahead"),
    ("launch", "paged_ops.engine.llm", "LLM", "_launch"),
    ("fill", "paged_ops.engine.speculator", "Speculator", "fill"),
    ("execute", "paged_ops.engine.runner", "ModelRunner", "execute"),
    ("sample", "paged_ops.engine.llm", None, "sample_step"),
    ("verify", "paged_ops.engine.llm", None, "verify"),
    ("read_wait", "paged_ops.engine.llm", "_Launched", "read"),
    ("resolve", "paged_ops.engine.speculator", "Speculator", "resolve"),
    ("postprocess", "paged_ops.engine.scheduler", "Scheduler", "postprocess"),
    ("postprocessed", "paged_ops.engine.speculator", "Speculator", "postprocessed"),
)
VERIFY_ONLY = {"fill", "verify", "resolve", "postprocessed"}
BATCH_ARG = {"launch": 1, "execute": 1, "postprocess": 1}  # where the phase's ScheduledBatch is


class Recorder:
    """Host seconds per (kind, phase), step counts per kind and CUDA events of every launch."""

    def __init__(self) -> None:
        self.host: dict[str, Counter] = defaultdict(Counter)
        self.steps: Counter = Counter()
        self.events: list[tuple[str, Any, Any]] = []
        self.target_runner: Any = None

    def clear(self) -> None:
        self.host.clear()
        self.steps.clear()
        self.events.clear()

    def kind(self, phase: str, args: tuple, result: Any) -> str:
        """The step kind a phase call belongs to (from its batch, its result or its phase)."""
        if phase in VERIFY_ONLY:
            return "verify"
        if phase == "plan":
            return "verify" if result else "plain"
        if phase == "execute" and args[0] is not self.target_runner:
            return "draft_model"  # a draft model's runner (inside fill)
        if phase == "sample":
            return "plain"
        if phase in ("schedule", "schedule_ahead"):
            batch = result  # None: nothing scheduled ahead
        elif phase == "read_wait":
            batch = args[0].batch
        else:
            batch = args[BATCH_ARG[phase]]
        return "verify" if batch is not None and batch.is_verify else "plain"

    def device_ms(self) -> dict[str, float]:
        if not self.events:
            return {}
        torch.cuda.synchronize()
        out: Counter = Counter()
        for kind, e0, e1 in self.events:
            out[kind] += e0.elapsed_time(e1)
        return dict(out)


def instrument(rec: Recorder) -> None:
    """Wrap each phase so that its wall time adds up in ``rec``; launches get CUDA events."""

    def around(phase, inner, args, kwargs):
        events = None
        if phase == "launch" and torch.cuda.is_available():
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        t0 = time.perf_counter()
        result = inner(*args, **kwargs)
        dt = time.perf_counter() - t0
        kind = rec.kind(phase, args, result)
        rec.host[kind][phase] += dt
        if phase == "launch":
            rec.steps[kind] += 1
            if events is not None:
                events[1].record()
                rec.events.append((kind, *events))
        return result

    ph.wrap_phases(PHASES, around)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", default="ngram-copy",
                   help="a speculative system of bench_speculative.py")  # fmt: skip
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeat-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--num-tokens", type=int, default=4)
    p.add_argument("--corrupt", type=float, default=0.05, help="copy target: corrupted fraction")
    p.add_argument("--backend", default="triton")
    p.add_argument("--kernels", type=int, default=0,
                   help="also list the N ops of most device time in one more call (torch.profiler)")  # fmt: skip
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    cfg = bg.llama_1b_config(num_layers=2 if args.tiny else 16, tiny=args.tiny)
    on_cuda = bg.DEVICE.type == "cuda"
    span = args.new_tokens + 64
    copying = "-copy" in args.system
    target, table = bs.copy_target(cfg) if copying else (bg.build_model(cfg, bg.DEVICE), None)
    max_len = max(args.prompt_len, span + 16) + args.new_tokens + args.num_tokens + 16
    spec = bs.speculative_config(args.system, target, cfg, args.num_tokens)
    if spec is None:
        raise SystemExit(f"--system {args.system} does not speculate")
    llm = LLM(copy.deepcopy(target), backend=args.backend if on_cuda else "reference",
              max_num_seqs=max(batches), max_model_len=max_len,
              num_blocks=4 * max(batches) * -(-max_len // 16), compile=on_cuda,
              speculative=spec)  # fmt: skip
    rec = Recorder()
    rec.target_runner = llm.runner
    instrument(rec)

    def workload(b: int, variant: int) -> list[list[int]]:
        if copying:
            return bs.orbit_prompts(b, table, span, args.corrupt, variant)
        return bs.repeated_prompts(b, args.prompt_len, args.repeat_len, cfg.vocab_size, variant)

    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    result: dict = dict(device=torch.cuda.get_device_name() if on_cuda else "cpu",
                        settings=vars(args), rows=[])  # fmt: skip
    for b in batches:
        llm.generate(workload(b, 1), SamplingParams(max_new_tokens=16, ignore_eos=True),
                     use_tqdm=False)  # fmt: skip
        rec.clear()
        outs, wall = bg.timed(lambda b=b: llm.generate(workload(b, 2), params, use_tqdm=False))
        m = llm.last_metrics
        tokens = sum(len(o.token_ids) for o in outs)
        device = rec.device_ms()
        row: dict[str, Any] = dict(batch=b, tokens=tokens, wall_ms=1e3 * wall,
                                   tok_s=tokens / wall, steps=dict(rec.steps),
                                   overlapped_steps=m.num_overlapped_steps,
                                   acceptance_rate=m.acceptance_rate,
                                   device_ms_per_step={}, host_ms_per_step={})  # fmt: skip
        print(f"b={b}: {tokens} tokens in {1e3 * wall:.1f} ms ({tokens / wall:,.0f} tok/s), "
              f"steps {dict(rec.steps)}, {m.num_overlapped_steps} overlapped, accepted "
              f"{m.acceptance_rate:.0%}", flush=True)  # fmt: skip
        for kind in ("plain", "verify"):
            n = rec.steps.get(kind, 0)
            if not n:
                continue
            host = {k: 1e3 * v / n for k, v in rec.host[kind].items()}
            if kind == "verify":
                for k, v in rec.host["draft_model"].items():
                    host["draft_" + k] = 1e3 * v / n
            inner = sum(host.get(k, 0.0) for k in ("fill", "execute", "sample", "verify"))
            host["launch_other"] = host.get("launch", 0.0) - inner
            row["host_ms_per_step"][kind] = host
            dev = device.get(kind)
            row["device_ms_per_step"][kind] = None if dev is None else dev / n
            dev_s = "n/a (CPU)" if dev is None else f"{dev / n:.3f}"
            print(
                f"  {kind}: {n} steps, device {dev_s} ms/step; host ms/step: "
                + ", ".join(f"{k} {v:.3f}" for k, v in sorted(host.items())),
                flush=True,
            )
        if args.kernels:  # one more call under the profiler, so that the timed one is not perturbed
            ops = bg.top_ops(lambda b=b: llm.generate(workload(b, 2), params, use_tqdm=False),
                             args.kernels)  # fmt: skip
            steps = llm.last_metrics.num_steps
            row["top_ops"] = [dict(op, us_per_step=op["self_us"] / steps) for op in ops]
            print(f"  top ops ({steps} steps; self us per step, calls):")
            for op in row["top_ops"]:
                print(f"    {op['us_per_step']:9.1f} {op['calls']:6d}  {op['name'][:90]}")
        result["rows"].append(row)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    llm.close()
    return result


if __name__ == "__main__":
    main()
