"""Decode projections at 64-512 rows: cuBLAS vs a plain Triton GEMM, per launch config.

At 256 requests a decode step's q/k/v and o projections (``[256, 2048] @ [2048, 3072 | 2048]``)
ran at ~230-260 TFLOP/s on an H200 (benchmarks/NOTES.md section 21: cuBLAS's 64x64 tile for q/k/v,
8.16 us for o) while gate/up and the LM head reached ~575: small N leaves cuBLAS's big tiles few
CTAs. This script asks whether a Triton GEMM with smaller tiles or split-K does better at those
shapes, before any of it is built into the engine. Timed as CUDA-graph replays that cycle over
weight copies totalling >= 256 MiB (HBM, not L2), median of ``--rounds`` alternating rounds.

    python benchmarks/bench_mid_linear.py --ms 64,128,256 --out benchmarks/results/mid_linear_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = [("qkv", 3072, 2048), ("o_proj", 2048, 2048), ("gate_up", 16384, 2048),
          ("down", 2048, 8192)]  # fmt: skip
ROTATE_BYTES = 256 * 2**20


@triton.jit
def gemm_kernel(
    x_ptr, w_ptr, out_ptr,  # [M, K], [N, K], [SPLIT_K, M, N] fp32 or [M, N]
    M, N, K, k_per_split,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pm = first_m + (pid % group) % size_m
    pn = (pid % group) // size_m
    offs_m = tl.minimum(pm * BM + tl.arange(0, BM), M - 1)
    offs_n = tl.minimum(pn * BN + tl.arange(0, BN), N - 1)
    offs_k = pid_k * k_per_split + tl.arange(0, BK)
    x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n[None, :] * K + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in tl.range(0, k_per_split, BK, num_stages=STAGES):
        acc = tl.dot(tl.load(x_ptrs), tl.load(w_ptrs), acc)
        x_ptrs += BK
        w_ptrs += BK
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    ptrs = out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def triton_linear(x, w, cfg):
    m, k = x.shape
    n = w.shape[0]
    bm, bn, bk, split, warps, stages = cfg
    k_per_split = k // split
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    if split == 1:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        gemm_kernel[grid](x, w, out, m, n, k, k_per_split, BM=bm, BN=bn, BK=bk, SPLIT_K=1,
                          GROUP_M=8, STAGES=stages, num_warps=warps, num_stages=stages)  # fmt: skip
        return out
    part = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    gemm_kernel[grid](x, w, part, m, n, k, k_per_split, BM=bm, BN=bn, BK=bk, SPLIT_K=split,
                      GROUP_M=8, STAGES=stages, num_warps=warps, num_stages=stages)  # fmt: skip
    return part.sum(0).to(x.dtype)


def time_calls(fn, weights, x, calls: int) -> float:
    """us per call: :func:`bench_triton.time_graph` over a CUDA graph of ``calls`` calls cycling
    over ``weights`` (so that no weight stays in L2 between its calls)."""
    from bench_triton import time_graph

    cycle = itertools.cycle(weights)
    return time_graph(lambda: fn(x, next(cycle)), calls, replays=5) * 1e6


def time_candidates(
    shape: str,
    x: torch.Tensor,  # [M, K] (or whatever the candidates take)
    weights: list[torch.Tensor],  # copies of one [N, K] weight
    ref: torch.Tensor,  # [M, N] float32, the product on weights[0]
    candidates: list[tuple[str, Callable]],  # (label, fn(x, w)); "cublas" among them
    rounds: int,
    top: int = 5,
    skip_errors: bool = False,
    note: Callable[[], str] = lambda: "",
) -> list[dict]:
    """Each candidate's max relative error against ``ref`` on ``weights[0]``, then ``rounds``
    alternating rounds of :func:`time_calls`; prints and returns rows (median us, TFLOP/s, ratio
    to cuBLAS) for cuBLAS and the ``top`` fastest others. With ``skip_errors`` a candidate whose
    first call raises (a config the compiler refuses) is reported and left out; ``note()`` ends
    each printed line."""
    m = x.shape[0]
    n, k = weights[0].shape
    flops = 2 * m * n * k
    errs = {}
    for label, fn in candidates:
        try:
            out = fn(x, weights[0]).float()
        except Exception as exc:
            if not skip_errors:
                raise
            print(f"{shape} M={m} {label}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        errs[label] = float((out - ref).abs().max() / ref.abs().max())
    live = [(label, fn) for label, fn in candidates if label in errs]
    times: dict[str, list[float]] = {label: [] for label, _ in live}
    for r in range(rounds):
        for label, fn in live if r % 2 == 0 else live[::-1]:
            times[label].append(time_calls(fn, weights, x, 64))
    best = sorted(times, key=lambda lb: statistics.median(times[lb]))
    base = statistics.median(times["cublas"])
    rows = []
    for label in ["cublas", *[b for b in best if b != "cublas"][:top]]:
        us = statistics.median(times[label])
        row = dict(shape=shape, m=m, n=n, k=k, config=label, us=us, tflops=flops / us / 1e6,
                   vs_cublas=base / us, err=errs[label], rounds=times[label])  # fmt: skip
        rows.append(row)
        print(f"{shape:9s} M={m:4d} {label:28s} {us:8.2f} us {row['tflops']:6.1f} TFLOP/s "
              f"x{row['vs_cublas']:.3f} err {errs[label]:.1e}{note()}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", default="64,128,256")
    parser.add_argument("--shapes", default="qkv,o_proj,gate_up,down")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dtype = torch.bfloat16
    configs = [  # (BM, BN, BK, split, warps, stages)
        (bm, bn, 64, split, warps, stages)
        for bm, bn, split, warps, stages in itertools.product(
            (64, 128), (64, 128), (1, 2), (4, 8), (3, 4)
        )
        if not (bm == 128 and bn == 128 and warps == 4)
    ]
    rows = []
    wanted = set(args.shapes.split(","))
    for name, n, k in SHAPES:
        if name not in wanted:
            continue
        copies = max(2, ROTATE_BYTES // (n * k * 2))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(copies)]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = F.linear(x, weights[0]).float()
            candidates = [("cublas", F.linear)] + [
                (str(c), lambda a, b, c=c: triton_linear(a, b, c)) for c in configs
            ]
            rows += time_candidates(name, x, weights, ref, candidates, args.rounds)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                       indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
