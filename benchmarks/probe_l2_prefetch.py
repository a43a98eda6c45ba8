"""Probe: does asking L2 for a projection's weights while batch-1 attention runs speed a decode step?

At batch 1 the attention kernel reads ~1 MB of KV per layer for ~5 us: HBM idles while it runs,
and the short GEMVs after it (o: 8.4 MB) spend ~2.5 us of ramp and tail each (NOTES section 27).
This script captures a 16-layer 1B-shaped chain in one CUDA graph, per layer
``q/k/v GEMV -> attention stand-in (a spin kernel) -> o GEMV -> gate/up GEMV -> SiLU-mul down GEMV``
with the engine's own one-row GEMV kernels and distinct weights per layer (nothing stays in L2
between steps), and times variants that prefetch some of the layer's next weights into L2 while the
stand-in spins:

- ``base``: nothing prefetched.
- ``o_twice``: the o GEMV run twice (the second reads L2): the floor an L2-resident o reaches.
- ``side_*``: a prefetch kernel on a forked stream, concurrent with the stand-in, joined before o.
- ``serial_*``: the prefetch kernel on the step's stream just before the stand-in (prefetches are
  fire-and-forget: the kernel ends once they are issued).
- ``*_o`` prefetches W_o; ``*_o_gu`` W_o and the first ``--gu-mb`` MB of W_gate_up.
- ``bulk`` in a name: ``cp.async.bulk.prefetch.L2`` (one instruction per 4 KiB) instead of one
  ``prefetch.global.L2`` per 128-byte line.

GPU only (Hopper for ``bulk``). Prints us per step and writes JSON with ``--out``.

    python benchmarks/probe_l2_prefetch.py --out benchmarks/results/probe_l2_prefetch_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode_linears as bdl  # noqa: E402 (the 1B chain's weights and graph timer)

from paged_ops.backends import triton_linear_kernels as kernels  # noqa: E402

LINE = 128  # bytes per L2 line request
BULK = 4096  # bytes per bulk prefetch


@triton.jit
def _line_prefetch_kernel(ptr, n_lines, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    base = ptr.to(tl.pointer_type(tl.int8))
    for i in range(ITERS):
        line = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        kernels._prefetch_l2(base + line.to(tl.int64) * 128, line < n_lines)


@triton.jit
def _bulk_prefetch_kernel(ptr, n_chunks, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    chunk = pid * BLOCK + tl.arange(0, BLOCK)
    base = ptr.to(tl.pointer_type(tl.int8))
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], 4096; mov.b32 $0, 0; }",
        "=r,l,r",
        [base + chunk.to(tl.int64) * 4096, (chunk < n_chunks).to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def prefetch(t: torch.Tensor, nbytes: int, bulk: bool) -> None:
    """Ask L2 for the first ``nbytes`` of ``t`` (contiguous)."""
    nbytes = min(nbytes, t.numel() * t.element_size())
    if bulk:
        chunks = nbytes // BULK
        _bulk_prefetch_kernel[(triton.cdiv(chunks, 128),)](t, chunks, BLOCK=128, num_warps=4)
    else:
        lines = nbytes // LINE
        iters = 4
        grid = (triton.cdiv(lines, 256 * iters),)
        _line_prefetch_kernel[grid](t, lines, BLOCK=256, ITERS=iters, num_warps=4)


def make_step(name: str, layers: list[dict], spin_cycles: int, gu_bytes: int, side):  # noqa: ANN001, ANN201
    bulk = "bulk" in name
    what = "o_gu" if name.endswith("o_gu") else "o"

    def ask(w: dict) -> None:
        prefetch(w["o"], 1 << 40, bulk)
        if what == "o_gu":
            prefetch(w["gate_up"], gu_bytes, bulk)

    def step(x: torch.Tensor) -> torch.Tensor:  # [1, 2048] -> [1, 2048]
        h = x
        inter = layers[0]["down"].shape[1]
        for w in layers:
            q = kernels.small_linear(h, w["qkv"])[:, :2048]  # [1, 2048]
            main = torch.cuda.current_stream()
            if name.startswith("side"):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    ask(w)
            elif name.startswith("serial"):
                ask(w)
            torch.cuda._sleep(spin_cycles)  # attention's place
            if name.startswith("side"):
                main.wait_stream(side)
            a = q.contiguous()
            o = kernels.small_linear(a, w["o"])  # [1, 2048]
            if name == "o_twice":
                o = kernels.small_linear(a, w["o"])
            h = h + o
            gu = kernels.small_linear(h, w["gate_up"])  # [1, 2 * inter]
            h = h + kernels.silu_mul_linear(gu[:, :inter], gu[:, inter:], w["down"])
        return h

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--spin-us", type=float, default=5.0, help="the attention stand-in")
    parser.add_argument("--gu-mb", type=float, default=12.0)
    parser.add_argument("--variants", nargs="+", default=[
        "base", "o_twice", "side_o", "side_o_gu", "serial_o", "serial_o_gu", "side_bulk_o",
        "side_bulk_o_gu", "serial_bulk_o", "serial_bulk_o_gu"])  # fmt: skip
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    layers = bdl.make_layers(*bdl.SHAPES["1b"], args.layers, torch.bfloat16, device)

    # calibrate the spin: cycles per us from one graph of 100 spins
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(100):
            torch.cuda._sleep(10_000)
    per_spin = bdl.time_graph(g, 5) / 100
    cycles = int(10_000 * args.spin_us / per_spin)
    print(f"spin: 10,000 cycles = {per_spin:.2f} us -> {cycles} cycles for {args.spin_us} us")

    side = torch.cuda.Stream()
    x = torch.randn(1, 2048, device=device, dtype=torch.bfloat16)  # [1, hidden]
    runs, ref = {}, None
    for name in args.variants:
        step = make_step(name, layers, cycles, int(args.gu_mb * 2**20), side)
        out = step(x)
        torch.cuda.synchronize()
        ref = out if ref is None else ref
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(x)
        runs[name] = {"graph": graph, "err": err, "times": []}
    bdl.time_alternately(runs, args.rounds, args.replays)
    rows = []
    base = None
    for name in args.variants:
        us = statistics.median(runs[name]["times"])
        base = us if base is None else base
        rows.append({"variant": name, "us_per_step": us, "us_per_layer": us / args.layers,
                     "delta_per_layer": (us - base) / args.layers, "times": runs[name]["times"],
                     "max_rel_err": runs[name]["err"]})  # fmt: skip
        print(f"{name:>18s}: {us:8.1f} us/step {us / args.layers:6.2f} us/layer "
              f"{(us - base) / args.layers:+6.2f} vs base  err {runs[name]['err']:.1e}  "
              f"{[round(t, 1) for t in runs[name]['times']]}", flush=True)  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"device": torch.cuda.get_device_name(device), "layers": args.layers,
                  "spin_us": args.spin_us, "spin_cycles": cycles, "gu_mb": args.gu_mb,
                  "rows": rows}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
