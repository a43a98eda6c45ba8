"""End to end, one process: ``LLM(small_linears=True)`` (Triton GEMV for <= 16-token steps) against
``small_linears=False`` (cuBLAS) on the ``bench_generate.py`` model, and where greedy outputs diverge.

    python benchmarks/compare_small_linears.py --out benchmarks/results/generate_small_linear_ab.json

Two LLMs on two copies of the same random weights (triton attention), 128-token prompts, 256 new
tokens, the best of two timed calls per batch size; then 16 prompts x 64 greedy tokens from each and
the first position where they differ (bf16 accumulation order; random weights have near ties).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from paged_ops import LLM, SamplingParams

    cfg = bg.llama_1b_config(16, tiny=args.tiny)
    batches = [int(b) for b in args.batches.split(",")]
    on_cuda = bg.DEVICE.type == "cuda"
    result: dict = dict(device=torch.cuda.get_device_name() if on_cuda else "cpu", tok_s={})
    tokens = {}
    for small in (True, False):
        model = bg.build_model(cfg, bg.DEVICE)
        t0 = time.perf_counter()
        llm = LLM(model, backend="triton" if on_cuda else "reference", max_num_seqs=max(batches),
                  max_model_len=400, max_num_tokens=4096, num_blocks=2 * max(batches) * 25 + 8,
                  compile=on_cuda, cuda_graphs=on_cuda, small_linears=small)  # fmt: skip
        print(f"small_linears={small}: ready in {time.perf_counter() - t0:.1f} s, "
              f"{llm.runner.num_small_linears} linears rerouted", flush=True)  # fmt: skip
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
            result["tok_s"].setdefault(str(b), {})[str(small)] = best
            print(f"  b={b}: {best:,.0f} tok/s", flush=True)
        outs = llm.generate(bg.prompts(16, 128, cfg.vocab_size, variant=9),
                            SamplingParams(max_new_tokens=64), use_tqdm=False)  # fmt: skip
        tokens[small] = [o.token_ids for o in outs]
        del llm, model
        if on_cuda:
            torch.cuda.empty_cache()
    result["first_divergence"] = [
        next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), None)
        for x, y in zip(tokens[True], tokens[False], strict=True)
    ]
    print("first divergence per prompt (None = identical):", result["first_divergence"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
