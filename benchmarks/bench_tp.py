"""Tensor-parallel generation throughput: one model over 1, 2, 4 or 8 GPUs (issue 13).

The model has Llama-3.1-8B's shape by default (hidden 4096, intermediate 14336, 32 layers, 32/8
heads, head_dim 128, vocab 128256; ``--shape 1b`` for Llama-3.2-1B's, ``tiny`` for a CPU smoke
run) with random bf16 weights, saved once to a folder (``--prepare``; seeded, so every run loads
the same weights). One system per process:

    python benchmarks/bench_tp.py --prepare /tmp/llama8b                # once: random weights
    python benchmarks/bench_tp.py --weights /tmp/llama8b --out tp1.json  # TP=1: one GPU, no plan
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --weights /tmp/llama8b --out tp2.json
    torchrun ... --llm fuse_projections=False --out tp2_unfused.json  # LLM keywords (paged_ops)
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --weights /tmp/llama8b \\
        --system hf_static_compile --batches 1 --out hf_tp2.json
    python benchmarks/bench_tp.py --compare tp1.json tp2.json           # greedy tokens, speedup
    # CPU smoke run (2 gloo processes): --prepare DIR --shape tiny, then torchrun ... --shape tiny

Under torchrun (world size > 1) every rank loads its shard with ``from_pretrained(...,
tp_plan="auto")``; alone, the process loads the whole model onto its device. Systems:
``paged_ops``: ``LLM`` with its defaults (compile and CUDA graphs on CUDA); ``hf_static_compile``:
transformers' ``generate`` with ``cache_implementation="static"`` (its compiled decode), every rank
the same inputs. Per batch: ``--prompt-len`` random prompt tokens, greedy, ``--new-tokens``
tokens, EOS ignored; one warm call of the same shape, then a timed one (new prompts, so no prefix
cache serves it); tok/s = generated tokens / wall time of the timed call (prefill included).
``paged_ops`` also generates ``--check-tokens`` greedy tokens for 8 fixed prompts, kept in the JSON
for ``--compare`` (first position where two runs differ, per prompt). Rank 0 prints and writes.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402
import compare_engines  # noqa: E402
import profile_decode  # noqa: E402

NUM_CHECK_PROMPTS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prepare", type=Path, default=None, help="save the random model there; exit")
    p.add_argument("--weights", type=Path, default=None, help="the folder --prepare wrote")
    p.add_argument("--shape", choices=["8b", "1b", "tiny"], default="8b")
    p.add_argument("--system", choices=["paged_ops", "hf_static_compile"], default="paged_ops")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--check-tokens", type=int, default=32, help="greedy tokens of the 8 prompts")
    p.add_argument(
        "--llm", default="", help='paged_ops: LLM keywords, "fuse_projections=False,..."'
    )
    p.add_argument("--profile-batches", default="", help="paged_ops: kernel time per step at these")
    p.add_argument(
        "--hang-dump",
        type=float,
        default=0,
        help="print every thread's stack and exit after this many seconds (0: off)",
    )
    p.add_argument("--compare", nargs=2, type=Path, default=None, metavar=("A.json", "B.json"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.profile_batches = [int(b) for b in args.profile_batches.split(",") if b]
    args.llm = compare_engines.llm_keywords(args.llm)
    return args


def model_config(shape: str):
    if shape == "1b":
        return bg.llama_1b_config(16)
    if shape == "tiny":
        return bg.llama_1b_config(2, tiny=True)
    import transformers

    return transformers.LlamaConfig(  # Llama-3.1-8B's shape
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip


def prepare(folder: Path, shape: str) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = bg.build_model(model_config(shape), device)  # seeded, bf16
    model.save_pretrained(folder)
    size = sum(p.numel() for p in model.parameters()) / 1e9
    print(
        f"saved {size:.2f} B parameters ({shape}) to {folder} in {time.perf_counter() - t0:.1f} s"
    )


def load(folder: Path, world: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if world > 1:  # transformers sets up the process group torchrun asked for
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, tp_plan="auto")
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device)
    return model.eval()


def check_prompts(vocab: int, length: int) -> list[list[int]]:
    return bg.prompts(NUM_CHECK_PROMPTS, length, vocab, variant=3)


def run_paged_ops(model, batches: list[int], args, cfg) -> tuple[list[dict], dict]:
    from paged_ops import LLM, SamplingParams

    vocab = cfg.vocab_size
    llm = LLM(
        model,
        **args.llm,
        max_num_seqs=max(batches),
        max_model_len=args.prompt_len + max(args.new_tokens, args.check_tokens),
    )
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for batch in batches:
        bg.generated(llm, bg.prompts(batch, args.prompt_len, vocab, variant=0), params)
        ps = bg.prompts(batch, args.prompt_len, vocab, variant=1)
        n, seconds = bg.timed(lambda ps=ps: bg.generated(llm, ps, params))
        rows.append(dict(batch=batch, tokens=n, seconds=seconds, tok_s=n / seconds))
        print(f"  b={batch}: {n / seconds:,.1f} tok/s", flush=True)
    profiles = [profile_decode.profile_batch(llm, cfg, b, args.prompt_len, 64)
                for b in args.profile_batches]  # fmt: skip
    # greedy with the 2 most likely tokens' logprobs: a difference between two runs at a
    # position where the top two were within noise of each other is a near-tie, not an error
    check = SamplingParams(max_new_tokens=args.check_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate(check_prompts(vocab, args.prompt_len), check, use_tqdm=False)
    pa = llm.pa
    extra = dict(
        check_tokens=[o.token_ids for o in outs] if outs is not None else None,
        check_logprobs=[
            [(t.logprob, [lp for _, lp in t.top]) for t in o.outputs[0].logprobs] for o in outs
        ]
        if outs is not None
        else None,
        profiles=profiles,
        per_rank=dict(
            q_heads=pa.num_q_heads,
            kv_heads=pa.num_kv_heads,
            kv_blocks=pa.kv_cache.num_blocks,
            backends=sorted(set(pa.layer_backends)),
            fusion=fusion_state(model, llm),
        ),
    )
    print(f"  projection fusion: {extra['per_rank']['fusion']}", flush=True)
    llm.close()
    return rows, extra


def fusion_state(model, llm) -> dict:
    """What projection fusion did on this rank: groups stacked, linear calls removed from the
    compiled graph, and the first q projection's weight type and placement (DTensor under TP)."""
    q = next((m.q_proj for m in model.modules() if hasattr(m, "q_proj")), None)
    weight = getattr(q, "weight", None)
    return dict(
        groups_stacked=len(llm.runner.fused_groups),
        linears_removed=llm.runner.num_fused_linears,
        q_weight_type=type(weight).__name__,
        q_placements=str(getattr(weight, "placements", None)),
        q_is_parameter=isinstance(weight, torch.nn.Parameter),
    )


