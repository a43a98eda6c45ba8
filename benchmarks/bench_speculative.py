"""Speculative decoding end to end: tokens/s with and without drafts, in one process.

The Llama-3.2-1B shape of ``bench_generate.py`` (random bf16 weights) at batch 1 and 8, greedy,
``--new-tokens`` per request, prompts of ``--prompt-len`` tokens made of a random stretch repeated
(text an n-gram lookup can draft from). Systems, each an ``LLM`` on the same target weights:

- ``plain``: no speculation (the reference figure); ``plain-again``: the same, a second ``LLM``
  built later in the process: its ratio to ``plain`` is the run-to-run spread of the figures;
- ``ngram``: ``SpeculativeConfig("ngram", num_tokens=k)``;
- ``draft=target``: a draft model equal to the target (every draft accepted): the upper bound,
  which shows what drafting k tokens and verifying them costs;
- ``draft-2layer``: a 2-layer draft of the same shape with its own random weights (nothing is
  accepted): what a useless draft costs once the engine backs off.
- ``plain-copy`` / ``ngram-copy``: a random model cannot continue text it has seen, so n-gram
  drafts from the prompt are rejected (``ngram`` above measures that case). For n-gram speed at a
  known acceptance, these run a *copy target*: the same shape and kernels (same matmul sizes) with
  the attention and MLP output projections zeroed and the LM head untied and set to the token
  embeddings permuted by a random permutation ``f``, so that the next token is ``f(current
  token)`` with a wide logit margin (no bf16 near ties), and prompts that hold the orbit
  ``x, f(x), f(f(x)), ...`` twice: ``new_tokens + 64`` tokens of it (a fraction
  ``--copy-corrupt`` replaced by random tokens), then its first 16 tokens again. The continuation
  walks the orbit from there, which the first copy holds: a draft token is right unless it was
  corrupted. ``ngram-copy-hard`` corrupts ``--copy-corrupt-hard`` of them, by default 16%: ~75% of
  the drafts accepted (77% / 72% at b=1 / 8 in a ``--tiny`` run). That is more than ``(0.84 +
  0.84^2 + 0.84^3 + 0.84^4) / 4 = 67%`` (draft ``j`` is right when none of the ``j`` tokens it
  copies was corrupted) because the orbit token that a corruption replaced occurs nowhere else: the
  lookup after it finds nothing, so no verify step starts there. Its speedup is over
  ``plain-copy`` on the other prompts: the same lengths and kernels, so the same cost.

``--systems`` picks among them, in order; a system that runs on the same ``LLM`` as the one before
it (``ngram-copy`` and ``ngram-copy-hard``) reuses it instead of building (compiling) another.
``--tiny`` runs a tiny model on the CPU (reference backend). The default systems take ~5 minutes on
an H100 (mostly five builds of 30-90 s each).

For each: tok/s of a warm call (generated tokens / wall time, prefill included), speedup over
``plain`` and, for a speculative system, over the same ``LLM`` with its speculator detached
(``speedup_same_llm``: calls interleaved with the speculative ones, so the 4-5% spread between two
builds of one LLM does not enter), acceptance rate, mean tokens per verify step, and whether the
greedy tokens equal ``plain``'s (else the first differing position per request: bf16 verify and
decode rows may break near ties differently).

    python benchmarks/bench_speculative.py --out benchmarks/results/speculative_h100.json
    python benchmarks/bench_speculative.py --systems plain,ngram,draft=target,plain-again
    python benchmarks/bench_speculative.py --tiny --new-tokens 16     # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402

from paged_ops import LLM, SamplingParams, SpeculativeConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeat-len", type=int, default=32, help="length of the repeated stretch")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--num-tokens", type=int, default=4, help="drafts per verify step (k)")
    p.add_argument("--systems", default="plain,draft-2layer,plain-again,plain-copy,ngram-copy,"
                   "ngram-copy-hard")  # fmt: skip
    p.add_argument("--copy-corrupt", type=float, default=0.05,
                   help="copy target: fraction of the prompt's first orbit copy replaced")  # fmt: skip
    p.add_argument("--copy-corrupt-hard", type=float, default=0.16,
                   help="the same for ngram-copy-hard")  # fmt: skip
    p.add_argument("--backend", default="triton")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def repeated_prompts(
    n: int, length: int, stretch: int, vocab: int, variant: int
) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 * variant + n)
    out = []
    for _ in range(n):
        piece = torch.randint(1, vocab, (stretch,), generator=g).tolist()
        out.append((piece * (length // stretch + 1))[:length])
    return out


@torch.no_grad()
def copy_target(cfg) -> tuple[torch.nn.Module, list[int]]:
    """The benchmark model rewired so that the next token is ``f(current token)`` for a random
    permutation ``f`` (returned): attention and MLP outputs zero (the residual stream is the
    token's embedding), LM head row ``f(t)`` = embedding ``t``. Same kernels and sizes."""
    model = bg.build_model(cfg, bg.DEVICE)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    emb = model.model.embed_tokens.weight
    perm = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(11))
    head = torch.empty_like(emb)
    head[perm.to(emb.device)] = emb  # row f(t) holds embedding t
    model.lm_head.weight = torch.nn.Parameter(head)  # untied from the embeddings
    model.config.tie_word_embeddings = False
    f = perm.tolist()
    probe = torch.arange(1, min(cfg.vocab_size, 4097), device=bg.DEVICE)[None]
    got = model(input_ids=probe, use_cache=False).logits[0].argmax(-1).tolist()
    wrong = sum(g != f[t] for g, t in zip(got, probe[0].tolist(), strict=True))
    if wrong:
        raise RuntimeError(f"copy target: {wrong} of {probe.shape[1]} tokens do not map to f(t)")
    return model, f


