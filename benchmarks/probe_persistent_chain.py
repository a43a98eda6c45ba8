"""Probe: how fast could batch-1 decode's weight streaming be without kernel boundaries?

At batch 1 a 1B decode layer is four matrix-vector products (q/k/v 3072 x 2048, o 2048 x 2048,
gate/up 16384 x 2048, down 2048 x 8192 with the SiLU-mul) plus attention and norms. The engine
runs each GEMV as a kernel of its own; the short ones lose ~2.5-3 us each to their launch, the
ramp of their first weight loads and the tail of their last wave (benchmarks/NOTES.md sections 27
and 31: the o GEMV takes 3.5 us even with all its weights in L2), and every fix tried across
kernels (L2 prefetch during attention, programmatic dependent launch) bought <= 1% or lost.

A persistent kernel avoids the boundaries: one program per SM runs every layer's four GEMVs in
turn, each phase's rows dealt round-robin over the programs, with a grid-wide barrier (an atomic
counter) between dependent phases; before each barrier a program can ask L2 for the first weights
of its next phase (``--pf-k``), which no data dependency forbids. This script times, in one CUDA
graph each over ``--layers`` layers with distinct weights (nothing stays in L2 between replays):

- ``engine``: the engine's own one-row GEMV kernels (``small_linear``, ``silu_mul_linear``), one
  launch per projection.
- ``phases``: this script's GEMV body, one launch per projection (grid = its row blocks).
- ``persistent_pf<K>``: the same body in one persistent launch, ``K`` weight elements per row of
  the next phase prefetched into L2 before each barrier (0: none).

``phases`` and ``persistent_*`` accumulate each row block in the same order, so every activation
of every layer must match bit for bit (checked; a mismatch means a barrier let a phase read stale
inputs). No
attention, norms or residual adds: the chain is the matmuls' data dependency alone, the part of the
step that streams the weights (2.47 GB of the 1B's step, ~1.95 GB of it in these 16 layers).

GPU only. Prints us per layer and writes JSON with ``--out``::

    python benchmarks/probe_persistent_chain.py --out benchmarks/results/probe_persistent_chain_h200.json
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
import bench_decode_linears as bdl  # noqa: E402 (the 1B shapes and the graph timer)

from paged_ops.backends import triton_linear_kernels as kernels  # noqa: E402


@triton.jit
def _gemv_phase(
    w_ptr,  # [N, K] row-major
    x_ptr,  # [K] (SILU: [2K], gate then up)
    out_ptr,  # [N]
    pid,
    programs,
    N: tl.constexpr,
    K: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    """``out = W @ x`` (``x = silu(gate) * up`` when SILU) for row blocks ``pid``, ``pid +
    programs``, ...: one pipelined loop over (block, K step) pairs, so the loads stay in flight
    from one block into the next; each block's products are summed over K in one fixed order."""
    K_STEPS: tl.constexpr = K // BLOCK_K
    N_BLOCKS: tl.constexpr = N // BLOCK_N
    mine = (N_BLOCKS - pid + programs - 1) // programs
    rows = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for t in tl.range(0, mine * K_STEPS, num_stages=STAGES):
        block = pid + (t // K_STEPS) * programs
        kk = (t % K_STEPS) * BLOCK_K
        row_ids = (block * BLOCK_N + rows).to(tl.int64)
        w = tl.load(w_ptr + row_ids[:, None] * K + kk + offs_k[None, :])  # [BLOCK_N, BLOCK_K]
        if SILU:
            gate = tl.load(x_ptr + kk + offs_k).to(tl.float32)
            up = tl.load(x_ptr + K + kk + offs_k).to(tl.float32)
            x = (gate * tl.sigmoid(gate) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            x = tl.load(x_ptr + kk + offs_k).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        if t % K_STEPS == K_STEPS - 1:
            tl.store(out_ptr + row_ids, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty))
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)


