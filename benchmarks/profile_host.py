"""Where the engine loop's host time goes per step, and how long the host waits for the device.

Wraps the engine's host phases with timers while ``LLM.generate`` serves the ``bench_generate.py``
model (Llama-3.2-1B shape, random bf16 weights; ``--tiny`` for a small one) at each batch size:
scheduling (``schedule`` / ``schedule_ahead``), the metadata build, the rest of the launch (input
ids, graph replay or compiled call, sampling), the wait for the step's sampled ids (``read``: the
one host sync of a step) and ``postprocess``. With overlap the device runs step n+1 while the host
postprocesses step n and prepares step n+2, so a step whose ``read`` waits ~0 ms is host-bound.

``--stub-forward`` replaces the model forward by fixed logits: what the loop itself costs (the
CPU measure of a host-side change; no GPU needed).

    python benchmarks/profile_host.py --batches 1,64,256 --out benchmarks/results/profile_host.json
    python benchmarks/profile_host.py --tiny --stub-forward --batches 256
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402

PHASES = (
    ("schedule", "paged_ops.engine.scheduler", "Scheduler", "schedule"),
    ("schedule_ahead", "paged_ops.engine.scheduler", "Scheduler", "schedule_ahead"),
    ("metadata_build", "paged_ops.metadata", "MetadataBuilder", "build"),
    ("execute", "paged_ops.engine.runner", "ModelRunner", "execute"),
    ("launch", "paged_ops.engine.llm", "LLM", "_launch"),
    ("read_wait", "paged_ops.engine.llm", "_Launched", "read"),
    ("postprocess", "paged_ops.engine.scheduler", "Scheduler", "postprocess"),
)


def wrap_phases(phases: tuple, around: Callable[..., Any]) -> None:
    """Replace each phase's function (``(name, module, class or None, attribute)``) by one that
    returns ``around(name, function, args, kwargs)``."""
    for name, module, cls_name, attr in phases:
        owner = importlib.import_module(module)
        if cls_name is not None:
            owner = getattr(owner, cls_name)
        inner = getattr(owner, attr)

        def wrapped(*args, _inner=inner, _name=name, **kwargs):
            return around(_name, _inner, args, kwargs)

        setattr(owner, attr, wrapped)


def instrument(totals: Counter) -> None:
    """Wrap each phase's method so that its wall time adds up in ``totals`` (seconds)."""

    def around(name, inner, args, kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0

    wrap_phases(PHASES, around)


def stub_forward(vocab: int, max_seqs: int) -> None:
    """Replace the compiled/eager model call by fixed logits (the host loop alone)."""
    from paged_ops.engine.runner import ModelRunner

    logits = torch.randn(max_seqs, vocab, device=bg.DEVICE)  # [S, V]
    greedy = logits.argmax(-1)  # [S]

    def call(self, num_tokens):
        s = self.pa.metadata.padded_num_seqs
        return logits[:s], greedy[:s]

    ModelRunner._call = call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--backend", default=None, help="default: triton on CUDA, else reference")
    parser.add_argument("--stub-forward", action="store_true", help="fixed logits, no model call")
    parser.add_argument("--tiny", action="store_true", help="a tiny model")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from paged_ops import LLM, SamplingParams

    on_cuda = bg.DEVICE.type == "cuda"
    batches = [int(b) for b in args.batches.split(",")]
    cfg = bg.llama_1b_config(1 if args.stub_forward else 16, tiny=args.tiny)
    model = bg.build_model(cfg, bg.DEVICE)
    if not on_cuda:
        model = model.float()
    if args.stub_forward:
        stub_forward(cfg.vocab_size, max(batches))
    compiled = on_cuda and not args.stub_forward
    llm = LLM(model, backend=args.backend or ("triton" if on_cuda else "reference"),
              max_num_seqs=max(batches), max_model_len=args.prompt_len + args.new_tokens + 16,
              max_num_tokens=max(4096, max(batches)), compile=compiled, cuda_graphs=compiled)  # fmt: skip
    totals: Counter = Counter()
    instrument(totals)
    result: dict = dict(
        device=torch.cuda.get_device_name() if on_cuda else "cpu",
        stub_forward=args.stub_forward,
        rows=[],
    )
    for b in batches:
        params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        warm = SamplingParams(max_new_tokens=8, ignore_eos=True)
        llm.generate(
            bg.prompts(b, args.prompt_len, cfg.vocab_size, variant=1), warm, use_tqdm=False
        )
        totals.clear()
        ps = bg.prompts(b, args.prompt_len, cfg.vocab_size, variant=2)
        n, dt = bg.timed(lambda ps=ps, params=params: bg.generated(llm, ps, params))
        steps = llm.last_metrics.num_steps
        ms = {k: 1e3 * v / steps for k, v in totals.items()}
        ms["launch_other"] = ms["launch"] - ms["execute"]  # sampling settings + sample
        ms["execute_other"] = ms["execute"] - ms["metadata_build"]  # ids, replay / call
        ms["wall"] = 1e3 * dt / steps
        busy = sum(ms[k] for k in ("schedule", "schedule_ahead", "launch", "postprocess"))
        ms["host_busy"] = busy
        row = dict(batch=b, steps=steps, tok_s=n / dt, ms_per_step=ms)
        result["rows"].append(row)
        print(f"b={b}: {steps} steps, {ms['wall']:.3f} ms/step wall, {n / dt:,.0f} tok/s; host "
              f"busy {busy:.3f} ms/step, waiting for the device {ms['read_wait']:.3f}", flush=True)  # fmt: skip
        for k in ("schedule", "schedule_ahead", "metadata_build", "execute_other", "launch_other",
                  "postprocess", "read_wait"):  # fmt: skip
            print(f"    {k:15s} {ms[k]:8.3f} ms/step")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
