"""Decode-sized linear layers: cuBLAS (F.linear) vs paged_ops' Triton GEMV, in TB/s of weights read.

``y[M, N] = x[M, K] @ W[N, K]^T`` at M = 1..16 streams W once per call, so both are timed by the
bytes they move (W + x + y) per second, against the GPU's copy bandwidth (H100 ~3.3, H200 ~4.2 TB/s
measured by a device copy). Each row is a CUDA-graph replay of many calls (``bench_attention``'s
timing helper, median of repeats) that cycles over copies of W totalling >= 256 MiB, so the small
matrices are read from HBM, not from the 50-60 MB L2. Shapes: Llama-3.2-1B and Llama-3.1-8B's fused
q/k/v, o_proj, fused gate/up, down_proj (and the 1B lm_head), bfloat16.

``--silu-mul`` times the down projections (layers named ``down``) as the engine's one-token steps
run them since benchmarks/NOTES.md section 26: ``silu(gate) * up`` formed in the GEMV's loads
(``silu_mul_linear``) against cuBLAS after Inductor's-style SiLU-mul (two kernels), with the input
a ``[M, 2K]`` gate/up row; with ``--sweep`` the grid is swept on that kernel.

``--sweep`` times a pruned grid of launch configs per shape at M=1 and M=8 (coordinate search: column
block x dot/FMA x split-K at the default K step, then the K step, then warps x stages around the two
best) and stores the best config per shape and the default's time over the best's, so defaults can be
picked from one GPU run. ``--budget-s`` bounds the sweep's wall time (Triton compiles dominate).

    python benchmarks/bench_linear.py --out benchmarks/results/linear_h100.json
    python benchmarks/bench_linear.py --sweep --out benchmarks/results/linear_sweep_h100.json
    python benchmarks/bench_linear.py --silu-mul --shapes 1b,8b --ms 1 --sweep --sweep-ms 1 \
        --out benchmarks/results/linear_silu_sweep_h200.json
    TRITON_INTERPRET=1 python benchmarks/bench_linear.py --device cpu --shapes tiny --ms 1,5 \\
        --sweep --budget-s 60        # CPU smoke test of the script (float16, interpreter)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402 (the shared timing helper: CUDA events, graph replay)

from paged_ops.backends import triton_linear_kernels as kernels  # noqa: E402

LinearConfig = kernels.LinearConfig
SHAPES = {  # model: [(name, N, K)]
    "1b": [("qkv", 3072, 2048), ("o_proj", 2048, 2048), ("gate_up", 16384, 2048),
           ("down", 2048, 8192), ("lm_head", 128256, 2048)],
    "8b": [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
           ("down", 4096, 14336)],
    "tiny": [("qkv", 96, 128), ("down", 40, 264)],  # CPU smoke test
}  # fmt: skip
ROTATE_BYTES = 256 * 2**20  # weights cycled per timed region: > 4x an H100's L2 (50 MB)
MIN_REGION_S = 300e-6  # calls per graph so that a replay lasts at least this long
SMEM_LIMIT = 220 * 1024  # H100/H200 opt-in shared memory per block, with some slack


class Case:
    """One shape at one M: the rotated weight copies, the input, and a timer for any callable."""

    def __init__(self, n: int, k: int, m: int, dtype: torch.dtype, device: str, repeats: int,
                 silu_mul: bool = False):  # fmt: skip
        self.n, self.k, self.m, self.dtype, self.repeats = n, k, m, dtype, repeats
        self.silu_mul = silu_mul  # x is a [M, 2K] gate/up row; the product feeds the GEMV
        size = dtype.itemsize
        copies = max(1, -(-ROTATE_BYTES // (n * k * size))) if device != "cpu" else 1
        self.weights = torch.randn(copies, n, k, device=device, dtype=dtype) / k**0.5  # [C, N, K]
        width = 2 * k if silu_mul else k
        self.x = torch.randn(m, width, device=device, dtype=dtype)  # [M, K] or [M, 2K]
        self.bytes = (n * k + m * width + m * n) * size
        est = self.bytes / 3e12
        self.calls = 1 if device == "cpu" else max(copies, int(MIN_REGION_S / est) + 1)

    def time_us(self, fn) -> float:  # noqa: ANN001 (fn(x [M, K or 2K], w [N, K]) -> [M, N])
        weights, x, calls = self.weights, self.x, self.calls

        def run() -> None:
            for i in range(calls):
                fn(x, weights[i % len(weights)])

        return ba.median_seconds(run, calls, graph=True, repeats=self.repeats) * 1e6

    def tb_s(self, us: float) -> float:
        return self.bytes / us / 1e6


def triton_fn(config: LinearConfig | None, silu_mul: bool = False):
    if silu_mul:  # x [M, 2K]: gate and up are its two halves (views)
        return lambda x, w: kernels.silu_mul_linear(*x.chunk(2, -1), w, config=config)
    return lambda x, w: kernels.small_linear(x, w, None, config=config)


def reference_fn(silu_mul: bool):
    """cuBLAS, after the SiLU-mul kernel when ``silu_mul`` (what the step ran before the fold)."""
    if silu_mul:
        return lambda x, w: F.linear(_silu_mul(x), w)
    return F.linear


def _silu_mul(x: torch.Tensor) -> torch.Tensor:  # [M, 2K] -> [M, K], rounded once
    gate, up = x.float().chunk(2, -1)
    return (F.silu(gate) * up).to(x.dtype)


def fits(config: LinearConfig, m: int, dtype: torch.dtype) -> bool:
    """Configs worth compiling: valid tiles, FMA products without spills, stage buffers in smem."""
    try:
        config.check()
    except ValueError:
        return False
    if not config.use_dot and config.fma_regs(m) > 128:
        return False
    stage = (config.block_n + config.block_m(m)) * config.block_k * dtype.itemsize
    return config.num_stages * stage <= SMEM_LIMIT


def sweep_case(case: Case, num_sms: int, deadline: float) -> dict:
    """Coordinate search over launch configs for one shape and M; returns best vs default."""
    m, n, k, dtype = case.m, case.n, case.k, case.dtype
    default = kernels.linear_config(m, n, k, dtype, num_sms, silu_mul=case.silu_mul)
    tried: dict[LinearConfig, float | str] = {}

    def measure(configs: list[LinearConfig]) -> None:
        for c in configs:
            if c in tried or not fits(c, m, dtype) or time.monotonic() > deadline:
                continue
            try:
                tried[c] = case.time_us(triton_fn(c, case.silu_mul))
            except Exception as e:  # out of resources, compile errors: note it and go on
                tried[c] = f"{type(e).__name__}: {e}"[:200]

    def best(count: int) -> list[LinearConfig]:
        timed = sorted((t, str(c), c) for c, t in tried.items() if isinstance(t, float))
        return [c for _, _, c in timed[:count]]

    measure([default])
    bk = default.block_k
    grid = []
    for block_n in (8, 16, 32, 64, 128):
        tiles = -(-n // block_n)
        for split_k in (1, 2, 4, 8):
            if split_k > 1 and (tiles >= 2 * num_sms or k // split_k < 2 * bk):
                continue
            for use_dot in (True, False):
                grid.append(LinearConfig(block_n, bk, split_k, 4, 4, use_dot))
    measure(grid)
    measure([dataclasses.replace(c, block_k=b) for c in best(2) for b in (64, 128, 256, 512)])
    measure(
        [
            dataclasses.replace(c, num_warps=w, num_stages=s)
            for c in best(2)
            for w in (2, 4, 8)
            for s in (2, 3, 4, 6)
        ]
    )
    top = best(1)[0] if best(1) else None
    default_us = tried.get(default)
    return dict(
        N=n, K=k, M=m,
        default=dataclasses.asdict(default),
        default_us=default_us if isinstance(default_us, float) else None,
        best=dataclasses.asdict(top) if top else None,
        best_us=tried[top] if top else None,
        best_tb_s=case.tb_s(tried[top]) if top else None,
        default_over_best=default_us / tried[top] if top and isinstance(default_us, float) else None,
        truncated=time.monotonic() > deadline,
        tried=[dict(config=dataclasses.asdict(c), us=t if isinstance(t, float) else None,
                    error=None if isinstance(t, float) else t) for c, t in tried.items()],
    )  # fmt: skip


def compare(case: Case, num_sms: int) -> dict:
    """cuBLAS vs the default Triton config on one shape and M, plus the max abs difference."""
    w = case.weights[0]
    ours, ref = triton_fn(None, case.silu_mul)(case.x, w), reference_fn(case.silu_mul)(case.x, w)
    diff = (ours.float() - ref.float()).abs().max().item()  # [M, N] each
    cublas_us = case.time_us(reference_fn(case.silu_mul))
    triton_us = case.time_us(triton_fn(None, case.silu_mul))
    return dict(
        N=case.n, K=case.k, M=case.m, copies=len(case.weights), calls=case.calls,
        mbytes=case.bytes / 1e6, cublas_us=cublas_us, cublas_tb_s=case.tb_s(cublas_us),
        triton_us=triton_us, triton_tb_s=case.tb_s(triton_us), speedup=cublas_us / triton_us,
        max_abs_diff=diff,
        config=dataclasses.asdict(kernels.linear_config(case.m, case.n, case.k, case.dtype, num_sms,
                                                        silu_mul=case.silu_mul)),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1b,8b", help=f"comma list of {sorted(SHAPES)}")
    parser.add_argument("--ms", default="1,2,4,8,16", help="rows (tokens) per call")
    parser.add_argument("--repeats", type=int, default=7, help="timed graph replays (median)")
    parser.add_argument("--sweep", action="store_true", help="sweep configs at M=1 and M=8")
    parser.add_argument("--sweep-ms", default="1,8")
    parser.add_argument("--budget-s", type=float, default=300.0, help="wall-time cap of the sweep")
    parser.add_argument("--out", default="benchmarks/results/linear.json")
    parser.add_argument("--device", default="cuda", help="cuda; cpu = smoke test (interpreter)")
    parser.add_argument("--layers", default=None,
                        help="comma list of layer names to keep (e.g. o_proj,down)")  # fmt: skip
    parser.add_argument("--silu-mul", action="store_true",
                        help="the down projections only, their input silu(gate) * up formed in "
                             "the GEMV (cuBLAS after a SiLU-mul kernel as the reference)")  # fmt: skip
    args = parser.parse_args(argv)
    ba.DEVICE = args.device  # the shared helper times wall clock without graphs on CPU
    dtype = torch.bfloat16 if args.device != "cpu" else torch.float16  # interpreter: no bf16 dots
    cuda = args.device != "cpu"
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    num_sms = kernels.num_sms_of(torch.device(args.device))
    import triton

    settings = dict(dtype=str(dtype), rotate_mib=ROTATE_BYTES >> 20, repeats=args.repeats,
                    silu_mul=args.silu_mul,
                    timing="CUDA-graph replay of `calls` calls cycling over `copies` weight "
                           "copies (>= 256 MiB, > L2); median of repeats; bytes = W + x + y")  # fmt: skip
    out = dict(device=device_name, num_sms=num_sms, torch=torch.__version__,
               triton=triton.__version__, settings=settings, rows=[], sweep=[])  # fmt: skip

    def save() -> None:  # after every row, so a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    print(
        f"# {device_name} ({num_sms} SMs), torch {torch.__version__}, triton {triton.__version__}"
    )
    print(f"# {dtype}; weights rotated over >= {ROTATE_BYTES >> 20} MiB of copies (L2 is 50 MB on "
          f"an H100, 60 MB on an H200), CUDA-graph replays, median of {args.repeats}")  # fmt: skip
    print(f"{'model':5} {'layer':8} {'N':>6} {'K':>5} {'M':>2} | {'cuBLAS us':>9} {'TB/s':>5} | "
          f"{'triton us':>9} {'TB/s':>5} | {'speedup':>7}  config")  # fmt: skip
    shapes = [(model, *s) for model in args.shapes.split(",") for s in SHAPES[model]]
    if args.silu_mul:
        shapes = [s for s in shapes if s[1] == "down"]
    if args.layers:
        shapes = [s for s in shapes if s[1] in args.layers.split(",")]
    for model, name, n, k in shapes:
        for m in (int(v) for v in args.ms.split(",")):
            case = Case(n, k, m, dtype, args.device, args.repeats, args.silu_mul)
            r = dict(model=model, layer=name, **compare(case, num_sms))
            out["rows"].append(r)
            save()
            c = r["config"]
            print(f"{model:5} {name:8} {n:6} {k:5} {m:2} | {r['cublas_us']:9.2f} "
                  f"{r['cublas_tb_s']:5.2f} | {r['triton_us']:9.2f} {r['triton_tb_s']:5.2f} | "
                  f"{r['speedup']:6.2f}x  bn={c['block_n']} bk={c['block_k']} "
                  f"split={c['split_k']} w={c['num_warps']} s={c['num_stages']} "
                  f"{'dot' if c['use_dot'] else 'fma'}  (max|diff| {r['max_abs_diff']:.2g})")  # fmt: skip
            del case
            if cuda:
                torch.cuda.empty_cache()
    if not args.sweep:
        return
    cases = [(s, m) for m in (int(v) for v in args.sweep_ms.split(",")) for s in shapes]
    start = time.monotonic()
    print(f"\n# sweep: {len(cases)} cases, budget {args.budget_s:.0f} s")
    for i, ((model, name, n, k), m) in enumerate(cases):
        # up to twice an even share: the first cases compile kernels that later ones reuse
        remaining = args.budget_s - (time.monotonic() - start)
        deadline = min(start + args.budget_s, time.monotonic() + 2 * remaining / (len(cases) - i))
        case = Case(n, k, m, dtype, args.device, args.repeats, args.silu_mul)
        r = dict(model=model, layer=name, **sweep_case(case, num_sms, deadline))
        out["sweep"].append(r)
        save()
        b = r["best"] or {}
        best_us = r["best_us"] or float("nan")
        print(f"{model:5} {name:8} M={m:2}: default {r['default_us'] or float('nan'):8.2f} us, "
              f"best {best_us:8.2f} us ({r['best_tb_s'] or 0:.2f} TB/s, default/best "
              f"{r['default_over_best'] or float('nan'):.2f}) bn={b.get('block_n')} "
              f"bk={b.get('block_k')} split={b.get('split_k')} w={b.get('num_warps')} "
              f"s={b.get('num_stages')} {'dot' if b.get('use_dot') else 'fma'}; "
              f"{len(r['tried'])} tried{' (budget hit)' if r['truncated'] else ''}")  # fmt: skip
        del case
        if cuda:
            torch.cuda.empty_cache()
    print(f"# sweep took {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
