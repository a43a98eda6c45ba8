"""The engine's greedy argmax (``greedy_ids``, two passes) compiled with a dynamic batch: time per call
by the number of pieces each row is split into, for batches of 1 to 256 (128k vocabulary, bf16);
``op`` in ``--chunks`` is ``paged_ops::greedy_argmax`` (Triton) compiled the same way, ``opP`` its
launcher with ``P`` parts per row.

    python benchmarks/bench_greedy.py --out benchmarks/results/greedy_ids_chunks.json
    python benchmarks/bench_greedy.py --chunks 16,op,op1,op4,op16

CUDA-graph replays of 20 calls, median of 7; each result is checked against ``argmax``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch

from paged_ops import argmax
from paged_ops.argmax import greedy_argmax
from paged_ops.engine.sampler import greedy_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunks", default="16,32,64,128,256,512")
    parser.add_argument("--batches", default="1,2,8,64,256")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for chunks in args.chunks.split(","):
        torch._dynamo.reset()
        if chunks == "op":  # paged_ops::greedy_argmax (Triton), compiled as the engine calls it
            fn = torch.compile(greedy_argmax, dynamic=True)
        elif chunks.startswith("op"):  # the op's launcher with a forced number of parts, eager
            fn = functools.partial(argmax._greedy_argmax_impl, parts=int(chunks[2:]))
        else:
            fn = torch.compile(lambda x, c=int(chunks): greedy_ids(x, c), dynamic=True)
        for s in (int(b) for b in args.batches.split(",")):
            x = torch.randn(s, args.vocab, device="cuda", dtype=torch.bfloat16)  # [S, V]
            torch._dynamo.maybe_mark_dynamic(x, 0)
            assert torch.equal(fn(x), x.argmax(-1))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    fn(x)
            times = []
            for _ in range(7):
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / 20)
            rows.append(dict(chunks=chunks, batch=s, us=statistics.median(times)))
            print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
