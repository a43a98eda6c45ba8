"""Compile the triton backend's decode kernel for a GPU offline and count its inner loop's SASS.

No GPU needed: Triton compiles for ``--arch`` (default sm_90, the H100/H200) with the same
specialisations its JIT makes at run time (unit strides as constants, 16-divisible pointers and
strides), and the ``nvdisasm``/``cuobjdump`` that Triton's wheel ships disassemble the cubin. For
each configuration it prints the registers, the local-memory stack (spills), the instructions of
the longest loop (the KV-tile loop) per thread and per tile of the CTA, the opcode mix and the
widths of the global / shared loads. Codegen depends on the Triton version: use the one the GPU
runs (3.6 on the lent machines: ``pip install triton==3.6.0`` in a spare venv) to predict it.

    python benchmarks/inspect_sass.py --kv fp8,bf16 --head-dim 128 --configs 128/3/4,64/2/4
    python benchmarks/inspect_sass.py --kv fp8 --configs 128/3/4 --maxnreg 128 --json out.json

A configuration is ``tile_n/num_stages/num_warps``; GQA group 4, 16-row M tile, page 16, the
heads-first grid, two split-KV segments unless ``--segments`` says otherwise.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, even from an interpreter session
KERNELS = Path(__file__).resolve().parent.parent / "paged_ops" / "backends" / "triton_kernels.py"
UNIT_STRIDES = ("stride_cd", "stride_qd")  # the JIT specialises arguments equal to 1
UNALIGNED = ("stride_ks", "stride_vs")  # 0 or 1: no divisibility


def load_kernels():
    """The kernel module alone (no torch: it only needs triton)."""
    spec = importlib.util.spec_from_file_location("paged_ops_triton_kernels", KERNELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_decode(kv: str, head_dim: int, tile_n: int, stages: int, warps: int, arch: int,
                   maxnreg: int | None = None, kv_heads: int = 1, v_pairs: bool = False,
                   segments: int = 2, first_blocks: bool = False) -> tuple[bytes, int]:  # fmt: skip
    """The cubin of ``paged_attention_kernel`` for one decode launch (bf16 queries) and its
    shared memory in bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = load_kernels().paged_attention_kernel
    names = list(inspect.signature(fn.fn).parameters)
    fp8 = kv == "fp8"
    const = dict(
        BLOCK_SIZE=16, GROUP=4 * kv_heads, BLOCK_Q=4 // kv_heads, BLOCK_M=16, TILE_N=tile_n, D_PAD=head_dim,
        HEAD_DIM=head_dim, CAUSAL=True, USE_WINDOW=False, USE_SOFTCAP=False, USE_SINKS=False,
        USE_ALIBI=False, NUM_SEGMENTS=segments, IEEE_DOT=False, USE_K_SCALE=fp8, USE_V_SCALE=fp8,
        FP8_CACHE=fp8, FP8_BITS=False, FP8_MAN=3, FP8_BIAS=7, FP8_SUB_ULP=2.0**-9, F16_DOT=fp8,
        KV_HEADS=kv_heads, V_PAIRS=fp8 and v_pairs, FIRST_BLOCKS=first_blocks, WRITE_KV=False, ROPE=False,
        HEADS_FASTEST=True, **{n: 1 for n in UNIT_STRIDES},
    )  # fmt: skip
    pointers = {
        "q_ptr": "*bf16",
        "cache_ptr": "*fp8e4nv" if fp8 else "*bf16",
        "cache_pairs_ptr": "*i16",
    }
    signature = {}
    for n in names:
        if n in const:
            signature[n] = "constexpr"
        elif n.endswith("_ptr"):
            signature[n] = pointers.get(n, "*i32" if n in ("cu_ptr", "seq_lens_ptr",
                                                         "block_table_ptr") else "*fp32")  # fmt: skip
        elif n in ("scale", "softcap"):
            signature[n] = "fp32"
        else:
            signature[n] = "i32"
    aligned = [
        n for n in names if n not in const and (n.endswith("_ptr") or n.startswith("stride_"))
        and n not in UNALIGNED
    ]  # fmt: skip
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in const.items() if k in names},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    kernel = triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=warps, num_stages=stages, maxnreg=maxnreg),
    )
    return kernel.asm["cubin"], kernel.metadata.shared


def tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def loop_mix(sass: str) -> tuple[int, collections.Counter]:
    """Instructions of the longest backward-branch loop and their opcodes (without modifiers)."""
    labels, instrs = {}, []
    for line in sass.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            instrs.append(m.group(1).strip())
    loops = []
    for i, text in enumerate(instrs):
        m = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", text)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            loops.append((i - labels[m.group(1)], labels[m.group(1)], i))
    if not loops:
        return 0, collections.Counter()
    _, start, end = max(loops)
    ops = collections.Counter()
    for text in instrs[start : end + 1]:
        op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
        ops[op.split(".")[0]] += 1
    return end - start + 1, ops


def inspect_config(kv: str, head_dim: int, tile_n: int, stages: int, warps: int, arch: int,
                   maxnreg: int | None = None, kv_heads: int = 1, v_pairs: bool = False,
                   segments: int = 2, first_blocks: bool = False) -> dict:  # fmt: skip
    cubin, shared = compile_decode(
        kv,
        head_dim,
        tile_n,
        stages,
        warps,
        arch,
        maxnreg,
        kv_heads,
        v_pairs,
        segments,
        first_blocks,
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool("nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
        usage = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    size, ops = loop_mix(sass)
    loads = collections.Counter(re.findall(r"\b((?:LDG|LDS|LDSM|LDGSTS)(?:\.[A-Z0-9]+)*)", sass))
    # cp.async waits: "DEPBAR.LE SB0, n" lets n groups stay in flight (the prefetch depth)
    waits = collections.Counter(re.findall(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)", sass))
    return dict(kv=kv, head_dim=head_dim, tile_n=tile_n, stages=stages, warps=warps,
                maxnreg=maxnreg, kv_heads=kv_heads, v_pairs=v_pairs, registers=regs,
                stack_bytes=stack,
                shared_bytes=shared, loop_instructions=size,
                warp_instructions_per_128_positions=size * warps * 128 // tile_n,
                opcodes=dict(ops.most_common()), loads=dict(loads),
                cp_async_waits=dict(waits))  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv", default="fp8,bf16", help="cache dtypes: fp8 (e4m3), bf16")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--configs", default="128/3/4", help="tile_n/num_stages/num_warps list")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--maxnreg", type=int, default=None, help="register cap (Triton's maxnreg)")
    p.add_argument(
        "--kv-heads", type=int, default=1, help="KV heads per program (the kernel's KV_HEADS)"
    )
    p.add_argument(
        "--v-pairs", action="store_true", help="FP8: V read as int16 pairs (the kernel's V_PAIRS)"
    )
    p.add_argument("--segments", type=int, default=2, help="split-KV segments (NUM_SEGMENTS)")
    p.add_argument(
        "--first-blocks",
        action="store_true",
        help="each sequence's first query block first (the kernel's FIRST_BLOCKS)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import triton

    print(f"# triton {triton.__version__}, sm_{args.arch}, D={args.head_dim}, group 4, page 16")
    rows = []
    for kv in args.kv.split(","):
        for config in args.configs.split(","):
            tile_n, stages, warps = (int(x) for x in config.split("/"))
            row = inspect_config(kv, args.head_dim, tile_n, stages, warps, args.arch, args.maxnreg,
                                 args.kv_heads, args.v_pairs, args.segments,
                                 args.first_blocks)  # fmt: skip
            rows.append(row)
            top = ", ".join(f"{k} {v}" for k, v in list(row["opcodes"].items())[:8])
            print(f"{kv:>5} tile {tile_n:>3} stages {stages} warps {warps}: {row['registers']} "
                  f"regs, stack {row['stack_bytes']} B, smem {row['shared_bytes'] // 1024} KiB, loop {row['loop_instructions']} "
                  f"instr/thread = {row['warp_instructions_per_128_positions']:,} warp-instr per "
                  f"128 KV positions; cp.async waits {row['cp_async_waits']}; {top}",
                  flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
