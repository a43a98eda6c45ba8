"""Launch one decode attention step a few times, for Nsight Compute (``ncu``) to profile.

The step is bench_triton's (random paged cache, shuffled block tables, bf16 queries, Hq=32/Hkv=8,
page 16), with its default launch config unless ``--override`` changes fields of it. No timing here: run it under
``ncu`` (clocks left alone, as the lent machines ask) and read the stall reasons and SASS hot spots:

    ncu --clock-control none --kernel-name regex:paged_attention_kernel --launch-skip 2 \\
        --launch-count 1 --set full --page details --print-details all \\
        python benchmarks/ncu_decode.py --kv-dtype fp8_e4m3 --override maxnreg=0
"""

from __future__ import annotations

import argparse
import dataclasses

import bench_triton as bt
import torch

from paged_ops.backends import triton as tb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kv-dtype", choices=sorted(bt.KV_DTYPES), default="bf16")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--override", default=None, help="LaunchConfig fields replacing the "
                        "default's, e.g. num_stages=2,maxnreg=0 (0: no register cap)")  # fmt: skip
    parser.add_argument("--launches", type=int, default=4)
    a = parser.parse_args()
    bt.D, bt.KV_DTYPE = a.head_dim, bt.KV_DTYPES[a.kv_dtype]
    step = bt.make_step([1] * a.batch, [a.context] * a.batch)  # query, cache, cu, lens, table
    override = tb.parse_launch_overrides(a.override) if a.override else {}
    cfg = dataclasses.replace(bt.default_config(step), **override)
    print(f"{a.batch} x {a.context}, D={a.head_dim}, {a.kv_dtype} cache: {cfg}", flush=True)
    run = bt.attention(step, config=cfg)
    for _ in range(a.launches):
        run()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
