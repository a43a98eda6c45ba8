"""End-to-end generation throughput: paged_ops side by side with Hugging Face transformers.

One model shape (Llama-3.2-1B: hidden 2048, intermediate 8192, 16 layers, 32/8 heads, head_dim 64,
vocab 128256, tied embeddings) with random weights in bf16, 128-token random prompts, 256 new tokens,
EOS ignored, greedy. Systems:

- ``paged_ops``: ``LLM(model).generate`` (continuous batching, torch.compile, CUDA-graph decode).
  ``--kv-cache-dtype auto,fp8`` runs it once per KV cache dtype, as systems ``paged_ops`` (auto) and
  ``paged_ops_fp8``; every cache gets the same memory (``--kv-budget-gib``, default what the bf16
  cache of the largest case needs twice over), so an FP8 cache holds twice the blocks. FP8 scales
  are 1.0 (K/V of this random-weight model are O(1)) unless ``--calculate-kv-scales``.
  ``--long-prompts`` (or ``--extra-cases 64x4096``) adds cases of its own prompt length (64
  requests with 4096-token prompts), served by a second LLM sized for them (so the default cases'
  block tables, and with them their kernels' launch choices, stay as without it); paged_ops only.
- ``hf_eager``: ``model.generate`` with the default dynamic cache (sdpa), the whole batch at once.
- ``hf_static_compile``: ``model.generate(..., cache_implementation="static")``, which compiles the
  decode forward (transformers' own recipe).
- ``hf_generate_batch``: transformers' continuous batching, ``model.generate_batch``.
- ``hf_native`` (its own workload: ``--native-batches``, ragged prompts): the *same* call,
  ``model.generate(ids, attention_mask=mask, cache_implementation="static")`` with transformers'
  compiled decode, first on the plain model (its StaticCache), then after ``patch_model`` (a
  PagedCache whose rows reserve only their real tokens). Prints tok/s and the KV memory each cache
  holds, and where the greedy outputs first diverge.

tokens/s = generated tokens / wall time of a warm call (prefill included). "warm-up" is the time
before that call: model setup plus a first call (compiles, graph captures, autotuning).

    python benchmarks/bench_generate.py --out benchmarks/results/generate_h100.json
    python benchmarks/bench_generate.py --quick            # 64 new tokens, batches 1 and 64
    python benchmarks/bench_generate.py --systems paged_ops --kv-cache-dtype auto,fp8 --long-prompts
    python benchmarks/bench_generate.py --systems none --warmup-starts 2   # first / second start
    python benchmarks/bench_generate.py --systems none --warmup-starts 2 --llm compile_regions=True
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SYSTEMS = ("paged_ops", "hf_static_compile", "hf_generate_batch", "hf_eager", "hf_native")


def llama_1b_config(num_layers: int = 16, tiny: bool = False, head_dim: int = 64):
    """Llama-3.2-1B's shape; ``head_dim`` 128 doubles the attention width (q/k/v/o and the KV
    cache) at the same hidden size, for the head size of most larger models."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=1024 if tiny else 128256,  # tiny: a CPU smoke test of this script
        hidden_size=256 if tiny else 2048,
        intermediate_size=512 if tiny else 8192,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=8 if tiny else head_dim,
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


def prompts(n: int, length: int, vocab: int, variant: int = 0) -> list[list[int]]:
    """``n`` random prompts; each call of one system (warm-up, timed, variants) gets its own
    ``variant``, so that no prefix cache can serve a timed call's prompts from an earlier call."""
    g = torch.Generator().manual_seed(4 * n + variant)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()


T = TypeVar("T")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """What ``fn`` returns, and its wall seconds (the device synchronized before and after)."""
    sync()
    t0 = time.perf_counter()
    n = fn()
    sync()
    return n, time.perf_counter() - t0


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token sequences differ (the shorter length when one is a
    prefix of the other), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def generated(llm, ps: list[list[int]], params) -> int:
    """Tokens generated by one ``llm.generate`` call."""
    return sum(len(o.token_ids) for o in llm.generate(ps, params, use_tqdm=False))