def run_hf_static_compile(model, batches: list[int], args, cfg) -> tuple[list[dict], dict]:
    rows = bg.run_hf_generate(cfg, batches, args.prompt_len, args.new_tokens, args, static=True,
                              model=model)  # fmt: skip
    return rows, {}


def compare(a_path: Path, b_path: Path) -> dict:
    """Greedy tokens of two runs (first differing position per prompt) and tok/s ratios b / a."""
    a, b = (json.loads(p.read_text()) for p in (a_path, b_path))
    first_diff, gaps, noise = [], [], []
    for i, (x, y) in enumerate(zip(a["check_tokens"], b["check_tokens"], strict=True)):
        diff = bg.first_difference(x, y)
        first_diff.append(diff)
        lp_a, lp_b = a["check_logprobs"][i], b["check_logprobs"][i]
        # |logprob of the same token in both runs| at the positions before they part
        noise += [abs(lp_a[j][0] - lp_b[j][0]) for j in range(len(x) if diff is None else diff)]
        if diff is not None:  # how far apart run a's top two were where the runs part
            top = lp_a[diff][1]
            gaps.append(top[0] - top[1])
    ratios = {
        rb["batch"]: rb["tok_s"] / ra["tok_s"]
        for ra in a["rows"]
        for rb in b["rows"]
        if ra["batch"] == rb["batch"]
    }
    same = sum(d is None for d in first_diff)
    noise.sort()
    median = noise[len(noise) // 2] if noise else None
    print(f"{b_path.name} vs {a_path.name}: greedy tokens identical on {same} of {len(first_diff)} "
          f"prompts; first difference per prompt: {first_diff}; where they part, {a_path.name}'s "
          f"top-2 logprob gap: {[round(g, 4) for g in gaps]}; |logprob difference| of the same "
          f"token before that: median {median}, max {noise[-1] if noise else None} "
          f"({len(noise)} positions)")  # fmt: skip
    for batch, r in ratios.items():
        print(f"  b={batch}: {r:.2f}x tok/s")
    return dict(identical_prompts=same, first_difference=first_diff, top2_gap_at_difference=gaps,
                logprob_noise_median=median, tok_s_ratio=ratios)  # fmt: skip


def main() -> None:
    args = parse_args()
    if args.prepare is not None:
        return prepare(args.prepare, args.shape)
    if args.compare is not None:
        compare(*args.compare)
        return None
    if args.weights is None:
        raise SystemExit("--weights DIR (written by --prepare), --prepare DIR or --compare A B")
    if args.hang_dump:
        faulthandler.dump_traceback_later(args.hang_dump, exit=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = model_config(args.shape)
    t0 = time.perf_counter()
    model = load(args.weights, world)
    load_s = time.perf_counter() - t0
    rank = dist.get_rank() if dist.is_initialized() else 0
    batches = [int(b) for b in args.batches.split(",")]
    run = run_paged_ops if args.system == "paged_ops" else run_hf_static_compile
    t1 = time.perf_counter()
    rows, extra = run(model, batches, args, cfg)
    cuda = torch.cuda.is_available()
    result = dict(
        system=args.system,
        llm_kwargs=args.llm,
        world_size=world,
        backend=dist.get_backend() if dist.is_initialized() else None,
        device=torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        torch=torch.__version__,
        shape=args.shape,
        model=dict(
            layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            q_heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
        ),  # fmt: skip
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        load_s=load_s,
        run_s=time.perf_counter() - t1,
        rows=rows,
        **extra,
    )
    if rank == 0:
        print(f"{args.system}, tensor parallel over {world} rank(s), {result['device']}; "
              f"load {load_s:.1f} s, run {result['run_s']:.1f} s")  # fmt: skip
        print(f"{'batch':>6} {'tokens':>8} {'seconds':>9} {'tok/s':>9}")
        for r in rows:
            print(f"{r['batch']:>6} {r['tokens']:>8} {r['seconds']:>9.3f} {r['tok_s']:>9.1f}")
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=2))
    if dist.is_initialized():
        dist.destroy_process_group()
    return None


if __name__ == "__main__":
    main()
