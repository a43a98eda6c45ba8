"""Probe: one CUDA graph holding every decode bucket behind conditional nodes, instead of a graph
per bucket.

A process that has captured a fourth CUDA graph (or uploaded a second executable graph) launches
every graph's kernels ~0.18 us slower for the rest of its life (benchmarks/NOTES.md sections
28-31), so the engine keeps to three graphs up to 64 sequences and pays the slow mode above. CUDA
12.4+ conditional nodes (torch's ``CUDAGraph.begin_capture_to_if_node``) could put all buckets in
one graph: each bucket's kernels captured into an IF body whose condition is a device scalar that
the step sets, so one executable graph serves every batch size. This script asks, in one process:

1. a plain graph of ``--nodes`` tiny kernels (``x.add_(0.0)`` on 64 Ki floats): us per kernel;
2. one graph of ``--buckets`` IF bodies of ``--nodes`` kernels each, one condition true: us per
   replay against the plain graph's (the conditional nodes' own cost), for the first, middle and
   last body taken;
3. the plain graph again after 2 (did the conditional graph flip the process to the slow mode?);
4. three more plain captures, then the plain graph (the known flip, for scale).

    python benchmarks/probe_graph_conditional.py --out benchmarks/results/graph_conditional_h200.json

Not yet answered: torch 2.11 (the GPU machine's) has no ``begin_capture_to_if_node``, so the
H200 run (``results/graph_conditional_h200.*``, section 31 of the NOTES) measured only steps 1 and
4 (+0.175-0.18 us per kernel after the extra captures, as before). It needs torch >= 2.13 there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402 (the shared timing helper)


def replay_us(graph: torch.cuda.CUDAGraph, replays: int = 300) -> float:
    """us per replay of ``replays`` back-to-back replays (CUDA events, median of 5)."""

    def run() -> None:
        for _ in range(replays):
            graph.replay()

    return round(ba.median_seconds(run, replays, graph=False, repeats=5) * 1e6, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--buckets", type=int, default=13)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    x = torch.zeros(1 << 16, device="cuda")

    def body() -> None:
        for _ in range(args.nodes):
            x.add_(0.0)

    body()
    torch.cuda.synchronize()
    rows: dict[str, float | str] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    plain = torch.cuda.CUDAGraph()
    with torch.cuda.graph(plain):
        body()
    rows["plain_us_per_replay"] = replay_us(plain)
    print(f"plain graph: {rows['plain_us_per_replay']} us per replay ({args.nodes} kernels)")

    if not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        rows["conditional"] = "torch.cuda.CUDAGraph has no begin_capture_to_if_node"
        print(rows["conditional"])
    else:
        chosen = torch.zeros((), dtype=torch.int64, device="cuda")  # which body runs
        flags = torch.zeros(args.buckets, dtype=torch.bool, device="cuda")  # [buckets]
        preds = [flags[i] for i in range(args.buckets)]  # 0-dim views: each IF's condition
        ids = torch.arange(args.buckets, device="cuda")
        switch = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(switch, pool=pool):
            torch.eq(ids, chosen, out=flags)  # one kernel sets every condition
            for pred in preds:
                switch.begin_capture_to_if_node(pred)
                body()
                switch.end_capture_to_conditional_node()
        for taken in (0, args.buckets // 2, args.buckets - 1):
            chosen.fill_(taken)
            switch.replay()
            torch.cuda.synchronize()
            us = replay_us(switch)
            rows[f"switch_taken_{taken}_us_per_replay"] = us
            print(f"switch graph, body {taken} of {args.buckets} taken: {us} us per replay "
                  f"({us - rows['plain_us_per_replay']:+.2f} vs plain)")  # fmt: skip
        chosen.fill_(-1)
        rows["switch_none_taken_us_per_replay"] = replay_us(switch)
        print(f"switch graph, no body taken: {rows['switch_none_taken_us_per_replay']} us")
        rows["plain_after_switch_us_per_replay"] = replay_us(plain)
        print(f"plain graph after the switch graph: {rows['plain_after_switch_us_per_replay']} us")

        # which body ran: a marker kernel per body
        marks = torch.zeros(args.buckets, device="cuda")
        check = torch.cuda.CUDAGraph()
        with torch.cuda.graph(check, pool=pool):
            torch.eq(ids, chosen, out=flags)
            for i, pred in enumerate(preds):
                check.begin_capture_to_if_node(pred)
                marks[i].add_(1.0)
                check.end_capture_to_conditional_node()
        chosen.fill_(3)
        check.replay()
        chosen.fill_(7 % args.buckets)
        check.replay()
        torch.cuda.synchronize()
        rows["marks_after_bodies_3_and_7"] = marks.tolist()
        print(f"markers after replays choosing 3 then 7: {marks.tolist()}")
        rows["plain_after_two_conditional_graphs_us_per_replay"] = replay_us(plain)
        print(f"plain graph after two conditional graphs: "
              f"{rows['plain_after_two_conditional_graphs_us_per_replay']} us")  # fmt: skip

    extra = []
    for _ in range(3):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        g.replay()
        extra.append(g)
    rows["plain_after_three_more_captures_us_per_replay"] = replay_us(plain)
    print(f"plain graph after three more captures: "
          f"{rows['plain_after_three_more_captures_us_per_replay']} us")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