def orbit_prompts(
    n: int, f: list[int], span: int, corrupt: float, variant: int, restart: int = 16
) -> list[list[int]]:
    """Prompts of a copy target: ``span`` orbit tokens (a ``corrupt`` fraction replaced), then
    the orbit's first ``restart`` tokens again."""
    g = torch.Generator().manual_seed(7000 + 100 * variant + n)
    out = []
    for _ in range(n):
        x = int(torch.randint(1, len(f), (1,), generator=g))
        orbit = [x]
        while len(orbit) < span:
            orbit.append(f[orbit[-1]])
        first = list(orbit)
        flips = torch.rand(span, generator=g) < corrupt
        for i in flips.nonzero().flatten().tolist():
            if i >= restart:  # the restart's own tokens stay, so the suffix lookup finds them
                first[i] = int(torch.randint(1, len(f), (1,), generator=g))
        out.append(first + orbit[:restart])
    return out


def same_llm(name: str) -> str:
    """Systems of one name here run on one ``LLM`` (when they follow each other)."""
    return {"ngram-copy-hard": "ngram-copy"}.get(name, name)


def speculative_config(name: str, target, cfg, k: int) -> SpeculativeConfig | None:
    if name in ("plain", "plain-again", "plain-copy"):
        return None
    if name in ("ngram", "ngram-copy", "ngram-copy-hard"):
        return SpeculativeConfig("ngram", num_tokens=k)
    if name == "draft=target":
        return SpeculativeConfig("draft", num_tokens=k, draft_model=copy.deepcopy(target))
    if name == "draft-2layer":
        small = copy.deepcopy(cfg)
        small.num_hidden_layers = 2
        draft = bg.build_model(small, bg.DEVICE)
        g = torch.Generator(device=bg.DEVICE).manual_seed(1)
        with torch.no_grad():  # weights of its own: not the target's first layers
            for w in draft.parameters():
                if w.dim() > 1:
                    w.normal_(0.0, 0.02, generator=g)
        return SpeculativeConfig("draft", num_tokens=k, draft_model=draft)
    raise ValueError(f"unknown system {name!r}")


