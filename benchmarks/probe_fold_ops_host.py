"""Host time per call of the one-token folds' ops on a step of several rows (``LLM(fold_conds=
False)``'s prefill path) against Inductor's code for the model's own ops, at the 1B model's
shapes (hidden 2048, MLP 8192, head size 64, bf16; CUDA only).

Each case runs 300 times without a sync (host microseconds per call), then once more with CUDA
events; two cases are profiled with cProfile. Results: benchmarks/NOTES.md section 35.

    python benchmarks/probe_fold_ops_host.py --rows 128
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F

import paged_ops.linear  # noqa: F401  (registers the ops)
import paged_ops.mlp_linear  # noqa: F401
import paged_ops.norm_linear  # noqa: F401


def main() -> None:
    from paged_ops.backends import triton_linear_kernels as lk
    from paged_ops.backends import triton_norm_linear_kernels as nk
    from paged_ops.backends import triton_rope_kernels as rk

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    m = parser.parse_args().rows
    torch.manual_seed(0)
    dev, dt, hidden, inter, d = "cuda", torch.bfloat16, 2048, 8192, 64
    x = torch.randn(1, m, hidden, device=dev, dtype=dt)  # [1, M, H]
    r, g = torch.randn_like(x), torch.ones(hidden, device=dev, dtype=dt)
    w_qkv = torch.randn(3072, hidden, device=dev, dtype=dt) / 45  # [N, H]
    w_gu = torch.randn(2 * inter, hidden, device=dev, dtype=dt) / 45
    w_down = torch.randn(hidden, inter, device=dev, dtype=dt) / 90
    cos, sin = (
        torch.randn(1, m, d, device=dev, dtype=dt),
        torch.randn(1, m, d, device=dev, dtype=dt),
    )
    gate, up = torch.randn(1, m, 2 * inter, device=dev, dtype=dt).chunk(2, -1)  # [1, M, I] each
    qkv = torch.randn(m, 3072, device=dev, dtype=dt)
    ops = torch.ops.paged_ops

    def rows(a, b, w):  # noqa: ANN001, ANN202  (the norm fold's other branch)
        h = a + b
        hf = h.float()
        y = g * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(h.dtype)
        return F.linear(y, w), h

    compiled_rows = torch.compile(rows, dynamic=False)
    compiled_mlp = torch.compile(lambda a, b, w: F.linear(F.silu(a) * b, w), dynamic=False)
    cases = {
        "norm_linear_rope (op)": lambda: ops.add_rms_norm_linear(
            x, r, g, 1e-5, w_qkv, cos, sin, 2560
        ),  # fmt: skip
        "norm_linear (op)": lambda: ops.add_rms_norm_linear(x, r, g, 1e-5, w_gu),
        "silu_mul_linear (op)": lambda: ops.silu_mul_linear(gate, up, w_down),
        "inductor norm + linear": lambda: compiled_rows(x, r, w_gu),
        "inductor silu-mul + linear": lambda: compiled_mlp(gate, up, w_down),
        "add_rms_norm kernel": lambda: nk.add_rms_norm(
            x.view(m, hidden), r.view(m, hidden), g, 1e-5
        ),  # fmt: skip
        "rotate_columns kernel": lambda: rk.rotate_columns(
            qkv, cos.view(m, d), sin.view(m, d), 2560
        ),  # fmt: skip
        "silu_mul kernel": lambda: lk.silu_mul(gate.reshape(m, inter), up.reshape(m, inter)),
        "small_linear q/k/v": lambda: ops.small_linear(x, w_qkv, None),
        "small_linear down": lambda: ops.small_linear(gate, w_down, None),
        "F.linear q/k/v": lambda: F.linear(x, w_qkv),
    }
    with torch.inference_mode():
        for name, call in cases.items():
            for _ in range(20):
                call()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(300):
                call()
            host = (time.perf_counter() - t) / 300 * 1e6
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                call()
            end.record()
            torch.cuda.synchronize()
            print(f"{name:28s} host {host:7.1f} us  events {start.elapsed_time(end) * 20:7.1f} us")
        for name in ("norm_linear_rope (op)", "silu_mul_linear (op)"):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(300):
                cases[name]()
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
            print(name, text.getvalue()[:3500])


if __name__ == "__main__":
    main()
