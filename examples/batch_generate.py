"""Generate for many prompts at once with continuous batching: progress bar and throughput.

    python examples/batch_generate.py                          # random demo model, 64 prompts
    python examples/batch_generate.py --model Qwen/Qwen3-0.6B --num-prompts 256

Without ``--model`` the prompts are random strings of ragged lengths for the demo model (see
``generate.py``); with a real model they are short instruction-like texts.
"""

from __future__ import annotations

import argparse
import random

from generate import add_engine_args, build_llm, sampling_params

TOPICS = ["the sea", "a city at night", "prime numbers", "an old clock", "rain", "bread"]


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        f"Write a few sentences about {rng.choice(TOPICS)}"
        + "".join(rng.choice(" .,abcdefghij") for _ in range(rng.randint(0, 40)))
        for _ in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.set_defaults(max_new_tokens=64)
    args = parser.parse_args()
    llm = build_llm(args, max_num_seqs=args.max_num_seqs)
    params = sampling_params(args)
    outs = llm.generate(make_prompts(args.num_prompts), params)
    for i in (0, len(outs) - 1):
        print(f"[{i}] {outs[i].text!r} ({outs[i].finish_reason})")
    m = llm.last_metrics
    print(m.summary())
    print(
        f"{m.num_steps} steps ({m.num_decode_steps} pure decode, {m.num_overlapped_steps} queued ahead), "
        f"{m.num_preemptions} preemptions, {m.num_cached_tokens} prompt tokens from the prefix cache"
    )


if __name__ == "__main__":
    main()