def first_differences(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    return [
        next((i for i, (x, y) in enumerate(zip(u, v, strict=True)) if x != y), None)
        for u, v in zip(a, b, strict=True)
    ]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    cfg = bg.llama_1b_config(num_layers=2 if args.tiny else 16, tiny=args.tiny)
    target = bg.build_model(cfg, bg.DEVICE)
    on_cuda = bg.DEVICE.type == "cuda"
    copy_span = args.new_tokens + 64
    max_len = max(args.prompt_len, copy_span + 16) + args.new_tokens + args.num_tokens + 16
    names = args.systems.split(",")
    copy_model, table = None, None
    if any("-copy" in n for n in names):
        copy_model, table = copy_target(cfg)

    def workload(name: str, b: int, variant: int) -> list[list[int]]:
        if "-copy" in name:
            corrupt = args.copy_corrupt_hard if name.endswith("-hard") else args.copy_corrupt
            return orbit_prompts(b, table, copy_span, corrupt, variant)
        return repeated_prompts(b, args.prompt_len, args.repeat_len, cfg.vocab_size, variant)

    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    warm = SamplingParams(max_new_tokens=16, ignore_eos=True)
    results: dict[str, list[dict]] = {}
    plain_ids: dict[tuple[str, int], list[list[int]]] = {}
    import transformers

    meta = dict(gpu=torch.cuda.get_device_name() if on_cuda else "cpu", torch=torch.__version__,
                transformers=transformers.__version__, python=platform.python_version(),
                prompt_len=args.prompt_len, repeat_len=args.repeat_len,
                new_tokens=args.new_tokens, num_tokens=args.num_tokens, backend=args.backend,
                copy_span=copy_span, copy_corrupt=args.copy_corrupt,
                copy_corrupt_hard=args.copy_corrupt_hard, greedy=True,
                tiny=args.tiny)  # fmt: skip
    llm, built = None, None
    for pos, name in enumerate(names):
        model = copy_model if "-copy" in name else target
        setup = 0.0
        if same_llm(name) != built:
            if llm is not None:
                llm.close()
                llm = None
                bg.free_memory()
            t0 = time.perf_counter()
            llm = LLM(
                copy.deepcopy(model),
                backend=args.backend if on_cuda else "reference",
                max_num_seqs=max(batches),
                max_model_len=max_len,
                num_blocks=4 * max(batches) * -(-max_len // 16),
                compile=on_cuda,
                speculative=speculative_config(name, target, cfg, args.num_tokens),
            )
            setup, built = time.perf_counter() - t0, same_llm(name)
            print(f"{name}: ready in {setup:.1f} s", flush=True)
        else:
            print(f"{name}: on the LLM of {names[pos - 1]}", flush=True)
        rows = []
        for b in batches:
            llm.generate(workload(name, b, 1), warm, use_tqdm=False)
            ps = workload(name, b, 2)
            spec = llm.spec
            best, best_off, outs, m = None, None, None, None
            call = functools.partial(llm.generate, ps, params, use_tqdm=False)
            for _ in range(3):  # the fastest of three calls: a late kernel variant compiles once
                outs, dt = bg.timed(call)
                if best is None or dt < best:
                    best, m = dt, llm.last_metrics
                if spec is not None:  # the same LLM without speculation, calls interleaved
                    llm.spec = None
                    try:
                        _, dt_off = bg.timed(call)
                    finally:
                        llm.spec = spec
                    best_off = dt_off if best_off is None else min(best_off, dt_off)
            ids = [o.token_ids for o in outs]
            n = sum(map(len, ids))
            row = dict(batch=b, tokens=n, seconds=best, tok_s=n / best, steps=m.num_steps,
                       overlapped_steps=m.num_overlapped_steps,
                       num_verify_rows=m.num_verify_rows,
                       num_draft_tokens=m.num_draft_tokens,
                       num_accepted_tokens=m.num_accepted_tokens,
                       acceptance_rate=m.acceptance_rate,
                       mean_accepted_length=m.mean_accepted_length,
                       verify_graph_replays=llm.runner.num_verify_replays, setup_s=setup)  # fmt: skip
            if best_off is not None:  # same build: free of the spread between builds
                row["tok_s_spec_off"] = n / best_off
                row["speedup_same_llm"] = best_off / best
            base_name = "plain-copy" if "-copy" in name else "plain"
            if name == base_name:
                plain_ids[(base_name, b)] = ids
            elif (base_name, b) in plain_ids:
                base = next(r for r in results[base_name] if r["batch"] == b)
                row["speedup"] = row["tok_s"] / base["tok_s"]
                if not name.endswith("-hard"):  # the same prompts as the baseline
                    diffs = first_differences(plain_ids[(base_name, b)], ids)
                    row["equal_to_plain"] = sum(d is None for d in diffs)
                    row["first_difference"] = diffs
            rows.append(row)
            extra = f", {row['speedup']:.2f}x {base_name}" if "speedup" in row else ""
            if "speedup_same_llm" in row:
                extra += f", {row['speedup_same_llm']:.2f}x itself without speculation"
            if "equal_to_plain" in row:
                extra += f", {row['equal_to_plain']}/{b} equal"
            print(f"  b={b}: {row['tok_s']:,.0f} tok/s ({m.num_steps} steps, "
                  f"{m.num_overlapped_steps} overlapped; {m.num_verify_rows} verify rows, accepted "
                  f"{m.num_accepted_tokens}/{m.num_draft_tokens} = {m.acceptance_rate:.0%}, "
                  f"{m.mean_accepted_length:.2f} tokens/verify){extra}", flush=True)  # fmt: skip
        results[name] = rows
        if args.out:  # after every system: a run cut short keeps what it measured
            Path(args.out).write_text(json.dumps({"settings": meta, "results": results}, indent=2))
    if llm is not None:
        llm.close()
        bg.free_memory()
    out = {"settings": meta, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    print_table(results, batches)
    return out


def print_table(results: dict[str, list[dict]], batches: list[int]) -> None:
    """tok/s, speedup over plain (plain-copy for the copy target), over the same LLM with
    speculation off ("x off"), acceptance and tokens per verify step."""
    print(f"\n{'system':<16}" + "".join(f"{f'b={b} tok/s':>13}{'x plain':>9}{'x off':>7}"
                                        f"{'accepted':>10}{'tok/verify':>11}"
                                        for b in batches))  # fmt: skip
    for name, rows in results.items():
        cells = ""
        for r in rows:
            accepted = f"{r['acceptance_rate']:.0%}" if r["num_draft_tokens"] else ""
            per_verify = f"{r['mean_accepted_length']:.2f}" if r["num_verify_rows"] else ""
            off = f"{r['speedup_same_llm']:.2f}" if "speedup_same_llm" in r else ""
            cells += (f"{r['tok_s']:>13,.0f}{r.get('speedup', 1.0):>9.2f}{off:>7}{accepted:>10}"
                      f"{per_verify:>11}")  # fmt: skip
        print(f"{name:<16}{cells}")
    if "plain-again" in results:
        print("(plain-again / plain is the run-to-run spread of two builds of one LLM; x off: the "
              "same LLM with speculation detached, calls interleaved)")  # fmt: skip


if __name__ == "__main__":
    main()
