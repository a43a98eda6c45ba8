"""End-to-end generation throughput: paged_ops side by side with Hugging Face transformers.

One model shape (Llama-3.2-1B: hidden 2048, intermediate 8192, 16 layers, 32/8 heads, head_dim 64,
vocab 128256, tied embeddings) with random weights in bf16, 128-token random prompts, 256 new tokens,
EOS ignored, greedy. Systems:

- ``paged_ops``: ``LLM(model).generate`` (continuous batching, torch.compile, CUDA-graph decode).
- ``hf_eager``: ``model.generate`` with the default dynamic cache (sdpa), the whole batch at once.
- ``hf_static_compile``: ``model.generate(..., cache_implementation="static")``, which compiles the
  decode forward (transformers' own recipe).
- ``hf_generate_batch``: transformers' continuous batching, ``model.generate_batch``.

tokens/s = generated tokens / wall time of a warm call (prefill included). "warm-up" is the time
before that call: model setup plus a first call (compiles, graph captures, autotuning).

    python benchmarks/bench_generate.py --out benchmarks/results/generate_h100.json
    python benchmarks/bench_generate.py --quick            # 64 new tokens, batches 1 and 64
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
import traceback
from collections.abc import Callable

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SYSTEMS = ("paged_ops", "hf_static_compile", "hf_generate_batch", "hf_eager")


def llama_1b_config(num_layers: int = 16):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=None,  # never stop early: every request makes all its tokens
        pad_token_id=0,
    )


def build_model(cfg, device: torch.device):
    import transformers

    torch.manual_seed(0)
    with device:
        model = transformers.LlamaForCausalLM._from_config(
            cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.eval()


def prompts(n: int, length: int, vocab: int, warm: bool = False) -> list[list[int]]:
    """``n`` random prompts; warm-up calls get other prompts than the timed call, so that no
    system's prefix cache can serve the timed call's prompts from the warm-up."""
    g = torch.Generator().manual_seed(2 * n + warm)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], int]) -> tuple[int, float]:
    sync()
    t0 = time.perf_counter()
    n = fn()
    sync()
    return n, time.perf_counter() - t0


def run_paged_ops(cfg, batches, prompt_len, new_tokens, args):
    from paged_ops import LLM, SamplingParams

    t0 = time.perf_counter()
    model = build_model(cfg, DEVICE)
    max_len = prompt_len + new_tokens + 16
    # twice what the largest batch needs (room for the prefix cache), not most of the GPU: the
    # baselines run in the same process afterwards
    num_blocks = 2 * max(batches) * -(-max_len // 16)
    llm = LLM(
        model,
        backend=args.backend,
        max_num_seqs=max(batches),
        max_model_len=max_len,
        max_num_tokens=args.max_num_tokens,
        num_blocks=num_blocks,
        compile=args.compile,
        cuda_graphs=args.compile,
    )
    setup = time.perf_counter() - t0
    print(f"  LLM ready in {setup:.1f} s (backend {llm.pa.layer_backends[0]})", flush=True)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(max_new_tokens=8, ignore_eos=True)
    rows = []
    for b in batches:
        ps = prompts(b, prompt_len, cfg.vocab_size)
        ws = prompts(b, prompt_len, cfg.vocab_size, warm=True)
        _, first = timed(lambda ws=ws: len(llm.generate(ws, warm, use_tqdm=False)))
        n, dt = timed(
            lambda ps=ps: sum(len(o.token_ids) for o in llm.generate(ps, params, use_tqdm=False))
        )
        m = llm.last_metrics
        rows.append(dict(batch=b, tokens=n, seconds=dt, tok_s=n / dt, warmup_s=setup + first,
                         ttft_ms=m.mean_time_to_first_token_s * 1e3, steps=m.num_steps,
                         decode_steps=m.num_decode_steps, backend=llm.pa.layer_backends[0],
                         num_blocks=llm.pa.kv_cache.num_blocks))  # fmt: skip
        print(f"  b={b}: {n / dt:,.0f} tok/s ({m.num_steps} steps, {m.num_decode_steps} decode, "
              f"TTFT {m.mean_time_to_first_token_s * 1e3:.0f} ms)", flush=True)  # fmt: skip
    if args.profile:
        profile_paged_ops(llm, cfg, prompt_len, args.profile)
    return rows


def profile_paged_ops(llm, cfg, prompt_len: int, batches: str) -> None:
    """Where the time goes: torch.profiler over a short generate per batch size."""
    from torch.profiler import ProfilerActivity, profile

    from paged_ops import SamplingParams

    for b in (int(x) for x in batches.split(",")):
        ps = prompts(b, prompt_len, cfg.vocab_size)
        params = SamplingParams(max_new_tokens=32, ignore_eos=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(ps, params, use_tqdm=False)
            sync()
        m = llm.last_metrics
        print(f"\n--- profile b={b}: {m.num_steps} steps in {m.elapsed_s * 1e3:.1f} ms "
              f"({m.elapsed_s / m.num_steps * 1e3:.2f} ms/step) ---")  # fmt: skip
        table = prof.key_averages()
        print(table.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
        print(table.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


def run_hf_generate(cfg, batches, prompt_len, new_tokens, args, static: bool):
    model = build_model(cfg, DEVICE)
    rows = []
    for b in batches:
        ids = torch.tensor(prompts(b, prompt_len, cfg.vocab_size), device=DEVICE)
        mask = torch.ones_like(ids)

        def call(n: int, ids=ids, mask=mask) -> int:
            kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False)
            if static:
                kw["cache_implementation"] = "static"
            out = model.generate(ids, attention_mask=mask, **kw)
            return (out.shape[1] - prompt_len) * out.shape[0]

        # static: the same lengths, so the first call compiles the graph the timed call uses
        _, first = timed(lambda: call(new_tokens if static else 16))
        n, dt = timed(lambda: call(new_tokens))
        rows.append(dict(batch=b, tokens=n, seconds=dt, tok_s=n / dt, warmup_s=first))
        print(f"  b={b}: {n / dt:,.0f} tok/s (first call {first:.1f} s)", flush=True)
    return rows


def run_hf_generate_batch(cfg, batches, prompt_len, new_tokens, args):
    from transformers import GenerationConfig

    model = build_model(cfg, DEVICE)
    rows = []
    for b in batches:
        if b < args.generate_batch_min:
            print(f"  b={b}: skipped (--generate-batch-min {args.generate_batch_min})")
            continue
        ps = prompts(b, prompt_len, cfg.vocab_size)

        def call(n: int, ps=ps) -> int:
            gen_cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)  # fmt: skip
            try:
                out = model.generate_batch(inputs=ps, generation_config=gen_cfg, progress_bar=False)
            except TypeError:  # releases without the progress_bar keyword
                out = model.generate_batch(inputs=ps, generation_config=gen_cfg)
            return sum(len(o.generated_tokens) for o in out.values())

        warm_ps = prompts(b, prompt_len, cfg.vocab_size, warm=True)
        _, first = timed(lambda warm_ps=warm_ps: call(16, warm_ps))
        n, dt = timed(lambda: call(new_tokens))
        rows.append(dict(batch=b, tokens=n, seconds=dt, tok_s=n / dt, warmup_s=first))
        print(f"  b={b}: {n / dt:,.0f} tok/s (first call {first:.1f} s)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--backend", default="auto", help="paged_ops attention backend")
    parser.add_argument("--max-num-tokens", type=int, default=4096, help="paged_ops step budget")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="paged_ops: torch.compile + CUDA graphs")  # fmt: skip
    parser.add_argument("--generate-batch-min", type=int, default=64,
                        help="smallest batch for generate_batch (10 tok/s at batch 1)")  # fmt: skip
    parser.add_argument("--profile", default="", help="paged_ops batches to profile, e.g. 1,64")
    parser.add_argument("--quick", action="store_true", help="64 new tokens, batches 1 and 64")
    parser.add_argument("--out", help="write the results as JSON here (after every system)")
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.batches = 64, "1,64"
    batches = [int(b) for b in args.batches.split(",")]
    cfg = llama_1b_config(args.layers)
    results: dict[str, object] = {}
    runners = {
        "paged_ops": lambda: run_paged_ops(cfg, batches, args.prompt_len, args.new_tokens, args),
        "hf_eager": lambda: run_hf_generate(cfg, batches, args.prompt_len, args.new_tokens, args, False),
        "hf_static_compile": lambda: run_hf_generate(cfg, batches, args.prompt_len, args.new_tokens, args, True),
        "hf_generate_batch": lambda: run_hf_generate_batch(cfg, batches, args.prompt_len, args.new_tokens, args),
    }  # fmt: skip
    import transformers

    meta = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                torch=torch.__version__, transformers=transformers.__version__,
                python=platform.python_version(), prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, layers=args.layers, batches=batches,
                max_num_tokens=args.max_num_tokens, dtype="bfloat16", greedy=True,
                ignore_eos=True)  # fmt: skip
    for name in args.systems.split(","):
        print(f"{name}:", flush=True)
        try:
            results[name] = runners[name]()
        except Exception as err:  # a failing baseline must not lose the others' figures
            traceback.print_exc()
            results[name] = {"error": f"{type(err).__name__}: {err}"}
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        torch._dynamo.reset()
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"settings": meta, "results": results}, f, indent=2)
    print_table(results, batches)


def print_table(results: dict[str, object], batches: list[int]) -> None:
    print(f"\n{'system':<20}" + "".join(f"{f'b={b} tok/s':>14}{'warm-up s':>11}" for b in batches))
    for name, rows in results.items():
        if isinstance(rows, dict):
            print(f"{name:<20}  error: {rows['error'][:80]}")
            continue
        by_b = {r["batch"]: r for r in rows}
        cells = "".join(
            f"{by_b[b]['tok_s']:>14,.0f}{by_b[b]['warmup_s']:>11.1f}" if b in by_b else " " * 25
            for b in batches
        )
        print(f"{name:<20}{cells}")


if __name__ == "__main__":
    main()
