"""Probe: the split-K GEMM's reduce and the next layer's residual add + RMSNorm as one kernel.

In a decode step of 64-256 sequences the down projection runs ``split_k_gemm`` (float32 partials
``[SPLIT_K, M, N]``, then ``split_k_reduce_kernel``) and the next layer's q/k/v projection starts
with ``add_rms_norm_kernel`` (``h = down + residual``, ``y = rms_norm(h) * g``): two launches
and a boundary per layer. This probe times, in CUDA-graph replays, the two launches as the
engine makes them against one kernel that owns whole rows
(``triton_norm_linear_kernels.reduce_add_rms_norm_kernel``, what ``LLM(down_norm_fusion=True)``
launches): it sums the partials in the reduce's order, rounds to the model's dtype, adds the
residual, normalises, and writes ``h`` and ``y`` (bitwise equal to the pair; checked), at 4, 8
and 16 warps. It prints us per call and writes JSON (benchmarks/NOTES.md section 39).

    python benchmarks/probe_reduce_norm.py --rows 64,128,256 --out results/probe_reduce_norm.json
    TRITON_INTERPRET=1 python benchmarks/probe_reduce_norm.py --rows 4 --check-only   # CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_triton import time_graph  # noqa: E402

from paged_ops.backends.triton_gemm_kernels import gemm_config  # noqa: E402
from paged_ops.backends.triton_linear_kernels import split_k_reduce_kernel  # noqa: E402
from paged_ops.backends.triton_norm_linear_kernels import (  # noqa: E402
    add_rms_norm,
    reduce_add_rms_norm_kernel,
)


def pair(part, residual, g, eps):  # noqa: ANN001, ANN201 - the engine's two launches
    split, m, n = part.shape
    out = residual.new_empty((m, n))
    block = 1024
    split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
        part, part, out, m * n, n, HAS_BIAS=False, SPLIT_K=split, BLOCK=block, num_warps=4
    )
    return add_rms_norm(out, residual, g, eps)


def fused(part, residual, g, eps, warps: int = 8):  # noqa: ANN001, ANN201
    split, m, n = part.shape
    h, y = residual.new_empty((m, n)), residual.new_empty((m, n))
    reduce_add_rms_norm_kernel[(m,)](
        part, residual, g, h, y, m, n, residual.stride(0), eps, SPLIT_K=split,
        BLOCK_K=triton.next_power_of_2(n), num_warps=warps,
    )  # fmt: skip
    return h, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="64,128,256")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=8192, help="K of the down projection")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float16  # the interpreter's dot is not involved
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 132
    rows_out = []
    for m in (int(r) for r in args.rows.split(",")):
        split = max(2, gemm_config(m, args.hidden, args.inter, sms).split_k)
        gen = torch.Generator(device=device).manual_seed(m)
        part = torch.randn((split, m, args.hidden), device=device, generator=gen)  # float32
        residual = torch.randn((m, args.hidden), device=device, generator=gen).to(dtype)
        g = (1 + 0.1 * torch.randn(args.hidden, device=device, generator=gen)).to(dtype)
        h0, y0 = pair(part, residual, g, 1e-5)
        h1, y1 = fused(part, residual, g, 1e-5)
        equal = bool(torch.equal(h0, h1) and torch.equal(y0, y1))
        row = {"rows": m, "split_k": split, "bitwise_equal": equal}
        if cuda and not args.check_only:
            inputs = (part, residual, g, 1e-5)
            row["pair_us"] = round(time_graph(lambda a=inputs: pair(*a), 50) * 1e6, 3)
            for warps in (4, 8, 16):
                row[f"fused_w{warps}_us"] = round(
                    time_graph(lambda a=inputs, w=warps: fused(*a, w), 50) * 1e6, 3
                )
        print(json.dumps(row))
        rows_out.append(row)
        if not equal:
            raise SystemExit(f"the fused kernel differs from the pair at {m} rows")
    if args.out:
        settings = {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
                    "hidden": args.hidden, "inter": args.inter, "dtype": str(dtype)}  # fmt: skip
        Path(args.out).write_text(json.dumps({"settings": settings, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
