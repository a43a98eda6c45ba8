"""Probe: do cuBLASLt's heuristics pick faster kernels than cuBLAS's for a decode step's projections?

``torch.backends.cuda.preferred_blas_library`` chooses which of the two libraries serves a bf16
``F.linear`` without bias (cuBLAS's ``cublasGemmEx`` by default). At 64-256 rows the q/k/v and o
projections of a 1B model run at 230-360 TFLOP/s on cuBLAS's small tiles (benchmarks/NOTES.md
sections 21-22) while the roofline allows ~2x. This script times each projection shape of the
Llama-3.2-1B (and the LM head) under both libraries, as CUDA-graph replays cycling over weight
copies of >= 256 MiB (HBM, not L2), libraries alternating over ``--rounds``; outputs are compared.
``CUBLASLT_WORKSPACE_SIZE`` (KiB, read once per process) changes cuBLASLt's workspace.

    python benchmarks/probe_blas_library.py --out benchmarks/results/probe_blas_library_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode_linears as bdl  # noqa: E402 (the graph timer)

SHAPES = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (16384, 2048),
          "down": (2048, 8192), "lm_head": (128256, 2048)}  # fmt: skip
ROTATE_BYTES = 256 * 2**20


def time_graph(graph: torch.cuda.CUDAGraph, calls: int) -> float:
    """us per ``F.linear`` call: one warm replay, then 10 timed replays of ``calls`` calls."""
    graph.replay()
    return bdl.time_graph(graph, 10) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", default="1,8,64,128,256")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--libs", default="cublas,cublaslt")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    libs = args.libs.split(",")
    rows = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        copies = max(1, ROTATE_BYTES // (n * k * 2))
        weights = [
            torch.randn(n, k, device=device, dtype=torch.bfloat16) / k for _ in range(copies)
        ]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)  # [M, K]
            calls = max(copies, 20)
            graphs, outs = {}, {}
            for lib in libs:
                torch.backends.cuda.preferred_blas_library(lib)
                outs[lib] = F.linear(x, weights[0]).float()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for i in range(calls):
                        F.linear(x, weights[i % copies])
                graphs[lib] = graph
            times = {lib: [] for lib in libs}
            for r in range(args.rounds):
                for lib in libs if r % 2 == 0 else libs[::-1]:
                    times[lib].append(time_graph(graphs[lib], calls))
            base = statistics.median(times[libs[0]])
            ref = outs[libs[0]]
            for lib in libs:
                us = statistics.median(times[lib])
                err = ((outs[lib] - ref).abs().max() / ref.abs().max()).item()
                row = {"shape": shape, "m": m, "n": n, "k": k, "lib": lib, "us": us,
                       "tflops": 2 * m * n * k / us / 1e6, "tb_per_s": n * k * 2 / us / 1e6,
                       "vs_first": base / us, "max_rel_err": err, "times": times[lib]}  # fmt: skip
                rows.append(row)
                print(f"{shape:>8s} M={m:3d} {lib:>9s}: {us:8.2f} us {row['tflops']:6.1f} TFLOP/s "
                      f"{row['tb_per_s']:5.2f} TB/s x{row['vs_first']:.3f} err {err:.1e}",
                      flush=True)  # fmt: skip
            del graphs
        del weights
    torch.backends.cuda.preferred_blas_library("cublas")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "cublaslt_workspace_kib": os.environ.get("CUBLASLT_WORKSPACE_SIZE"), "rows": rows,
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
