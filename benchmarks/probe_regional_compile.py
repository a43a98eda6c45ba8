"""First start with the whole-model compile or with per-layer regions (issue 14's lead).

Builds the bench's Llama (16 layers; tiny in float32 on a CPU) and times the first ``generate``,
where everything compiles, with a cold compile cache, for ``LLM(compile=True)`` (``--mode whole``,
the default engine) or ``LLM(compile=True, compile_regions=True)`` (``--mode regions``: each
decoder layer compiled on its own, engine/regions.py), and counts Inductor's FX-graph and
AOTAutograd cache hits (the identical layers should be served by both). Greedy tokens of the first
``generate`` are printed to compare the modes. One mode per process (a fresh Dynamo state).

    python benchmarks/probe_regional_compile.py --mode whole
    python benchmarks/probe_regional_compile.py --mode regions
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402

from paged_ops import LLM, SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["whole", "regions"], default="regions")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="default on CPU")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = bg.llama_1b_config(args.layers, tiny=args.tiny or device.type == "cpu")
    model = bg.build_model(cfg, device)
    if device.type == "cpu":
        model = model.float()
    from torch._dynamo.utils import counters

    counters.clear()
    t0 = time.perf_counter()
    cache_dir = tempfile.mkdtemp()  # cold caches: what a first start meets
    llm = LLM(model, compile=True, compile_regions=args.mode == "regions", max_num_seqs=2,
              max_model_len=64, cache_dir=cache_dir)  # fmt: skip
    built = time.perf_counter() - t0
    params = SamplingParams(max_new_tokens=8)
    outs = llm.generate([[5, 6, 7, 8, 9], [11, 12, 13]], params, use_tqdm=False)
    first = time.perf_counter() - t0
    result = dict(
        mode=args.mode, device=str(device),
        built_s=round(built, 2), first_generate_done_s=round(first, 2),
        tokens=[o.token_ids for o in outs],
        fx_graph_cache=dict(counters["inductor"]),
        aot_autograd=dict(counters["aot_autograd"]),
        graphs=counters["stats"]["unique_graphs"],
    )  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
