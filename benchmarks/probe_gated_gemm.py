"""A gated MLP's gate/up projection and SiLU-mul in one Triton kernel (``gated_gemm``) against
what the engine runs above 16 rows: cuBLAS's ``[M, 2I]`` gate/up product, then the SiLU-mul
kernel (``triton_linear_kernels.silu_mul``).

At 256 requests an H200's decode step spends per layer ~27 us in the gate/up GEMM and 4.7 us in
the SiLU-mul kernel (benchmarks/NOTES.md sections 31 and 39), which reads the 16 MB product back
and writes 8 MB. A kernel that keeps both halves' tiles in registers and stores only
``silu(gate) * up`` removes the launch and that round trip, if its GEMM stays near cuBLAS's.
Every launch config that fits (block rows/columns/K, warps, stages) is timed as CUDA-graph
replays cycling over weight copies totalling >= 256 MiB, median of ``--rounds`` alternating
rounds; the ``cublas`` row is the engine's pair:

    python benchmarks/probe_gated_gemm.py --ms 32,64,128,256,4096 --out benchmarks/results/probe_gated_gemm_h200.json
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mid_linear import ROTATE_BYTES, time_calls, time_candidates  # noqa: E402


def configs() -> list[tuple]:
    """``(BM, BN, BK, warps, stages)`` whose shared-memory ring fits 220 KiB and whose two
    float32 accumulators stay within ~128 registers per thread."""
    out = []
    for bm, bn, bk, warps, stages in itertools.product(
        (64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4, 5)
    ):
        if stages * (bm + 2 * bn) * bk * 2 > 220 * 1024 or 2 * bm * bn > 128 * 32 * warps:
            continue
        out.append((bm, bn, bk, warps, stages))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", default="32,64,128,256,4096")
    parser.add_argument("--width", type=int, default=8192, help="I: the MLP's intermediate size")
    parser.add_argument("--hidden", type=int, default=2048, help="K: the model's hidden size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--gemm-alone", action="store_true",
                        help="also time cuBLAS's gate/up GEMM without the SiLU-mul kernel")  # fmt: skip
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from paged_ops.backends.triton_gemm_kernels import GemmConfig, gated_gemm
    from paged_ops.backends.triton_linear_kernels import silu_mul

    dtype, width, k = torch.bfloat16, args.width, args.hidden
    copies = max(2, ROTATE_BYTES // (2 * width * k * 2))
    weights = [torch.randn(2 * width, k, device="cuda", dtype=dtype) / k**0.5
               for _ in range(copies)]  # fmt: skip

    def engine_pair(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, w)  # [M, 2I]
        return silu_mul(gate_up[:, :width], gate_up[:, width:])  # [M, I]

    rows, t0 = [], time.perf_counter()
    for m in (int(v) for v in args.ms.split(",")):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        gate, up = F.linear(x.double(), weights[0].double()).to(dtype).double().chunk(2, -1)
        ref = (F.silu(gate) * up).float()  # [M, I] from the rounded halves, as the kernels
        candidates = [("cublas", engine_pair)] + [
            (str(c), lambda a, b, c=c: gated_gemm(a, b, GemmConfig(
                block_m=c[0], block_n=c[1], block_k=c[2], num_warps=c[3], num_stages=c[4])))
            for c in configs()
        ]  # fmt: skip
        rows += time_candidates("gate_up_silu", x, weights, ref, candidates, args.rounds,
                                top=args.top, skip_errors=True,
                                note=lambda: f"  [{time.perf_counter() - t0:.0f} s]")  # fmt: skip
        if args.gemm_alone:  # the pair's first half: what the SiLU-mul kernel adds to it
            times = [time_calls(F.linear, weights, x, 64) for _ in range(args.rounds)]
            us = statistics.median(times)
            rows.append(dict(shape="gate_up_gemm_alone", m=m, n=2 * width, k=k, config="cublas",
                             us=us, rounds=times))  # fmt: skip
            print(f"gate_up_gemm_alone M={m:4d} cublas {us:8.2f} us", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "torch": torch.__version__, "triton": triton.__version__,
                                        "width": width, "hidden": k, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
