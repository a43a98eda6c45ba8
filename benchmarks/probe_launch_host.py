"""Host microseconds per launch of one of our Triton kernels, by launch path, at the 1B model's
shapes (128 rows of hidden 2048, bf16; CUDA only): ``kernel[grid](...)`` (Triton's
``JITFunction.run``), :class:`paged_ops.backends.triton_launch.Launcher`, the compiled kernel's C
launcher called directly (the floor of any Python path), and for scale ``torch.empty``,
``F.linear`` and ``paged_ops::small_linear`` (the dispatcher and its checks over ``F.linear``).

Each case runs 2,000 times without a sync after a warm-up; the figure is host time per call.
Results: benchmarks/NOTES.md section 36.

    python benchmarks/probe_launch_host.py --out benchmarks/results/launch_host_h200.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import paged_ops.linear  # noqa: F401  (registers paged_ops::small_linear)


def host_us(call, n: int = 2000) -> float:  # noqa: ANN001
    """Median of 5 rounds of ``n`` calls: host microseconds per call (no sync inside a round)."""
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            call()
        rounds.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[2]


def main() -> None:
    import triton

    from paged_ops.backends import triton_norm_linear_kernels as nk
    from paged_ops.backends.triton_launch import Launcher

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--out", default=None)
    m = parser.parse_args().rows
    args = parser.parse_args()
    dev, dt, k = "cuda", torch.bfloat16, 2048
    x, r = torch.randn(m, k, device=dev, dtype=dt), torch.randn(m, k, device=dev, dtype=dt)
    g = torch.ones(k, device=dev, dtype=dt)
    h, y = torch.empty_like(x), torch.empty_like(x)
    w = torch.randn(3072, k, device=dev, dtype=dt) / 45  # [N, K]
    block = triton.next_power_of_2(k)
    kernel_args = (x, r, g, h, y, k, x.stride(0), r.stride(0), 1e-5)
    options = dict(BLOCK_K=block, num_warps=max(1, min(16, block // 256)))
    kernel = nk.add_rms_norm_kernel
    fast = Launcher(kernel)
    compiled = kernel[(m,)](*kernel_args, **options)
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    stream = torch.cuda.current_stream().cuda_stream
    all_args = (*kernel_args, block)

    cases = {
        "kernel[grid] (JITFunction.run)": lambda: kernel[(m,)](*kernel_args, **options),
        "Launcher": lambda: fast[(m,)](*kernel_args, **options),
        "compiled.run direct": lambda: run(
            m, 1, 1, stream, function, packed, None, None, None, *all_args
        ),  # fmt: skip
        "nk.add_rms_norm (wrapper: 2 empties + launch)": lambda: nk.add_rms_norm(x, r, g, 1e-5),
        "torch.empty(device=str)": lambda: torch.empty((m, k), device=dev, dtype=dt),
        "torch.empty(device=x.device)": lambda: torch.empty((m, k), device=x.device, dtype=x.dtype),
        "x.new_empty": lambda: x.new_empty((m, k)),
        "torch.empty_like": lambda: torch.empty_like(x),
        "torch.cuda.current_stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "F.linear [128, 2048] x [3072, 2048]": lambda: F.linear(y, w),
        "paged_ops::small_linear (same)": lambda: torch.ops.paged_ops.small_linear(y, w, None),
        "torch.cuda.current_device": torch.cuda.current_device,
    }
    results = {}
    with torch.inference_mode():
        for name, call in cases.items():
            results[name] = host_us(call)
            print(f"{name:48s} {results[name]:7.2f} us", flush=True)
        ref_h, ref_y = nk.add_rms_norm(x, r, g, 1e-5)
        fast[(m,)](*kernel_args, **options)
        torch.cuda.synchronize()
        same = torch.equal(h, ref_h) and torch.equal(y, ref_y)
        print(f"Launcher's output equals the wrapper's: {same}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=m, host_us=results,
                           launcher_output_equal=same), f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