@triton.jit
def _prefetch_first_rows(
    w_ptr, pid, valid, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, PF_K: tl.constexpr
):
    """Ask L2 for the first ``PF_K`` elements of each row of this program's first block of the
    ``[N, K]`` weight at ``w_ptr`` (where ``valid``)."""
    if PF_K > 0:
        rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        cols = tl.arange(0, PF_K // 64) * 64  # one pointer per 128-byte line (16-bit weights)
        lines = w_ptr + rows[:, None] * K + cols[None, :]
        kernels._prefetch_l2(lines, (cols < K)[None, :] & (rows < N)[:, None] & valid)


@triton.jit
def _stamp(stamp_ptr, index, pid, STAMPS: tl.constexpr):
    """Program 0 stores the GPU's nanosecond clock (``%globaltimer``) at ``stamp[index]``."""
    if STAMPS:
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
        tl.store(stamp_ptr + index, now, mask=pid == 0)


@triton.jit
def _grid_sync(
    counter_ptr, flag_ptr, target, stamp_ptr, index, pid,
    MAX_SPINS: tl.constexpr, STAMPS: tl.constexpr,
):  # fmt: skip
    """Wait until ``target`` arrivals were counted (this program's included). Every warp's stores
    happen before the release (CTA barrier first); loads after the acquire see every program's.
    Gives up after ``MAX_SPINS`` polls and raises ``flag`` (a wrong answer, never a hang).
    ``STAMPS``: program 0 then stamps ``stamp[index]``."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < MAX_SPINS):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < target:
        tl.atomic_max(flag_ptr, 1)
    tl.debug_barrier()
    _stamp(stamp_ptr, index, pid, STAMPS)


@triton.jit
def persistent_chain_kernel(
    w_ptr,  # [L, per-layer weights]: qkv [QKV, HID], o [HID, HID], gate/up [2I, HID], down [HID, I]
    h_ptr,  # [L + 1, HID]: h[0] the input, h[l + 1] layer l's output
    q_ptr,  # [L, QKV]
    o_ptr,  # [L, HID]
    gu_ptr,  # [L, 2I]
    counter_ptr,  # [1] int32, zero at launch
    flag_ptr,  # [1] int32: 1 if a barrier gave up
    stamp_ptr,  # [4 L + 1] int64: STAMPS: the clock at the start and after each barrier
    layers,
    HID: tl.constexpr,
    QKV: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PF_K: tl.constexpr,
    MAX_SPINS: tl.constexpr,
    STAMPS: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    _stamp(stamp_ptr, 0, pid, STAMPS)
    OFF_O: tl.constexpr = QKV * HID
    OFF_GU: tl.constexpr = OFF_O + HID * HID
    OFF_DOWN: tl.constexpr = OFF_GU + 2 * INTER * HID
    PER_LAYER: tl.constexpr = OFF_DOWN + HID * INTER
    arrivals = 0
    w = w_ptr  # this layer's weights (64-bit pointer arithmetic)
    for layer in range(layers):
        _gemv_phase(w, h_ptr + layer * HID, q_ptr + layer * QKV, pid, programs,
                    QKV, HID, False, BLOCK_N, BLOCK_K, STAGES)  # fmt: skip
        _prefetch_first_rows(w + OFF_O, pid, True, HID, HID, BLOCK_N, PF_K)
        arrivals += programs
        _grid_sync(counter_ptr, flag_ptr, arrivals, stamp_ptr, arrivals // programs, pid,
                   MAX_SPINS, STAMPS)  # fmt: skip
        _gemv_phase(w + OFF_O, q_ptr + layer * QKV, o_ptr + layer * HID, pid, programs,
                    HID, HID, False, BLOCK_N, BLOCK_K, STAGES)  # fmt: skip
        _prefetch_first_rows(w + OFF_GU, pid, True, 2 * INTER, HID, BLOCK_N, PF_K)
        arrivals += programs
        _grid_sync(counter_ptr, flag_ptr, arrivals, stamp_ptr, arrivals // programs, pid,
                   MAX_SPINS, STAMPS)  # fmt: skip
        _gemv_phase(w + OFF_GU, o_ptr + layer * HID, gu_ptr + layer * 2 * INTER, pid, programs,
                    2 * INTER, HID, False, BLOCK_N, BLOCK_K, STAGES)  # fmt: skip
        _prefetch_first_rows(w + OFF_DOWN, pid, True, HID, INTER, BLOCK_N, PF_K)
        arrivals += programs
        _grid_sync(counter_ptr, flag_ptr, arrivals, stamp_ptr, arrivals // programs, pid,
                   MAX_SPINS, STAMPS)  # fmt: skip
        _gemv_phase(w + OFF_DOWN, gu_ptr + layer * 2 * INTER, h_ptr + (layer + 1) * HID, pid,
                    programs, HID, INTER, True, BLOCK_N, BLOCK_K, STAGES)  # fmt: skip
        next_qkv = w + PER_LAYER  # the next layer's q/k/v, if any
        _prefetch_first_rows(next_qkv, pid, layer + 1 < layers, QKV, HID, BLOCK_N, PF_K)
        arrivals += programs
        _grid_sync(counter_ptr, flag_ptr, arrivals, stamp_ptr, arrivals // programs, pid,
                   MAX_SPINS, STAMPS)  # fmt: skip
        w += PER_LAYER


@triton.jit
def phase_kernel(
    w_ptr, x_ptr, out_ptr,
    N: tl.constexpr, K: tl.constexpr, SILU: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """One phase as a kernel of its own: one row block per program."""
    _gemv_phase(w_ptr, x_ptr, out_ptr, tl.program_id(0), tl.num_programs(0),
                N, K, SILU, BLOCK_N, BLOCK_K, STAGES)  # fmt: skip


class Chain:
    """The layers' weights in one buffer and every activation in its own row (a persistent
    program never re-reads an address another program rewrote during the launch)."""

    def __init__(
        self, hid: int, qkv: int, inter: int, layers: int, device: torch.device,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:  # fmt: skip
        self.hid, self.qkv, self.inter, self.layers = hid, qkv, inter, layers
        self.shapes = [(qkv, hid), (hid, hid), (2 * inter, hid), (hid, inter)]
        per_layer = sum(n * k for n, k in self.shapes)
        # 1/sqrt(K): with no residual adds, each product keeps the activations O(1)
        self.w = torch.empty(layers * per_layer, device=device, dtype=dtype)
        self.views = []
        for layer in range(layers):
            offset, mats = layer * per_layer, []
            for n, k in self.shapes:
                view = self.w[offset : offset + n * k].view(n, k)
                view.copy_(torch.randn(n, k, device=device) / k**0.5)
                mats.append(view)
                offset += n * k
            self.views.append(mats)
        new = lambda *s: torch.zeros(*s, device=device, dtype=dtype)  # noqa: E731
        self.h, self.q = new(layers + 1, hid), new(layers, qkv)
        self.o, self.gu = new(layers, hid), new(layers, 2 * inter)
        self.counter = torch.zeros(1, device=device, dtype=torch.int32)
        self.flag = torch.zeros(1, device=device, dtype=torch.int32)
        self.stamps = torch.zeros(4 * layers + 1, device=device, dtype=torch.int64)
        self.weight_bytes = self.w.numel() * self.w.element_size()

    def engine_step(self) -> torch.Tensor:
        """The engine's one-row GEMV kernels, one launch per projection."""
        h = self.h[0:1]  # [1, hid]
        for qkv, o, gate_up, down in self.views:
            q = kernels.small_linear(h, qkv)[:, : self.hid].contiguous()  # [1, hid]
            gu = kernels.small_linear(kernels.small_linear(q, o), gate_up)  # [1, 2I]
            h = kernels.silu_mul_linear(gu[:, : self.inter], gu[:, self.inter :], down)
        return h[0]

    def phase_step(self, block_n: int, block_k: int, stages: int, warps: int) -> torch.Tensor:
        """This script's GEMV body, one launch per projection."""
        for layer, mats in enumerate(self.views):
            io = [(self.h[layer], self.q[layer]), (self.q[layer], self.o[layer]),
                  (self.o[layer], self.gu[layer]), (self.gu[layer], self.h[layer + 1])]  # fmt: skip
            for j, (mat, (x, out)) in enumerate(zip(mats, io, strict=True)):
                n, k = mat.shape
                phase_kernel[(n // block_n,)](
                    mat, x, out, N=n, K=k, SILU=j == 3, BLOCK_N=block_n, BLOCK_K=block_k,
                    STAGES=stages, num_warps=warps, num_stages=stages,
                )  # fmt: skip
        return self.h[-1]

    def persistent_step(self, programs: int, block_n: int, block_k: int, stages: int,
                        warps: int, pf_k: int) -> torch.Tensor:  # fmt: skip
        """Every layer's four GEMVs in one launch of ``programs`` programs."""
        self.counter.zero_()
        persistent_chain_kernel[(programs,)](
            self.w, self.h, self.q, self.o, self.gu, self.counter, self.flag, self.stamps,
            self.layers,
            HID=self.hid, QKV=self.qkv, INTER=self.inter, BLOCK_N=block_n, BLOCK_K=block_k,
            STAGES=stages, PF_K=pf_k, MAX_SPINS=1 << 16,
            STAMPS=self.w.is_cuda, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return self.h[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1b", choices=sorted(bdl.SHAPES))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--programs", default="", help="comma list; default: the SM count")
    parser.add_argument("--block-n", type=int, default=16)
    parser.add_argument("--block-k", type=int, default=512)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--pf-k", default="0,1024", help="comma list of prefetch widths")
    parser.add_argument("--skip", default="", help="variants not to time, e.g. engine,phases")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    hid, qkv, inter = bdl.SHAPES[args.shapes]
    chain = Chain(hid, qkv, inter, args.layers, device)
    chain.h[0].copy_(torch.randn(hid, device=device))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = [int(p) for p in args.programs.split(",") if p] or [sms]
    tile = (args.block_n, args.block_k, args.stages, args.warps)
    variants = {"engine": chain.engine_step, "phases": lambda: chain.phase_step(*tile)}
    for p in programs:
        for pf in (int(v) for v in args.pf_k.split(",")):
            variants[f"persistent_p{p}_pf{pf}"] = lambda p=p, pf=pf: chain.persistent_step(
                p, *tile, pf
            )
    if args.skip:  # a process's fourth CUDA graph slows every graph's launches (NOTES section 28)
        variants = {k: v for k, v in variants.items() if k not in args.skip.split(",")}

    def activations() -> torch.Tensor:  # every layer's (the last ones are tiny: no norms)
        return torch.cat([t.flatten().float() for t in (chain.h, chain.q, chain.o, chain.gu)])

    chain.phase_step(*tile)
    ref = activations()  # eager, no graph
    runs = {}
    for name, step in variants.items():
        chain.flag.zero_()
        step()
        out = activations()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        runs[name] = {"graph": graph, "out": out, "times": [],
                      "gave_up": int(chain.flag.item())}  # fmt: skip
    bdl.time_alternately(runs, args.rounds, args.replays)
    phase_names = ("qkv", "o", "gate_up", "down")
    for name in variants:
        if name.startswith("persistent"):  # one more replay: its phases' clock stamps
            runs[name]["graph"].replay()
            torch.cuda.synchronize()
            ns = chain.stamps.diff().view(args.layers, 4).double()  # [L, 4] phase + barrier
            runs[name]["phases"] = {
                phase: {"us": statistics.median(ns[:, j].tolist()) / 1e3,
                        "tb_per_s": n * k * 2 / statistics.median(ns[:, j].tolist()) / 1e3}
                for j, (phase, (n, k)) in enumerate(zip(phase_names, chain.shapes, strict=True))
            }  # fmt: skip
    rows = []
    for name in variants:
        run = runs[name]
        us = statistics.median(run["times"])
        diff = (run["out"] - ref).abs().max().item()
        rel = diff / ref.abs().max().item()
        tbs = chain.weight_bytes / (us * 1e-6) / 1e12
        rows.append({"variant": name, "us_per_step": us, "us_per_layer": us / args.layers,
                     "tb_per_s": tbs, "times": run["times"], "max_abs_diff_vs_phases": diff,
                     "max_rel_diff_vs_phases": rel, "barrier_gave_up": run["gave_up"]})  # fmt: skip
        print(f"{name:>24s}: {us:8.1f} us/step {us / args.layers:6.2f} us/layer {tbs:5.2f} TB/s  "
              f"diff vs phases {diff:.1e} (rel {rel:.1e})  gave up {run['gave_up']}  "
              f"{[round(t, 1) for t in run['times']]}", flush=True)  # fmt: skip
        if "phases" in run:
            rows[-1]["phases"] = run["phases"]
            print(" " * 26 + "  ".join(f"{p} {v['us']:.2f} us ({v['tb_per_s']:.2f} TB/s)"
                                       for p, v in run["phases"].items()), flush=True)  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"device": torch.cuda.get_device_name(device), "sms": sms,
                  "layers": args.layers, "weight_bytes": chain.weight_bytes,
                  "block_n": args.block_n, "block_k": args.block_k, "stages": args.stages,
                  "warps": args.warps, "rows": rows}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
