"""Tensor-parallel generation throughput: one model over 1, 2, 4 or 8 GPUs (issue 13).

NOT YET RUN ON GPUs: written without two GPUs at hand; only the CPU smoke run below (2 gloo
processes, ``--tiny``) has run. The numbers it prints on a CPU say nothing about speed.

    torchrun --nproc-per-node 1 benchmarks/bench_tp.py --out benchmarks/results/tp1_h200.json
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --out benchmarks/results/tp2_h200.json
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --tiny --batches 1,4 --new-tokens 8

The model has Llama-3.2-1B's shape (``bench_generate.llama_1b_config``: 32 query / 8 KV heads, so
up to 8 ranks) with random bf16 weights: each rank saves the same seeded model to a temporary
folder and loads it with ``from_pretrained(..., tp_plan="auto")``. ``LLM`` with its defaults
(compile and CUDA graphs on CUDA). Per batch: ``--prompt-len`` random prompt tokens, greedy,
``--new-tokens`` tokens, EOS ignored; one warm call, then a timed one (new prompts, so the prefix
cache serves nothing); tok/s = generated tokens / wall time of the timed call (prefill included).
Rank 0 prints the table and writes the JSON; compare runs of different world sizes on one machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402

from paged_ops import LLM, SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="a tiny model: CPU smoke run of the script")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def load(cfg, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    whole = bg.build_model(cfg, torch.device("cpu"))  # seeded: every rank builds the same weights
    with tempfile.TemporaryDirectory() as folder:  # each rank its own copy (no process group yet)
        whole.save_pretrained(folder)
        del whole
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, tp_plan="auto")
    return model.eval()


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = bg.llama_1b_config(args.num_layers, tiny=args.tiny)
    t0 = time.perf_counter()
    model = load(cfg, dtype)  # transformers sets up the process group torchrun asked for
    sharded = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model, max_num_seqs=max(batches), max_model_len=args.prompt_len + args.new_tokens)
    warmup_s = time.perf_counter() - t0
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for batch in batches:
        bg.generated(llm, bg.prompts(batch, args.prompt_len, cfg.vocab_size, variant=0), params)
        ps = bg.prompts(batch, args.prompt_len, cfg.vocab_size, variant=1)
        n, seconds = bg.timed(lambda ps=ps: bg.generated(llm, ps, params))
        rows.append(dict(batch=batch, tokens=n, seconds=seconds, tok_s=n / seconds))
    pa = llm.pa
    result = dict(
        world_size=world,
        backend=dist.get_backend() if sharded else None,
        device=torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        torch=torch.__version__,
        model=dict(
            layers=cfg.num_hidden_layers,
            q_heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            tiny=args.tiny,
        ),
        per_rank=dict(
            q_heads=pa.num_q_heads,
            kv_heads=pa.num_kv_heads,
            kv_blocks=pa.kv_cache.num_blocks,
            backends=sorted(set(pa.layer_backends)),
        ),
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        warmup_s=warmup_s,
        rows=rows,
    )
    if rank == 0:
        print(
            f"tensor parallel over {world} rank(s), {result['device']}, {dtype}, "
            f"{pa.num_q_heads}/{pa.num_kv_heads} heads and {pa.kv_cache.num_blocks} KV blocks "
            f"per rank; warm-up {warmup_s:.1f} s"
        )
        print(f"{'batch':>6} {'tokens':>8} {'seconds':>9} {'tok/s':>9}")
        for r in rows:
            print(f"{r['batch']:>6} {r['tokens']:>8} {r['seconds']:>9.3f} {r['tok_s']:>9.1f}")
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=2))
    llm.close()
    if sharded:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
