"""A decode step's projections as one CUDA graph: cuBLAS vs the Triton GEMV's launch choices.

``bench_linear.py`` times one shape at a time, the same kernel back to back. A decode step at
batch 1 is a chain of different kernels: per layer q/k/v, attention, o, add + norm, gate/up,
SiLU-mul, down, add; each matmul waits for the kernel before it, so its ramp-up (the first
weight bytes in flight) and the gap between kernels count as much as its streaming rate. This
script captures that chain for ``--layers`` layers of a model's shapes (distinct weights per layer,
so nothing is served from L2) in one CUDA graph, with cheap pointwise kernels standing in for the
non-matmul work (``--pointwise 0`` leaves them out: matmul after matmul), and times replays with
CUDA events, variants interleaved over ``--rounds`` (order reversed every other round).

A variant is ``NAME`` or ``NAME:key=value,...``: ``cublas`` (``F.linear``) or ``triton`` with any
:class:`~paged_ops.backends.triton_linear_kernels.LinearConfig` field (``block_n``, ``block_k``,
``num_warps``, ``num_stages``, ``pdl``, ``prefetch_k``) and ``down_split`` (split-K of the deep
down projection; the others use ``split_k``, default 1). Every variant's output is compared with
cuBLAS's (bf16: differences of accumulation order only).

    python benchmarks/bench_decode_linears.py --ms 1,2 --variants cublas triton \\
        "t16:block_n=16,down_split=1" "t16pdl:block_n=16,down_split=1,pdl=True,prefetch_k=1024" \\
        --out benchmarks/results/decode_linears_h200.json
    TRITON_INTERPRET=1 python benchmarks/bench_decode_linears.py --device cpu --shapes tiny \\
        --layers 2 --ms 1 --variants cublas "t:block_n=16"    # CPU smoke test (float32)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from paged_ops.backends import triton_linear_kernels as kernels  # noqa: E402

SHAPES = {  # model: (hidden, q/k/v rows, intermediate)
    "1b": (2048, 3072, 8192),
    "8b": (4096, 6144, 14336),
    "tiny": (128, 192, 256),
}
CONFIG_FIELDS = {f.name for f in dataclasses.fields(kernels.LinearConfig)}


@dataclasses.dataclass
class Variant:
    name: str
    impl: str  # "cublas" or "triton"
    fields: dict
    down_split: int | None

    def config(self, m: int, n: int, k: int, dtype: torch.dtype, deep: bool):
        """The LinearConfig of one matmul (None: cuBLAS)."""
        if self.impl == "cublas":
            return None
        base = kernels.linear_config(m, n, k, dtype, 132)
        fields = dict(self.fields)
        if deep and self.down_split is not None:
            fields["split_k"] = self.down_split
        return dataclasses.replace(base, **fields)


def parse_variant(text: str) -> Variant:
    name, _, body = text.partition(":")
    fields, impl, down_split = {}, "triton", None
    if name == "cublas" and not body:
        impl = "cublas"
    for item in filter(None, (p.strip() for p in body.split(","))):
        key, _, raw = item.partition("=")
        value = ast.literal_eval(raw)
        if key == "down_split":
            down_split = value
        elif key in CONFIG_FIELDS:
            fields[key] = value
        else:
            raise SystemExit(f"variant {text!r}: unknown key {key!r}")
    return Variant(name, impl, fields, down_split)


def make_layers(hidden: int, qkv: int, inter: int, layers: int, dtype, device) -> list[dict]:
    def w(n: int, k: int) -> torch.Tensor:
        # 1/K (not 1/sqrt(K)): the residual stream stays O(1) over the layers, no overflow
        return torch.randn(n, k, device=device, dtype=dtype) / k  # [N, K]

    return [
        {"qkv": w(qkv, hidden), "o": w(hidden, hidden), "gate_up": w(2 * inter, hidden),
         "down": w(hidden, inter)}
        for _ in range(layers)
    ]  # fmt: skip


def make_step(variant: Variant, layers: list[dict], m: int, pointwise: bool) -> Callable:
    """``x [M, hidden] -> [M, hidden]``: the layers' matmuls, with stand-in pointwise kernels."""
    hidden = layers[0]["o"].shape[0]
    inter = layers[0]["down"].shape[1]
    dtype = layers[0]["o"].dtype

    def lin(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        n, k = weight.shape
        config = variant.config(m, n, k, dtype, deep=k >= 8192 or k == inter)
        if config is None:
            return F.linear(x, weight)
        return kernels.small_linear(x, weight, None, config)

    def step(x: torch.Tensor) -> torch.Tensor:
        h = x  # [M, hidden]
        for w in layers:
            a = lin(h * 0.5 if pointwise else h, w["qkv"])[:, :hidden]  # [M, hidden]
            if pointwise:
                a = a * 0.5  # attention's place
            h = h + lin(a.contiguous(), w["o"])  # [M, hidden]
            gu = lin(h, w["gate_up"])  # [M, 2 * inter]
            act = gu[:, :inter] * gu[:, inter:] if pointwise else gu[:, :inter].contiguous()
            h = h + lin(act, w["down"])
        return h

    return step


def time_graph(graph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays  # us per replay


def time_alternately(runs: dict[str, dict], rounds: int, replays: int) -> None:
    """Append to each ``runs[name]["times"]`` the us per replay of ``runs[name]["graph"]``,
    ``rounds`` times, every other round in reverse order (3 warm replays before each timing)."""
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            time_graph(runs[name]["graph"], 3)
            runs[name]["times"].append(time_graph(runs[name]["graph"], replays))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ms", default="1,2", help="rows (tokens) per step, comma-separated")
    parser.add_argument("--variants", nargs="+", default=["cublas", "triton"])
    parser.add_argument("--pointwise", type=int, default=1, choices=(0, 1))
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    layers = make_layers(*SHAPES[args.shapes], args.layers, dtype, device)
    weight_bytes = sum(w.numel() * w.element_size() for layer in layers for w in layer.values())
    variants = [parse_variant(v) for v in args.variants]
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "shapes": args.shapes, "layers": args.layers, "pointwise": args.pointwise,
               "weight_bytes": weight_bytes, "rows": []}  # fmt: skip
    for m in (int(v) for v in args.ms.split(",")):
        x = torch.randn(m, layers[0]["o"].shape[0], device=device, dtype=dtype)  # [M, hidden]
        runs, ref = {}, None
        for variant in variants:
            step = make_step(variant, layers, m, bool(args.pointwise))
            out = step(x)  # compiles the Triton kernels outside the graph
            ref = out if ref is None else ref
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            graph = None
            if device.type == "cuda":
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step(x)
            runs[variant.name] = {"graph": graph, "err": err, "times": []}
        if device.type == "cuda":
            time_alternately(runs, args.rounds, args.replays)
        base = None
        for variant in variants:
            run = runs[variant.name]
            us = statistics.median(run["times"]) if run["times"] else float("nan")
            base = us if base is None else base
            row = {"m": m, "variant": variant.name, "spec": dataclasses.asdict(variant),
                   "us_per_step": us, "us_per_layer": us / args.layers, "times": run["times"],
                   "tb_per_s": weight_bytes / us / 1e6 if run["times"] else None,
                   "vs_first": base / us if run["times"] else None, "max_rel_err": run["err"]}  # fmt: skip
            results["rows"].append(row)
            print(
                f"M={m:2d} {variant.name:>14s}: {us:9.1f} us/step {us / args.layers:7.2f} us/layer "
                f"{row['tb_per_s'] or 0:5.2f} TB/s  x{row['vs_first'] or 0:5.3f} vs first  "
                f"err {run['err']:.2e}  rounds {[round(t, 1) for t in run['times']]}",
                flush=True,
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
