"""Does a process's fourth CUDA stream capture slow every CUDA graph of the process?

Each case runs in a process of its own (the slow mode, once entered, stays): a graph of 100 tiny
kernels (``x.add_(0.0)`` on 64 Ki floats) is captured, then more graphs are made, and graph #1's
replay time per kernel is measured (CUDA events over 300 back-to-back replays, median of 5) after
each one:

- ``captures``: each new graph is its own stream capture (``torch.cuda.graph``).
- ``keep_graph``: captures with ``keep_graph=True``, never instantiated (only #1 runs).
- ``execs``: one capture, more executable graphs instantiated from it (``cuGraphInstantiate``).
- ``graph_api``: one capture, more graphs built with ``cuGraphCreate`` + a child-graph node.
- ``execs_upload``, ``graph_api_upload``: the same, each new executable graph also uploaded
  (``cuGraphUpload``), as torch's capture and a graph's first launch do (the engine's 64-bucket
  graph cut out of one capture flipped the process when uploaded, not when only instantiated:
  NOTES section 29).
- ``captures_free``, ``execs_upload_free``: the same as ``captures`` / ``execs_upload``, then the
  later graphs are freed one by one (``CUDAGraph.reset()`` / ``cuGraphExecDestroy``), newest
  first, timing graph #1 after each (does a process leave the slow mode when its graphs go?),
  then two graphs are captured again.

    python benchmarks/probe_graph_captures.py --out benchmarks/results/graph_captures_h200.json

Measured on an H200 (benchmarks/NOTES.md section 29, results/graph_captures_h200.json):
``captures`` and ``keep_graph`` 1.033 us per kernel for graphs 1-3, 1.212 from the fourth on;
``execs`` and ``graph_api`` (never uploaded) stay at 1.033-1.035. Section 30
(``results/graph_captures_upload_h200.json``, ``results/graph_slow_mode_sweep_h200.log``):
``execs_upload`` and ``graph_api_upload`` go to 1.22 at the **second** graph; with 10, 25, 50,
200 or 400 kernels per graph (``--nodes``) the captures still flip at the fourth and the
uploads at the second (+0.17-0.18 us per kernel); no CUDA environment variable tried changes it.
Section 31 (``results/graph_captures_free_h200.json``): freeing the later graphs (``reset()`` /
``cuGraphExecDestroy``, down to graph #1 alone) leaves the process slow (1.210-1.214), and graphs
captured after the frees run slow too: the slow mode lasts for the life of the process.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402 (the shared timing helper)

CASES = ("captures", "keep_graph", "execs", "graph_api", "execs_upload", "graph_api_upload",
         "captures_free", "execs_upload_free")  # fmt: skip
NODES = 100


def time_per_kernel(replay, replays: int = 300) -> float:  # noqa: ANN001
    """us per kernel of ``replays`` back-to-back graph replays (``bench_attention``'s timer:
    CUDA events, median of 5)."""

    def run() -> None:
        for _ in range(replays):
            replay()

    return round(ba.median_seconds(run, replays * NODES, graph=False, repeats=5) * 1e6, 3)


def run_case(case: str, graphs: int) -> list[tuple[str, float]]:
    """``(what was made, graph #1's us per kernel)`` after each step of ``case``."""
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: CUresult {rc}")

    x = torch.zeros(1 << 16, device="cuda")

    def body() -> None:
        for _ in range(NODES):
            x.add_(0.0)

    base = case.removesuffix("_free")

    def capture(keep: bool = False) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph(keep_graph=keep)
        with torch.cuda.graph(g):
            body()
        return g

    body()
    torch.cuda.synchronize()
    first = capture(keep=base != "captures")
    if base != "captures":
        first.instantiate()
    rows = [("graph #1", time_per_kernel(first.replay))]
    kept = []
    for i in range(2, graphs + 1):
        if base == "captures":
            kept.append(capture())
        elif base == "keep_graph":
            kept.append(capture(keep=True))
        else:
            graph = ctypes.c_void_p(first.raw_cuda_graph())
            if base.startswith("graph_api"):
                new = ctypes.c_void_p()
                check(cuda.cuGraphCreate(ctypes.byref(new), 0), "cuGraphCreate")
                node = ctypes.c_void_p()
                check(cuda.cuGraphAddChildGraphNode(ctypes.byref(node), new, None,
                                                    ctypes.c_size_t(0), graph), "child node")  # fmt: skip
                graph = new
            handle = ctypes.c_void_p()
            check(cuda.cuGraphInstantiateWithFlags(ctypes.byref(handle), graph,
                                                   ctypes.c_ulonglong(0)), "instantiate")  # fmt: skip
            if base.endswith("_upload"):
                stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
                check(cuda.cuGraphUpload(handle, stream), "upload")
            kept.append(handle)
        rows.append((f"graph #{i}", time_per_kernel(first.replay)))
    if case.endswith("_free"):
        for i in range(graphs, 1, -1):
            made = kept.pop()
            if isinstance(made, torch.cuda.CUDAGraph):
                made.reset()
            else:
                check(cuda.cuGraphExecDestroy(made), "destroy")
            torch.cuda.synchronize()
            rows.append((f"freed #{i}", time_per_kernel(first.replay)))
        for i in range(2, 4):  # graphs made again after the frees: does the count start over?
            kept.append(capture())
            rows.append((f"again #{i}", time_per_kernel(first.replay)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, help="run one case in this process")
    parser.add_argument("--graphs", type=int, default=6)
    parser.add_argument("--nodes", type=int, default=NODES, help="kernels in each graph")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, in order")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    globals()["NODES"] = args.nodes
    if args.case:  # the child: one case, its rows as JSON on the last line
        print(json.dumps(run_case(args.case, args.graphs)))
        return
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, nodes=args.nodes,
                  cases={})  # fmt: skip
    for case in args.cases.split(","):
        out = subprocess.run([sys.executable, __file__, "--case", case, "--graphs",
                              str(args.graphs), "--nodes", str(args.nodes)],
                             capture_output=True, text=True, check=True)  # fmt: skip
        rows = json.loads(out.stdout.strip().splitlines()[-1])
        result["cases"][case] = rows
        print(f"{case:10}: " + ", ".join(f"{what} {us:.3f}" for what, us in rows), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
