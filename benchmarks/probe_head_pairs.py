"""Probe before building two KV heads per program: does FP8 decode at D=64 read like D=128?

A D=64 FP8 row of one KV head is 64 bytes; two neighbouring heads' rows are 128 contiguous bytes.
Hkv=4 x D=128 moves the same bytes as Hkv=8 x D=64 with the same access pattern (128-byte rows at a
512-byte stride) and the same programs per step, so its time predicts a D=64 kernel that reads
heads in pairs. Prints decode rows (default launch and forced splits) for both, with bf16 D=64 and
FP8 D=128 beside them, and writes them as JSON (H100 result: benchmarks/NOTES.md section 10).

    python benchmarks/probe_head_pairs.py out.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_triton as bt  # noqa: E402

CASES = (("fp8_e4m3", 8, 64), ("fp8_e4m3", 4, 128), ("bf16", 8, 64), ("fp8_e4m3", 8, 128))


def main() -> None:
    rows = []
    for kv, hkv, d in CASES:
        bt.HKV, bt.D, bt.KV_DTYPE = hkv, d, bt.KV_DTYPES[kv]  # bench_triton's module geometry
        for row in bt.decode_rows(20, [(64, 4096), (256, 4096)], (1, 2, 4)):
            rows.append(dict(row, kv=kv, hkv=hkv, d=d))
            print(json.dumps(rows[-1]), flush=True)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
