"""End to end, one process: several ``LLM`` variants on the ``bench_generate.py`` model, their
tokens/s per batch size and where their greedy outputs first diverge from the first variant's.

    python benchmarks/compare_engines.py --variants "triton:backend=triton" "auto:backend=auto" \
        --out benchmarks/results/generate_auto_vs_triton.json
    python benchmarks/compare_engines.py --variants "cublas:small_linears=False" \
        "gemv:small_linears=True"
    python benchmarks/compare_engines.py --variants "base:" \
        "cdt:inductor.coordinate_descent_tuning=True"

A variant is ``NAME:key=value,...``: ``LLM`` keyword arguments (values are Python literals; bare
words are strings), or ``inductor.<option>=value`` to patch ``torch._inductor.config`` while that
variant's LLM is built (its warm-up compiles every shape it will meet), or ``env.<NAME>=value`` to
set an environment variable while that variant is built and runs (e.g. ``env.PAGED_OPS_SPLIT_K_GEMM=0``;
what a variable decides at capture time holds for the variant's CUDA graphs). Each variant gets its own
copy of the same random weights (``backend`` defaults to triton on CUDA, reference on CPU),
128-token prompts and ``--new-tokens`` new tokens; the best of two timed calls per batch size. Then
``--prompts`` (16) prompts x 64 greedy tokens from each variant, and the first position where they
differ from the first variant's (bf16 accumulation order; random weights have near ties); a
kernel that serves only decode steps of 64+ rows needs ``--prompts 64`` or more to be compared.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402


def _top_level_split(text: str) -> list[str]:
    """``text`` split at the commas outside brackets (``"a=1,b=[1,2]"`` -> two items)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return items + [text[start:]]


def parse_variant(text: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``"NAME:k=v,..."`` -> (name, LLM kwargs, Inductor config patches). ``inductor.<option>``
    keys are Inductor options; ``env.<NAME>`` keys are environment variables, set while the
    variant's LLM is built and runs (kept with the Inductor options, as strings)."""
    name, _, body = text.partition(":")
    kwargs: dict[str, Any] = {}
    inductor: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in _top_level_split(body))):
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"variant {text!r}: {item!r} is not key=value")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        if key.startswith("inductor."):
            inductor[key.removeprefix("inductor.")] = value
        elif key.startswith("env."):
            inductor[key] = raw
        else:
            kwargs[key] = value
    return name or body, kwargs, inductor


def _env_options(options: dict[str, Any]) -> dict[str, str]:
    """A variant's ``env.<NAME>`` options as ``{NAME: value}``."""
    return {k.removeprefix("env."): v for k, v in options.items() if k.startswith("env.")}


def _inductor_options(options: dict[str, Any]) -> dict[str, Any]:
    """A variant's Inductor options (all but ``env.*``)."""
    return {k: v for k, v in options.items() if not k.startswith("env.")}


def llm_keywords(text: str) -> dict[str, Any]:
    """A script's ``--llm "k=v,..."``: LLM keywords, values read as Python literals. Inductor
    options (``inductor.*``) are refused: they take a variant of this script to apply."""
    _, kwargs, inductor = parse_variant(":" + text)
    if inductor:
        raise SystemExit(f"--llm: Inductor options {sorted(inductor)} need compare_engines.py")
    return kwargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--variants", nargs="+", default=["triton:backend=triton", "auto:backend=auto"]
    )
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=16,
                        help="prompts whose greedy tokens are compared between variants")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from paged_ops import LLM, SamplingParams

    cfg = bg.llama_1b_config(16, tiny=args.tiny)
    batches = [int(b) for b in args.batches.split(",")]
    on_cuda = bg.DEVICE.type == "cuda"
    variants = [parse_variant(v) for v in args.variants]
    result: dict = dict(
        device=torch.cuda.get_device_name() if on_cuda else "cpu",
        torch=torch.__version__,
        variants={
            name: dict(llm=kw, inductor=_inductor_options(opt), env=_env_options(opt))
            for name, kw, opt in variants
        },
        tok_s={},
        warmup_s={},
    )
    tokens = {}
    for name, kwargs, options in variants:
        env, inductor = _env_options(options), _inductor_options(options)
        saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        model = bg.build_model(cfg, bg.DEVICE)
        settings = dict(backend="triton" if on_cuda else "reference", max_num_seqs=max(batches),
                        max_model_len=400, max_num_tokens=4096,
                        num_blocks=2 * max(batches) * 25 + 8, compile=on_cuda,
                        cuda_graphs=on_cuda) | kwargs  # fmt: skip
        patch = torch._inductor.config.patch(inductor) if inductor else contextlib.nullcontext()
        t0 = time.perf_counter()
        with patch:
            llm = LLM(model, **settings)
        result["warmup_s"][name] = time.perf_counter() - t0
        print(
            f"{name} {settings} {inductor}: ready in {result['warmup_s'][name]:.1f} s", flush=True
        )
        if hasattr(llm.pa, "backend_table"):
            result.setdefault("backend_table", {})[name] = llm.pa.backend_table()
        params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        for b in batches:
            warm = SamplingParams(max_new_tokens=8, ignore_eos=True)
            llm.generate(bg.prompts(b, 128, cfg.vocab_size, variant=1), warm, use_tqdm=False)
            best = 0.0
            for v in (2, 3):
                ps = bg.prompts(b, 128, cfg.vocab_size, variant=v)
                n, dt = bg.timed(
                    lambda ps=ps, llm=llm, params=params: bg.generated(llm, ps, params)
                )
                best = max(best, n / dt)
            result["tok_s"].setdefault(str(b), {})[name] = best
            print(f"  b={b}: {best:,.0f} tok/s", flush=True)
        outs = llm.generate(bg.prompts(args.prompts, 128, cfg.vocab_size, variant=9),
                            SamplingParams(max_new_tokens=64), use_tqdm=False)  # fmt: skip
        tokens[name] = [o.token_ids for o in outs]
        del llm, model
        if on_cuda:
            torch.cuda.empty_cache()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    first = variants[0][0]
    result["first_divergence"] = {
        name: [
            next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), None)
            for x, y in zip(tokens[first], tokens[name], strict=True)
        ]
        for name, _, _ in variants[1:]
    }
    print(f"first divergence per prompt from {first!r} (None = identical):",
          result["first_divergence"])  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