def kv_bytes_per_block(cfg, kv_cache_dtype: str, block_size: int = 16) -> int:
    """Bytes of one KV block over all layers: one byte per value for FP8, else bf16's two."""
    itemsize = 1 if kv_cache_dtype.startswith("fp8") else 2
    return (
        block_size * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    )


def paged_ops_groups(
    batches: list[int], prompt_len: int, extra: str
) -> list[tuple[int, list[int]]]:
    """``(prompt_len, batches)`` groups; each gets its own LLM. ``extra``: "64x4096,..."."""
    groups: dict[int, list[int]] = {prompt_len: list(batches)}
    for case in filter(None, (c.strip() for c in extra.split(","))):
        b, p = (int(x) for x in case.lower().split("x"))
        groups.setdefault(p, [])
        if b not in groups[p]:
            groups[p].append(b)
    return [(p, bs) for p, bs in groups.items() if bs]


def make_llm(cfg, batches, prompt_len, new_tokens, args, kv_cache_dtype: str = "auto", model=None):
    """The benchmark's LLM for ``batches`` of ``prompt_len``-token prompts (on ``model``, else on
    one built here)."""
    from paged_ops import LLM

    model = build_model(cfg, DEVICE) if model is None else model
    max_len = prompt_len + new_tokens + 16
    # twice what the largest batch needs in bf16 (room for the prefix cache), not most of the GPU:
    # the baselines run in the same process afterwards. Every cache dtype gets the same memory.
    budget = (
        int(args.kv_budget_gib * 2**30)
        if args.kv_budget_gib
        else 2 * max(batches) * -(-max_len // 16) * kv_bytes_per_block(cfg, "auto")
    )
    num_blocks = budget // kv_bytes_per_block(cfg, kv_cache_dtype)
    fp8 = kv_cache_dtype.startswith("fp8")
    return LLM(
        model,
        backend=args.backend,
        max_num_seqs=max(batches),
        max_model_len=max_len,
        max_num_tokens=args.max_num_tokens,
        num_blocks=num_blocks,
        compile=args.compile,
        cuda_graphs=args.compile,
        **(dict(kv_cache_dtype=kv_cache_dtype) if kv_cache_dtype != "auto" else {}),
        **(dict(calculate_kv_scales=True) if fp8 and args.calculate_kv_scales else {}),
        **args.llm,
    )


def run_paged_ops(cfg, batches, prompt_len, new_tokens, args, kv_cache_dtype: str = "auto"):
    """``LLM.generate`` on every batch size of ``batches``, ``prompt_len``-token prompts."""
    from paged_ops import SamplingParams
    from paged_ops.engine.runner import format_breakdown

    t0 = time.perf_counter()
    llm = make_llm(cfg, batches, prompt_len, new_tokens, args, kv_cache_dtype)
    setup = time.perf_counter() - t0
    cache = llm.pa.kv_cache
    kv_gib = cache.data.nbytes / 2**30
    print(f"  LLM ready in {setup:.1f} s (backend {llm.pa.layer_backends[0]}, KV cache "
          f"{cache.dtype}: {cache.num_blocks} blocks, {kv_gib:.2f} GiB)", flush=True)  # fmt: skip
    print(f"  LLM warm-up {format_breakdown(llm.warmup_breakdown)}", flush=True)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(max_new_tokens=8, ignore_eos=True)
    rows = []
    for b in batches:
        ps = prompts(b, prompt_len, cfg.vocab_size)
        ws = prompts(b, prompt_len, cfg.vocab_size, variant=1)
        _, first = timed(lambda ws=ws: len(llm.generate(ws, warm, use_tqdm=False)))
        # timed twice (other prompts the second time): a kernel variant that the short warm-up
        # did not meet compiles inside the first call; the faster call is the steady state
        n, dt_first = timed(lambda ps=ps: generated(llm, ps, params))
        again = prompts(b, prompt_len, cfg.vocab_size, variant=3)
        n, dt = timed(lambda ps=again: generated(llm, ps, params))
        dt = min(dt, dt_first)
        m = llm.last_metrics
        # the same workload with one host sync per step (LLM(overlap=False)), other prompts
        llm.overlap = False
        sync_ps = prompts(b, prompt_len, cfg.vocab_size, variant=2)
        n_sync, dt_sync = timed(lambda ps=sync_ps: generated(llm, ps, params))
        llm.overlap = True
        rows.append(dict(batch=b, prompt_len=prompt_len, tokens=n, seconds=dt, tok_s=n / dt,
                         tok_s_first_call=n / dt_first,
                         warmup_s=setup + first, ttft_ms=m.mean_time_to_first_token_s * 1e3,
                         steps=m.num_steps, decode_steps=m.num_decode_steps,
                         overlapped_steps=m.num_overlapped_steps,
                         tok_s_no_overlap=n_sync / dt_sync, backend=llm.pa.layer_backends[0],
                         backend_table=llm.pa.backend_table(),
                         num_blocks=cache.num_blocks, kv_cache_dtype=kv_cache_dtype,
                         kv_dtype=str(cache.dtype).removeprefix("torch."), kv_cache_gib=kv_gib,
                         calculate_kv_scales=bool(llm.pa.calculate_kv_scales),
                         prefill_graphs=[t for t, _ in llm.runner.prefill_steps],
                         prefill_graph_replays=llm.runner.num_prefill_replays,
                         warmup_breakdown=llm.warmup_breakdown))  # fmt: skip
        print(f"  b={b} x {prompt_len}: {n / dt:,.0f} tok/s (first call {n / dt_first:,.0f}; {m.num_steps} steps, {m.num_decode_steps} decode, "
              f"{m.num_overlapped_steps} overlapped, TTFT {m.mean_time_to_first_token_s * 1e3:.0f} "
              f"ms); overlap off: {n_sync / dt_sync:,.0f} tok/s", flush=True)  # fmt: skip
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


def top_ops(fn: Callable[[], Any], limit: int) -> list[dict]:
    """The ``limit`` ops of most self device time (self CPU time without CUDA) in one call of
    ``fn`` under torch.profiler: ``[{"name", "calls", "self_us"}]``."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        fn()
        sync()

    def self_us(e) -> float:
        return e.self_device_time_total if on_cuda else e.self_cpu_time_total

    ranked = sorted(prof.key_averages(), key=self_us, reverse=True)[:limit]
    return [dict(name=e.key, calls=e.count, self_us=self_us(e)) for e in ranked]


def run_hf_generate(cfg, batches, prompt_len, new_tokens, args, static: bool, model=None):
    """transformers' ``generate`` per batch (``static``: its static cache and compiled decode);
    ``model``: one already loaded (e.g. sharded with a tp plan), else the seeded random model."""
    if model is None:
        model = build_model(cfg, DEVICE)
    device = next(model.parameters()).device
    rows = []
    for b in batches:
        ids = torch.tensor(prompts(b, prompt_len, cfg.vocab_size), device=device)
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
        rows.append(dict(batch=b, prompt_len=prompt_len, tokens=n, seconds=dt, tok_s=n / dt,
                         warmup_s=first))  # fmt: skip
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

        warm_ps = prompts(b, prompt_len, cfg.vocab_size, variant=1)
        _, first = timed(lambda warm_ps=warm_ps: call(16, warm_ps))
        n, dt = timed(lambda: call(new_tokens))
        rows.append(dict(batch=b, prompt_len=prompt_len, tokens=n, seconds=dt, tok_s=n / dt,
                         warmup_s=first))  # fmt: skip
        print(f"  b={b}: {n / dt:,.0f} tok/s (first call {first:.1f} s)", flush=True)
    return rows


def ragged_prompts(batch: int, longest: int, vocab: int) -> list[list[int]]:
    """``batch`` prompts from ``longest / batch`` to ``longest`` tokens (one prompt: ``longest``)."""
    g = torch.Generator().manual_seed(1000 + batch)
    lengths = [max(1, longest * (i + 1) // batch) for i in range(batch)]
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def left_padded(ps: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in ps)
    ids = torch.zeros(len(ps), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(ps):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids.to(DEVICE), mask.to(DEVICE)


def kv_bytes_per_token(cfg) -> int:
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # bf16


@torch.no_grad()
def divergence_gap(model, ids, mask, ours_ref, ours, i) -> float | None:
    """Where greedy outputs first differ, how far apart the model's own logits of the two tokens
    are (bf16 noise flips near-ties); ``None`` where they never differ."""
    if i is None:
        return None
    real = ids[mask.bool()]
    prefix = torch.cat([real, ours_ref[:i].to(real.device)])[None]
    logits = model(prefix).logits[0, -1].float()
    return round(float(logits[int(ours_ref[i])] - logits[int(ours[i])]), 4)


def run_hf_native(cfg, batches, prompt_len, new_tokens, args):
    """The same ``generate`` call with transformers' static cache + compiled decode, and on a
    patched copy of the model (PagedCache, compiled decode with the paged ops inside the graph).
    The two systems' timed calls alternate, so that drift in the host's speed (this loop is
    transformers' Python, one host sync per token) hits both alike; medians are reported."""
    import copy

    from paged_ops.integrations.transformers import patch_model

    plain = build_model(cfg, DEVICE)
    patched = copy.deepcopy(plain)
    longest = args.native_longest + new_tokens
    pa = patch_model(patched, backend=args.backend, num_blocks=2 * max(batches) * -(-longest // 16),
                     max_model_len=longest)  # fmt: skip
    systems = {"hf_static_compile": plain, "paged_ops_generate": patched}
    per_token = kv_bytes_per_token(cfg)
    rows = []
    for b in batches:
        ids, mask = left_padded(ragged_prompts(b, args.native_longest, cfg.vocab_size))
        width = ids.shape[1]

        def call(model, ids=ids, mask=mask):
            return model.generate(
                ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, cache_implementation="static", return_dict_in_generate=True,
            )  # fmt: skip

        first, times, outputs, kv = {}, {n: [] for n in systems}, {}, {}
        for name, model in systems.items():  # compiles, captures graphs
            _, first[name] = timed(lambda model=model: call(model).sequences.shape[0])
        for _ in range(args.native_repeats):
            for name, model in systems.items():
                sync()
                t0 = time.perf_counter()
                out = call(model)
                sync()
                times[name].append(time.perf_counter() - t0)
                if name == "paged_ops_generate":  # the output still holds its cache
                    kv[name] = (pa.kv_cache.num_blocks - pa.allocator.num_free) * pa.block_size
                else:  # StaticCache tensors: every row to the longest prompt + new tokens
                    kv[name] = b * (width + new_tokens - 1)
                outputs[name] = out.sequences[:, width:].cpu()
                del out
                gc.collect()
        for name in systems:
            dt = sorted(times[name])[len(times[name]) // 2]
            n, mib = new_tokens * b, kv[name] * per_token / 2**20
            rows.append(dict(system=name, batch=b, tokens=n, seconds=dt, tok_s=n / dt,
                             warmup_s=first[name], kv_mib=mib, kv_tokens=kv[name],
                             prompt_lens=mask.sum(1).tolist(), seconds_each=times[name]))  # fmt: skip
            print(f"  {name} b={b}: {n / dt:,.0f} tok/s (median of {len(times[name])}), KV "
                  f"{mib:,.1f} MiB (first call {first[name]:.1f} s)", flush=True)  # fmt: skip
        a, p = outputs["hf_static_compile"], outputs["paged_ops_generate"]
        diverge = [next((i for i, (x, y) in enumerate(zip(ra, rp, strict=True)) if x != y), None)
                   for ra, rp in zip(a.tolist(), p.tolist(), strict=True)]  # fmt: skip
        gaps = [
            divergence_gap(plain, ids[r], mask[r], a[r], p[r], i) for r, i in enumerate(diverge)
        ]
        print(f"  b={b}: first divergence per row (None = identical): {diverge}; the plain "
              f"model's logit gap between the two tokens there: {gaps}")  # fmt: skip
        rows.append(dict(system="divergence", batch=b, first_divergence=diverge, logit_gap=gaps))
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``), with ``--quick`` and
    ``--long-prompts`` applied and the KV cache dtypes checked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma list of {', '.join(SYSTEMS)}; 'none' for no system (only "
                             "--warmup-starts)")  # fmt: skip
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64,
                        help="64 (Llama-3.2-1B) or 128 (the same model with 128-wide heads)")  # fmt: skip
    parser.add_argument("--backend", default="auto", help="paged_ops attention backend")
    parser.add_argument("--max-num-tokens", type=int, default=4096, help="paged_ops step budget")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="paged_ops: torch.compile + CUDA graphs")  # fmt: skip
    parser.add_argument("--generate-batch-min", type=int, default=64,
                        help="smallest batch for generate_batch (10 tok/s at batch 1)")  # fmt: skip
    parser.add_argument("--profile", default="", help="paged_ops batches to profile, e.g. 1,64")
    parser.add_argument("--quick", action="store_true", help="64 new tokens, batches 1 and 64")
    parser.add_argument("--native-batches", default="1,8", help="hf_native batch sizes")
    parser.add_argument("--native-repeats", type=int, default=5, help="hf_native timed calls")
    parser.add_argument("--native-longest", type=int, default=512,
                        help="hf_native: the longest ragged prompt (batch 1: its only prompt)")  # fmt: skip
    parser.add_argument("--kv-cache-dtype", "--kv-cache-dtypes", dest="kv_cache_dtypes",
                        default="auto",
                        help="paged_ops KV cache dtype(s): auto, fp8, fp8_e4m3, fp8_e5m2; a comma "
                             "list runs paged_ops once per dtype (systems paged_ops, paged_ops_fp8, "
                             "...)")  # fmt: skip
    parser.add_argument("--calculate-kv-scales", action="store_true",
                        help="FP8: LLM(calculate_kv_scales=True) (default: scales 1.0)")  # fmt: skip
    parser.add_argument("--kv-budget-gib", type=float, default=None,
                        help="paged_ops KV cache memory, every dtype alike (default: twice what the "
                             "largest batch needs in bf16)")  # fmt: skip
    parser.add_argument("--extra-cases", default="",
                        help="paged_ops only: more BATCHxPROMPT_LEN cases, e.g. 64x4096 (one LLM "
                             "per prompt length)")  # fmt: skip
    parser.add_argument("--long-prompts", action="store_true",
                        help="paged_ops only: add the case 64x4096 (64 requests, 4096-token "
                             "prompts)")  # fmt: skip
    parser.add_argument("--warmup-starts", type=int, default=0,
                        help="paged_ops: build the LLM of the default cases this many times, each "
                             "in a fresh process sharing one PAGED_OPS_CACHE_DIR (empty at the "
                             "first start); reports each start's warm-up and its breakdown "
                             "(benchmarks/bench_warmup.py)")  # fmt: skip
    parser.add_argument(
        "--warmup-cache-dir",
        default=None,
        help="--warmup-starts: the cache dir (default: a new empty temp dir)",
    )
    parser.add_argument("--llm", default="",
                        help='paged_ops: more LLM keywords, "compile_regions=True,..." (also for '
                             "--warmup-starts)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    parser.add_argument("--out", help="write the results as JSON here (after every system)")
    parser.add_argument("--hang-dump", type=float, default=0,
                        help="print every thread's stack to stderr and exit after this many "
                             "seconds (0: off): a run cut by a time limit says where it was")  # fmt: skip
    args = parser.parse_args(argv)
    import compare_engines  # (imports this module: not at the top)

    args.llm = compare_engines.llm_keywords(args.llm)
    if args.quick:
        args.new_tokens, args.batches = 64, "1,64"
    if args.long_prompts:
        args.extra_cases = ",".join(filter(None, [args.extra_cases, "64x4096"]))
    args.kv_dtypes = [d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()]
    for d in args.kv_dtypes:
        if d not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
            parser.error(f"--kv-cache-dtype: unknown {d!r} (auto, fp8, fp8_e4m3, fp8_e5m2)")
    return args


def main() -> None:
    args = parse_args()
    if args.hang_dump:
        faulthandler.dump_traceback_later(args.hang_dump, exit=True)
    batches = [int(b) for b in args.batches.split(",")]
    kv_dtypes = args.kv_dtypes
    groups = paged_ops_groups(batches, args.prompt_len, args.extra_cases)
    cfg = llama_1b_config(args.layers, tiny=args.tiny, head_dim=args.head_dim)
    results: dict[str, object] = {}

    def paged_ops_runner(kv_cache_dtype: str):
        def run() -> list[dict]:
            rows: list[dict] = []
            for i, (prompt_len, bs) in enumerate(groups):  # one LLM per prompt length
                if i:
                    free_memory()
                try:
                    rows += run_paged_ops(cfg, bs, prompt_len, args.new_tokens, args,
                                          kv_cache_dtype)  # fmt: skip
                except Exception as err:  # keep the other groups' figures
                    if len(groups) == 1:
                        raise
                    traceback.print_exc()
                    rows.append(dict(prompt_len=prompt_len, batches=bs, kv_cache_dtype=kv_cache_dtype,
                                     error=f"{type(err).__name__}: {err}"))  # fmt: skip
            return rows

        return run

    system_names: list[str] = []
    for name in filter(None, args.systems.split(",")):
        if name == "none":
            continue
        system_names += [paged_ops_name(d) for d in kv_dtypes] if name == "paged_ops" else [name]
    runners = {
        **{paged_ops_name(d): paged_ops_runner(d) for d in kv_dtypes},
        "hf_eager": lambda: run_hf_generate(cfg, batches, args.prompt_len, args.new_tokens, args, False),
        "hf_static_compile": lambda: run_hf_generate(cfg, batches, args.prompt_len, args.new_tokens, args, True),
        "hf_generate_batch": lambda: run_hf_generate_batch(cfg, batches, args.prompt_len, args.new_tokens, args),
        "hf_native": lambda: run_hf_native(cfg, [int(b) for b in args.native_batches.split(",")], args.prompt_len, args.new_tokens, args),
    }  # fmt: skip
    import transformers

    meta = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                torch=torch.__version__, transformers=transformers.__version__,
                python=platform.python_version(), prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, layers=args.layers, head_dim=cfg.head_dim,
                batches=batches,
                max_num_tokens=args.max_num_tokens, dtype="bfloat16", greedy=True,
                ignore_eos=True, kv_cache_dtypes=kv_dtypes,
                paged_ops_cases=[[b, p] for p, bs in groups for b in bs],
                kv_budget_gib=args.kv_budget_gib,
                calculate_kv_scales=args.calculate_kv_scales, tiny=args.tiny,
                llm_kwargs=args.llm, host_probe_ms=[host_probe_ms()])  # fmt: skip
    print(f"host probe: {meta['host_probe_ms'][0]:.1f} ms", flush=True)

    def save() -> None:  # after every part, so that a timeout keeps what was measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"settings": meta, "results": results}, f, indent=2)

    if args.warmup_starts > 0:
        import bench_warmup

        results["warmup"] = bench_warmup.measure_starts(
            sys.argv[1:], args.warmup_starts, args.warmup_cache_dir
        )
        save()
    for name in system_names:
        print(f"{name}:", flush=True)
        try:
            results[name] = runners[name]()
        except Exception as err:  # a failing baseline must not lose the others' figures
            traceback.print_exc()
            results[name] = {"error": f"{type(err).__name__}: {err}"}
        free_memory()
        save()
    meta["host_probe_ms"].append(host_probe_ms())
    print(f"host probe at the end: {meta['host_probe_ms'][1]:.1f} ms", flush=True)
    save()
    if system_names:
        print_table({k: v for k, v in results.items() if k != "warmup"},
                    [(b, p) for p, bs in groups for b in bs])  # fmt: skip
        print_kv_table(results)


def host_probe_ms() -> float:
    """Milliseconds of a fixed pure-Python workload, best of 5: this process's host speed.

    The engine's host work (scheduling, metadata, prefill launches) runs on one core; on a shared
    machine a process sometimes gets a core that runs Python ~1.5-2x slower (the TTFT and the
    overlap-off figures show it), which moves every paged_ops row. Recorded with the figures so
    such a run can be recognised (benchmarks/NOTES.md section 31)."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        total = 0
        for i in range(200_000):
            total += i * i % 7
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def paged_ops_name(kv_cache_dtype: str) -> str:
    """The system name of paged_ops on one KV cache dtype: ``paged_ops`` for auto."""
    return "paged_ops" if kv_cache_dtype == "auto" else f"paged_ops_{kv_cache_dtype}"


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def print_table(results: dict[str, object], cases: list[tuple[int, int]]) -> None:
    """tok/s and warm-up per system and case ``(batch, prompt_len)``."""
    head = "".join(f"{f'b={b}x{p} tok/s':>17}{'warm-up s':>11}" for b, p in cases)
    print(f"\n{'system':<20}{head}")
    for name, rows in results.items():
        if isinstance(rows, dict):
            print(f"{name:<20}  error: {rows['error'][:80]}")
            continue
        if name == "hf_native":
            for r in rows:
                if "tok_s" in r:
                    print(f"  {r['system']:<20} b={r['batch']}: {r['tok_s']:>9,.0f} tok/s, "
                          f"KV {r['kv_mib']:>8,.1f} MiB")  # fmt: skip
            continue
        by_case = {(r["batch"], r.get("prompt_len")): r for r in rows if "tok_s" in r}
        cells = "".join(
            f"{by_case[c]['tok_s']:>17,.0f}{by_case[c]['warmup_s']:>11.1f}"
            if c in by_case
            else " " * 28
            for c in cases
        )
        print(f"{name:<20}{cells}")
        for r in rows:
            if "error" in r:
                print(f"{'':<20}  prompt_len {r['prompt_len']} error: {r['error'][:80]}")


def print_kv_table(results: dict[str, object]) -> None:
    """paged_ops per KV cache dtype: blocks, cache memory, tok/s, speed vs the auto cache."""
    paged = {n: rows for n, rows in results.items()
             if n.startswith("paged_ops") and n != "paged_ops_generate" and isinstance(rows, list)}  # fmt: skip
    if not paged:
        return
    auto = {(r["batch"], r["prompt_len"]): r for r in paged.get("paged_ops", []) if "tok_s" in r}
    print(f"\n{'system':<20}{'kv dtype':>15}{'case':>10}{'num_blocks':>12}{'KV GiB':>8}"
          f"{'tok/s':>10}{'no-overlap':>12}{'vs auto':>9}")  # fmt: skip
    for name, rows in paged.items():
        for r in rows:
            if "tok_s" not in r:
                continue
            base = auto.get((r["batch"], r["prompt_len"]))
            ratio = f"{r['tok_s'] / base['tok_s']:>8.2f}x" if base else f"{'-':>9}"
            case = f"{r['batch']}x{r['prompt_len']}"
            print(f"{name:<20}{r['kv_dtype']:>15}{case:>10}"
                  f"{r['num_blocks']:>12,}{r['kv_cache_gib']:>8.3f}{r['tok_s']:>10,.0f}"
                  f"{r['tok_s_no_overlap']:>12,.0f}{ratio}")  # fmt: skip


if __name__ == "__main__":
    main()
