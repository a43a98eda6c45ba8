"""Launch variants of two small kernels of a 256-request decode step (NOTES.md section 33).

* ``paged_ops::greedy_argmax``'s parts kernel (+ combine) over ``[S, 128256]`` bf16 logits:
  (tile width, warps, stages, parts per row); the op's default is (4096, 8, 3, ``num_parts``).
* The split-K GEMM's fixed-order reduce (``split_k_reduce_kernel``) over ``[split, M, 2048]``
  float32 partials (the 1B down projection's): (elements per program, warps); default (1024, 4).

Each variant is checked against torch (``argmax``; ``sum(0)`` rounded to bf16, bit-exact) and
timed as CUDA-graph replays of 20 calls, alternating rounds (``bench_triton.alternating_times``).

    python benchmarks/probe_argmax_reduce.py --out benchmarks/results/probe_argmax_reduce.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
from bench_triton import alternating_times

from paged_ops.backends import triton_argmax_kernels as ak
from paged_ops.backends.triton_linear_kernels import split_k_reduce_kernel

ARGMAX_VARIANTS = [  # (BLOCK, num_warps, NUM_STAGES, parts)
    (4096, 8, 3, 1), (4096, 8, 3, 2), (2048, 8, 3, 1), (4096, 4, 3, 1), (8192, 8, 2, 1),
    (8192, 16, 3, 1), (4096, 16, 3, 1), (2048, 4, 4, 2), (1024, 4, 4, 4), (2048, 8, 4, 2),
    (4096, 8, 3, 4),
]  # fmt: skip
REDUCE_VARIANTS = [(1024, 4), (512, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 4), (8192, 8)]


def argmax_call(logits: torch.Tensor, block: int, warps: int, stages: int, parts: int):
    """The op's launcher (``paged_ops.argmax``) with every launch choice given."""
    rows, vocab = logits.shape
    width, parts = ak.split_rows(vocab, parts, block)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)  # [S]
    part_max = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)  # [S, P]
    part_idx = torch.empty(rows, parts, dtype=torch.int64, device=logits.device)  # [S, P]
    return lambda: ak.launch(logits, out, part_max, part_idx, width, parts, block, stages, warps)


def reduce_call(part: torch.Tensor, out: torch.Tensor, block: int, warps: int):
    split, m, n = part.shape

    def call() -> torch.Tensor:
        split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
            part, part, out, m * n, n, HAS_BIAS=False, SPLIT_K=split, BLOCK=block,
            num_warps=warps,
        )  # fmt: skip
        return out

    return call


def rows_of(kind: str, shape: dict, variants, fns, expected, rounds: int) -> list[dict]:
    exact = [bool(torch.equal(fn(), expected)) for fn in fns]
    times = alternating_times(fns, 20, rounds)
    rows = []
    for v, t, ok in zip(variants, times, exact, strict=True):
        rows.append(dict(kind=kind, **shape, variant=list(v), us=statistics.median(t), exact=ok))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    rows = []
    for s in (256, 128, 64):
        logits = torch.randn(s, 128256, device="cuda", dtype=torch.bfloat16)  # [S, V]
        fns = [argmax_call(logits, *v) for v in ARGMAX_VARIANTS]
        rows += rows_of("argmax", dict(rows=s), ARGMAX_VARIANTS, fns, logits.argmax(-1), a.rounds)
    for split, m in ((2, 256), (2, 192), (4, 128), (4, 64)):
        part = torch.randn(split, m, 2048, device="cuda")  # [split, M, N] float32
        out = torch.empty(m, 2048, device="cuda", dtype=torch.bfloat16)  # [M, N]
        fns = [reduce_call(part, out, *v) for v in REDUCE_VARIANTS]
        expected = part.sum(0).to(torch.bfloat16)
        rows += rows_of("reduce", dict(split=split, rows=m), REDUCE_VARIANTS, fns, expected,
                        a.rounds)  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
