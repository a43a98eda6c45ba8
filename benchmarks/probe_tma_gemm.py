"""Decode projections at 64-256 rows: cuBLAS vs a Triton GEMM that loads its tiles with TMA
(tensor descriptors), with split-K (the engine's ``split_k_gemm``, every launch config), and for
the down projection a SiLU-mul prologue.

Section 22 of benchmarks/NOTES.md measured a plain pointer-load ``tl.dot`` GEMM 1.3-1.6x slower
than cuBLAS at these shapes (split 1-2 only, the partials summed by torch). At 256 requests the
H200's decode step spends ~62 us per layer in its four projections (section 31: q/k/v 7.85 us,
o 6.57, gate/up 27.0, down 21.2), where the narrow ones run at 330-410 TFLOP/s against gate/up's
640. This asks whether TMA loads + split-K 2-8 (partials reduced by one small Triton kernel)
close that gap, and what folding the SiLU-mul into the down GEMM's A operand buys on top (the
activation kernel, ~4.4 us per layer at 256 rows, and its 2 x 4 MB round trip).

Timed as CUDA-graph replays cycling over weight copies totalling >= 256 MiB (HBM, not L2),
median of ``--rounds`` alternating rounds, best configs printed per shape:

    python benchmarks/probe_tma_gemm.py --ms 64,128,256 --out benchmarks/results/probe_tma_gemm_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mid_linear import ROTATE_BYTES, SHAPES, time_calls, time_candidates  # noqa: E402


@triton.jit
def silu_gemm_kernel(
    gu_desc,  # [M, 2K] bf16 tensor descriptor: gate | up halves, block [BM, BK]
    w_desc,  # [N, K] bf16, block [BN, BK]
    out_ptr,  # [SPLIT_K, M, N] fp32 partials, or [M, N] bf16 when SPLIT_K == 1
    M, N, K, k_per_split,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """``split_k_gemm_kernel`` (paged_ops/backends/triton_gemm_kernels.py) with its A operand
    ``silu(gate) * up`` formed in registers from two TMA-loaded tiles (the experiment of
    benchmarks/NOTES.md section 32: slower than Inductor's SiLU-mul kernel + cuBLAS)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    pm = pid % num_m
    pn = pid // num_m
    k0 = pid_k * k_per_split
    rm = pm * BM + tl.arange(0, BM)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(k0, k0 + k_per_split, BK, num_stages=STAGES):
        w = w_desc.load([pn * BN, k])  # [BN, BK]
        g = gu_desc.load([pm * BM, k]).to(tl.float32)  # [BM, BK]
        u = gu_desc.load([pm * BM, K + k]).to(tl.float32)  # [BM, BK]
        a = (g / (1.0 + tl.exp(-g)) * u).to(w.dtype)  # [BM, BK]
        acc = tl.dot(a, w.T, acc)
    rn = pn * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    ptrs = out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def tma_linear(x: torch.Tensor, w: torch.Tensor, cfg: tuple, silu: bool = False) -> torch.Tensor:
    """``x @ w.T`` ([M, K] @ [N, K] -> [M, N]) by the engine's split-K GEMM with launch config
    ``cfg = (BM, BN, BK, split, warps, stages)``; with ``silu``, x is ``[M, 2K]`` gate | up and
    the product is ``(silu(gate) * up) @ w.T`` (:func:`silu_gemm_kernel`)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from paged_ops.backends.triton_gemm_kernels import GemmConfig, split_k_gemm
    from paged_ops.backends.triton_linear_kernels import split_k_reduce_kernel

    bm, bn, bk, split, warps, stages = cfg
    if not silu:
        config = GemmConfig(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=warps,
                            num_stages=stages)  # fmt: skip
        return split_k_gemm(x, w, None, config=config)
    n, k = w.shape
    m = x.shape[0]
    gu_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    part = out if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    silu_gemm_kernel[grid](gu_desc, w_desc, part, m, n, k, k // split, BM=bm, BN=bn, BK=bk,
                           SPLIT_K=split, STAGES=stages, num_warps=warps,
                           num_stages=stages)  # fmt: skip
    if split > 1:
        block = 1024
        split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
            part, part, out, m * n, n, HAS_BIAS=False, SPLIT_K=split, BLOCK=block, num_warps=4
        )
    return out


def configs(m: int, n: int, k: int) -> list[tuple]:
    """Launch configs ``(BM, BN, BK, split, warps, stages)`` that fit shared memory and give
    between half a wave and three waves of CTAs on a 132-SM GPU."""
    out = []
    for bm, bn, bk, split, warps, stages in itertools.product(
        (64, 128), (64, 128, 256), (64, 128), (1, 2, 4, 8), (4, 8), (3, 4)
    ):
        if stages * (bm + bn) * bk * 2 > 200 * 1024 or (bm * bn >= 128 * 256 and warps == 4):
            continue
        if k % (split * bk) or k // split < 4 * bk:
            continue
        if not 66 <= triton.cdiv(m, bm) * triton.cdiv(n, bn) * split <= 396:
            continue
        out.append((bm, bn, bk, split, warps, stages))
    return out


def rule_rows(ms: list[int], rounds: int) -> list[dict]:
    """The engine's rule (``paged_ops.small_linear``: the split-K GEMM where
    ``split_k_gemm_applies``, launched by ``gemm_config``) against cuBLAS at the down
    projections of Llama-3.2-1B and Llama-3.1-8B (``PAGED_OPS_SPLIT_K_GEMM=0`` for cuBLAS)."""
    import os

    from paged_ops import small_linear
    from paged_ops.linear import graph_kernels

    rows = []
    for name, n, k in (("down_1b", 2048, 8192), ("down_8b", 4096, 14336)):
        copies = max(2, ROTATE_BYTES // (n * k * 2))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
                   for _ in range(copies)]  # fmt: skip
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            times = {"cublas": [], "rule": []}
            for r in range(rounds):
                for label in ("cublas", "rule") if r % 2 == 0 else ("rule", "cublas"):
                    os.environ["PAGED_OPS_SPLIT_K_GEMM"] = "0" if label == "cublas" else "1"
                    with graph_kernels():  # the rule a CUDA graph records
                        times[label].append(time_calls(small_linear, weights, x, 64))
            os.environ.pop("PAGED_OPS_SPLIT_K_GEMM")
            cublas, rule = (statistics.median(times[lb]) for lb in ("cublas", "rule"))
            rows.append(dict(shape=name, m=m, n=n, k=k, cublas_us=cublas, rule_us=rule,
                             speedup=cublas / rule, rounds=times))  # fmt: skip
            print(f"rule {name} M={m:4d} cublas {cublas:7.2f} us  rule {rule:7.2f} us  "
                  f"x{cublas / rule:.3f}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", default="64,128,256")
    parser.add_argument("--rule", action="store_true",
                        help="only the engine's rule against cuBLAS at the 1B and 8B down projections")  # fmt: skip
    parser.add_argument("--shapes", default="qkv,o_proj,gate_up,down,down_silu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.rule:
        rows = rule_rows([int(v) for v in args.ms.split(",")], args.rounds)
        if args.out:
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))
        return
    dtype = torch.bfloat16
    silu_mul = torch.compile(
        lambda gu: F.silu(gu[:, : gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2 :]
    )
    rows = []
    wanted = args.shapes.split(",")
    shapes = [s for s in SHAPES if s[0] in wanted]
    if "down_silu" in wanted:
        shapes.append(("down_silu", 2048, 8192))
    t0 = time.perf_counter()
    for name, n, k in shapes:
        silu = name == "down_silu"
        copies = max(2, ROTATE_BYTES // (n * k * 2))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(copies)]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, 2 * k if silu else k, device="cuda", dtype=dtype)
            if silu:  # the engine's rows path: Inductor's one SiLU-mul kernel, then cuBLAS

                def base(a, b):
                    return F.linear(silu_mul(a), b)
            else:
                base = F.linear
            ref = (F.linear(silu_mul(x).float(), weights[0].float()) if silu
                   else F.linear(x.float(), weights[0].float()))  # fmt: skip
            candidates = [("cublas", base)] + [
                (str(c), lambda a, b, c=c, s=silu: tma_linear(a, b, c, s)) for c in configs(m, n, k)
            ]
            rows += time_candidates(name, x, weights, ref, candidates, args.rounds, top=args.top,
                                    skip_errors=True,
                                    note=lambda: f"  [{time.perf_counter() - t0:.0f} s]")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "torch": torch.__version__, "triton": triton.__version__,
                                        "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
