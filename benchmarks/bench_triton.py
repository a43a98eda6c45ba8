"""Benchmark the triton backend's paged attention: decode bandwidth, prefill FLOP/s, tile sweeps.

Times are CUDA-graph replays (launch overhead excluded, as in a served decode step), median of
several replays of ``--calls`` back-to-back kernel calls. Decode reports KV bytes read per second
(the bound that matters); prefill reports causal attention FLOP/s (4 * Hq * D per visible pair).

    python benchmarks/bench_triton.py --json out.json [--sweep]
    python benchmarks/bench_triton.py --head-dim 256 --sweep --sweep-kinds decode   # D=256 tiles
    python benchmarks/bench_triton.py --kv-dtype fp8_e4m3 --sweep --sweep-kinds decode  # FP8 cache
    python benchmarks/bench_triton.py --compare '' num_stages=3 --rounds 5   # alternating A/B
    python benchmarks/bench_triton.py --head-dim 64 --decode-shapes 256x256 --write-kv \
        --compare '' kv_heads=1,block_q=4,tile_n=128   # A/B with the decode step's K/V write
    python benchmarks/bench_triton.py --head-dim 64 --decode-shapes 2x512,256x384 --write-kv-ab
        # write_kv + attention vs the attention kernel writing the decode step's K/V itself

With an FP8 cache (``--kv-dtype``) the decode sweep covers 64 x 4096 and 256 x 4096 (issue 11's
shapes) over ``decode_candidates`` (at D <= 64 with two KV heads per program); scales are 1.0.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
from dataclasses import asdict

import torch

from paged_ops.backends import triton as tb

HQ, HKV, D, BLOCK = 32, 8, 128, 16  # Llama-3-8B-like attention, bf16
KV_DTYPE = torch.bfloat16  # the cache's dtype (--kv-dtype); queries stay bf16
KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
DECODE = [(1, 16384), (8, 16384), (64, 4096), (256, 1024)]  # (batch, context)
PREFILL = [(4, 2048), (1, 8192)]  # (prompts, prompt length), causal


def make_step(q_lens: list[int], kv_lens: list[int], dtype=torch.bfloat16, seed: int = 0):
    """Random paged cache with shuffled block tables; returns the op's tensor arguments."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-n // BLOCK) for n in kv_lens]
    num_blocks = sum(need)
    cache = torch.randn(num_blocks, 2, BLOCK, HKV, D, device="cuda", dtype=dtype, generator=g)
    cache = cache.to(KV_DTYPE)  # [N, 2, B, Hkv, D]
    perm = torch.randperm(num_blocks, device="cuda", generator=g).int()
    table = torch.zeros(len(kv_lens), max(need), dtype=torch.int32, device="cuda")
    start = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[start : start + n]
        start += n
    query = torch.randn(sum(q_lens), HQ, D, device="cuda", dtype=dtype, generator=g)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    return query, cache, cu, lens, table


def causal_flops(prompts: int, length: int) -> float:
    """FLOPs of causal attention over ``prompts`` prompts of ``length`` tokens (4 * Hq * D per
    visible query-key pair)."""
    return 4 * HQ * D * prompts * length * (length + 1) / 2


def time_graph(fn, calls: int, replays: int = 7) -> float:
    """Seconds per call: CUDA graph of ``calls`` calls, median over replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def attention(
    args, config: tb.LaunchConfig | None = None, num_segments: int | None = None, **extra
):
    """A call of the backend's attention on ``args`` (``extra``: more of its keywords)."""
    query, cache, cu, lens, table = args
    return lambda: tb.paged_attention(
        query, cache, cu, lens, table, scale=D**-0.5, causal=True, window=0, softcap=0.0,
        sinks=None, alibi_slopes=None, config=config, num_segments=num_segments, **extra,
    )  # fmt: skip


def alternating_times(fns: list, calls: int, rounds: int) -> list[list[float]]:
    """us per call of each of ``fns`` in each of ``rounds`` rounds, the order reversed every
    other round (A/B comparisons on one GPU)."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            times[i].append(time_graph(fns[i], calls) * 1e6)
    return times


def default_config(args, plain_causal: bool = False) -> tb.LaunchConfig:
    query, cache, _, lens, table = args
    return tb.launch_config(
        num_tokens=query.shape[0], num_seqs=lens.shape[0], num_q_heads=HQ, num_kv_heads=HKV,
        head_dim=D, max_kv_len=table.shape[1] * BLOCK, num_sms=tb._num_sms(query.device),
        fp8_cache=cache.element_size() == 1, plain_causal=plain_causal,
        shared_memory=tb._shared_memory(query.device),
    )  # fmt: skip


def decode_rows(
    calls: int, shapes=DECODE, splits: tuple[int, ...] = (1,), override: dict | None = None
) -> list[dict]:
    """The default launch (with ``override``'s fields), then the same with each forced split in
    ``splits`` it does not pick."""
    rows = []
    for batch, ctx in shapes:
        args = make_step([1] * batch, [ctx] * batch)
        kv_bytes = batch * ctx * 2 * HKV * D * KV_DTYPE.itemsize
        cfg = dataclasses.replace(default_config(args), **(override or {}))
        modes = [("auto", None)] + [
            ("one_pass" if n == 1 else f"split_{n}", n) for n in splits if n != cfg.num_segments
        ]
        for label, nseg in modes:
            forced = cfg if nseg is None else dataclasses.replace(cfg, num_segments=nseg)
            sec = time_graph(attention(args, config=forced), calls)
            rows.append(
                dict(kind="decode", batch=batch, context=ctx, mode=label,
                     segments=cfg.num_segments if nseg is None else nseg,
                     us=sec * 1e6, tb_per_s=kv_bytes / sec / 1e12)
            )  # fmt: skip
    return rows


def decode_write(args) -> dict:
    """A decode step's new K/V for ``args`` (each sequence's token at its last position):
    ``paged_attention``'s ``new_key``/``new_value``/``slot_mapping`` keywords."""
    query, _, _, lens, table = args
    g = torch.Generator(device="cuda").manual_seed(1)
    batch = lens.shape[0]
    new_k = torch.randn(batch, HKV, D, device="cuda", generator=g).to(query.dtype)
    new_v = torch.randn(batch, HKV, D, device="cuda", generator=g).to(query.dtype)
    pos = lens.long() - 1
    slots = table.long().gather(1, (pos // BLOCK)[:, None])[:, 0] * BLOCK + pos % BLOCK
    return dict(new_key=new_k, new_value=new_v, slot_mapping=slots)


def compare_rows(
    calls: int, shapes, specs: list[str], rounds: int, write_kv: bool = False,
    prefill: bool = False,
) -> list[dict]:  # fmt: skip
    """Alternating A/B of launch overrides on the default decode launch: per shape, ``rounds``
    rounds that time every spec of ``specs`` (``"field=value,..."``; ``""`` is the default) back
    to back, the order reversed every other round; one row per spec with the median time, every
    round's time, and the largest output difference from the first spec's (0 for a change that
    must not alter results). ``write_kv``: each call also writes the step's K/V (the engine's
    decode steps, ``decode_write``). ``prefill``: the shapes are (prompts, prompt length) of
    causal prompts on the default plain-causal launch (the prefill kernel), with their FLOP/s."""
    rows = []
    for batch, ctx in shapes:
        q_len = ctx if prefill else 1
        args = make_step([q_len] * batch, [ctx] * batch)
        kv_bytes = batch * ctx * 2 * HKV * D * KV_DTYPE.itemsize
        flops = causal_flops(batch, ctx) if prefill else 0
        default = default_config(args, plain_causal=prefill)
        cfgs = [
            dataclasses.replace(default, **(tb.parse_launch_overrides(sp) if sp else {}))
            for sp in specs
        ]
        extra = decode_write(args) if write_kv else {}
        fns = [attention(args, config=c, **extra) for c in cfgs]
        outs = [fn() for fn in fns]
        diffs = [float((o.float() - outs[0].float()).abs().max()) for o in outs]
        times = alternating_times(fns, calls, rounds)
        for sp, t, diff in zip(specs, times, diffs, strict=True):
            us = statistics.median(t)
            rows.append(
                dict(kind="compare_prefill" if prefill else "compare", batch=batch, context=ctx,
                     spec=sp or "default", us=us, rounds_us=t, tb_per_s=kv_bytes / us / 1e6,
                     tflop_per_s=flops / us / 1e6, max_abs_diff=diff)
            )  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def write_kv_ab_rows(calls: int, shapes, rounds: int) -> list[dict]:
    """A decode step's K/V write: ``write_kv`` then the attention (two launches, the op's way)
    against the attention kernel writing them itself (``new_key``, one launch; NOTES.md section
    23), alternating rounds per shape. Each sequence's new token sits at its last position; the
    max_abs_diff of the one-launch output against the two launches' must be 0."""
    rows = []
    for batch, ctx in shapes:
        query, cache, cu, lens, table = args = make_step([1] * batch, [ctx] * batch)
        write = decode_write(args)
        new_k, new_v, slots = write["new_key"], write["new_value"], write["slot_mapping"]
        cfg = default_config(args)
        attend = attention(args, config=cfg)

        def two(cache=cache, new_k=new_k, new_v=new_v, slots=slots, attend=attend):
            tb.write_kv(new_k, new_v, cache, slots)
            return attend()

        one = attention(args, config=cfg, new_key=new_k, new_value=new_v, slot_mapping=slots)
        reference = two()
        cache_after = cache.clone()
        cache[slots // BLOCK, :, slots % BLOCK] = 0  # the new rows stale again
        out = one()
        diff = float((out.float() - reference.float()).abs().max())
        same_rows = torch.equal(cache, cache_after)  # one() wrote exactly what write_kv wrote
        times = alternating_times([two, one], calls, rounds)
        for label, t in zip(("write_kv+attention", "attention writes"), times, strict=True):
            rows.append(dict(kind="write_kv_ab", batch=batch, context=ctx, spec=label,
                             us=statistics.median(t), rounds_us=t, segments=cfg.num_segments,
                             max_abs_diff=diff, new_rows_equal=same_rows))  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def prefill_rows(calls: int, with_unified: bool = False) -> list[dict]:
    """Causal prefill with the default launch (the prefill kernel); ``with_unified`` adds the
    unified kernel's launch for the same step (mode "unified")."""
    rows = []
    for n, length in PREFILL:
        args = make_step([length] * n, [length] * n)
        flops = causal_flops(n, length)
        modes = [("auto", None)] + ([("unified", default_config(args))] if with_unified else [])
        for label, cfg in modes:
            sec = time_graph(attention(args, config=cfg), calls)
            rows.append(
                dict(kind="prefill", batch=n, context=length, mode=label, segments=1,
                     us=sec * 1e6, tflop_per_s=flops / sec / 1e12)
            )  # fmt: skip
    return rows


def write_kv_row(calls: int) -> dict:
    t = 8192
    cache = torch.zeros(t // BLOCK, 2, BLOCK, HKV, D, device="cuda", dtype=torch.bfloat16)
    key, value = (torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    slots = torch.randperm(t, device="cuda")
    sec = time_graph(lambda: tb.write_kv(key, value, cache, slots), calls)
    moved = 2 * 2 * t * HKV * D * 2  # K and V, read + write, bf16
    return dict(kind="write_kv", batch=t, us=sec * 1e6, tb_per_s=moved / sec / 1e12)


def decode_candidates(
    group: int,
    nsegs: list[int],
    kv_heads: int = 1,
    v_pairs: int = 0,
    caps: tuple[int | None, ...] = (None, 128),
    warps: tuple[int, ...] = (4,),
    tiles: tuple[int, ...] = (64, 128),
) -> list[tb.LaunchConfig]:
    """Decode candidates (FP8 sweep; bf16 with ``--sweep-kinds decode,pairs``): ``tiles`` wide, 2 or 3
    stages, each register cap of ``caps`` (None: uncapped; 128: four programs per SM at 4 warps;
    168: three), each of ``warps`` warps per program, ``kv_heads`` KV heads per program,
    ``v_pairs`` (FP8: V read as int16 pairs, the default since run 7); heads-first grid and
    first-blocks layout, as the default decode launch (sweeps 9-12 ran the candidates without the
    heads-first grid: ~1.2% slower at 256 x 4096).
    (5 stages, tried in sweeps 6-7 to keep two K/V tiles in flight, never won: dropped.)"""
    block_q = 16 // (group * kv_heads)
    fields = dict(kv_heads=kv_heads, heads_fastest=1, v_pairs=v_pairs, first_blocks=1)
    return [
        tb.LaunchConfig(16, block_q, tn, ns, w, st, maxnreg=cap, **fields)
        for tn, ns, st, cap, w in itertools.product(tiles, nsegs, [2, 3], caps, warps)
    ]


def sweep(
    calls: int,
    kinds: set[str],
    caps: tuple[int | None, ...] = (None, 128),
    decode_shapes: tuple[tuple[int, int], ...] | None = None,
    warps: tuple[int, ...] = (4,),
    tiles: tuple[int, ...] = (64, 128),
    splits: tuple[int, ...] | None = None,
) -> list[dict]:
    """Tile/warp/stage(/segment) sweep for one prefill and two decode shapes (``decode_shapes``
    replaces the latter); failures recorded. ``caps``, ``warps``, ``tiles``, ``splits``: the
    register caps, warp counts, KV tile widths and splits of the FP8/pairs decode candidates."""
    group = HQ // HKV
    shapes = {}
    if "prefill" in kinds:
        prefill = (make_step([2048] * 4, [2048] * 4), [64, 128], [32, 64, 128], [4, 8], [2, 3])
        shapes["prefill_4x2048"] = prefill
    fp8 = KV_DTYPE.itemsize == 1
    if "decode" in kinds:
        grid_tiles = [16, 32, 64] + ([128] if D <= 64 else [])  # the bf16 grid's (not ``tiles``)
        if decode_shapes is None:
            decode_shapes = ((64, 4096), (256, 4096)) if fp8 else ((8, 16384), (64, 4096))
        for batch, ctx in decode_shapes:
            step = make_step([1] * batch, [ctx] * batch)
            shapes[f"decode_{batch}x{ctx}"] = (step, [16], grid_tiles, [2, 4, 8], [2, 3])
    rows = []
    for name, (args, block_ms, tile_ns, grid_warps, stages) in shapes.items():
        default = default_config(args)
        nseg = default.num_segments
        nsegs = [nseg] if nseg == 1 else [nseg, 2 * nseg]
        # two KV heads per program: FP8's default at D <= 64; others with --sweep-kinds ...,pairs
        pairs = name.startswith("decode") and ((fp8 and D <= 64) or "pairs" in kinds)
        if pairs:
            segs = list(splits or (1, 2, 4))
            configs = [default, *decode_candidates(group, segs, 2, int(fp8), caps, warps, tiles)]
        elif fp8 and name.startswith("decode"):
            segs = list(splits or sorted({1, 2, nseg}))
            configs = [default, *decode_candidates(group, segs, 1, 1, caps, warps, tiles)]
        else:  # decode candidates take the default decode launch's grid order and layout
            grid = dict(heads_fastest=1, first_blocks=1) if name.startswith("decode") else {}
            configs = [
                tb.LaunchConfig(bm, bm // group, tn, ns, w, st, **grid)
                for bm, tn, w, st, ns in itertools.product(
                    block_ms, tile_ns, grid_warps, stages, nsegs
                )
            ]
        # a discarded first timing: the first row of a shape read ~10% slow in sweeps 6 and 7
        # (H100; the same config later in the sweep did not), which is warm-up, not the config
        time_graph(attention(args, config=default), max(calls // 4, 2), replays=3)
        for cfg in configs:
            try:
                sec = time_graph(attention(args, config=cfg), max(calls // 4, 2), replays=3)
                rows.append(dict(shape=name, **asdict(cfg), us=sec * 1e6))
            except Exception as e:  # out of shared memory / registers: record and go on
                rows.append(dict(shape=name, **asdict(cfg), error=type(e).__name__))
            rows[-1]["default"] = cfg is default
            print(json.dumps(rows[-1]), flush=True)  # as it comes: a long sweep may time out
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-kinds", default="decode,prefill", help="what --sweep covers; "
                        "'pairs': decode with two KV heads per program (FP8 at D <= 64 always)")  # fmt: skip
    parser.add_argument("--head-dim", type=int, default=D, help="head size of every shape")
    parser.add_argument("--decode-shapes", default=",".join(f"{b}x{c}" for b, c in DECODE),
                        help="decode rows: batch x context list")  # fmt: skip
    parser.add_argument("--splits", default="1", help="decode rows: forced splits beside the "
                        "default launch, e.g. 1,2,4 (the default's tiles, warps, stages)")  # fmt: skip
    parser.add_argument("--override", default=None, help="decode rows: LaunchConfig fields "
                        "replacing the default's, e.g. num_stages=2,maxnreg=128")  # fmt: skip
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="bf16",
                        help="the cache's dtype (queries stay bf16)")  # fmt: skip
    parser.add_argument("--sweep-caps", default="none,128", help="register caps of the FP8/pairs "
                        "decode candidates, e.g. none,128,168")  # fmt: skip
    parser.add_argument("--sweep-warps", default="4", help="warps per program of the FP8/pairs "
                        "decode candidates, e.g. 2,4,8")  # fmt: skip
    parser.add_argument("--sweep-tiles", default="64,128", help="KV tile widths of the FP8/pairs "
                        "decode candidates")  # fmt: skip
    parser.add_argument("--sweep-splits", default=None, help="splits of the FP8/pairs decode "
                        "candidates (default: 1, 2 and the default launch's)")  # fmt: skip
    parser.add_argument("--sweep-shapes", default=None, help="decode shapes of --sweep (batch "
                        "x context list; default 64x4096,256x4096 FP8, else 8x16384,64x4096)")  # fmt: skip
    parser.add_argument("--compare", nargs="+", default=None, metavar="SPEC",
                        help="instead of the tables: alternating rounds of these launch "
                        "overrides on the decode shapes ('' = the default launch), e.g. "
                        "'' num_stages=3 tile_n=64")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5, help="rounds of --compare")
    parser.add_argument("--compare-prefill", default=None, metavar="SHAPES",
                        help="--compare on causal prompts instead of the decode shapes: "
                        "prompts x length list, e.g. 4x2048,1x8192")  # fmt: skip
    parser.add_argument("--write-kv", action="store_true", help="--compare: every call also "
                        "writes the decode step's K/V (the engine's decode steps)")  # fmt: skip
    parser.add_argument("--write-kv-ab", action="store_true", help="instead of the tables: "
                        "write_kv + attention vs the attention kernel writing the decode step's "
                        "K/V itself, alternating rounds on the decode shapes")  # fmt: skip
    a = parser.parse_args()
    globals()["D"] = a.head_dim  # every helper reads the module's D and KV_DTYPE
    globals()["KV_DTYPE"] = KV_DTYPES[a.kv_dtype]
    device = torch.cuda.get_device_name()
    print(f"# {device}, torch {torch.__version__}, Hq={HQ} Hkv={HKV} D={D} page={BLOCK}, "
          f"bf16 queries, {a.kv_dtype} cache")  # fmt: skip
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.decode_shapes.split(",")]
    splits = tuple(int(n) for n in a.splits.split(","))
    override = tb.parse_launch_overrides(a.override) if a.override else None
    if a.write_kv_ab or a.compare:
        if a.write_kv_ab:
            rows = write_kv_ab_rows(a.calls, shapes, a.rounds)
        else:
            prefill = a.compare_prefill is not None
            if prefill:
                shapes = [tuple(int(x) for x in s.split("x")) for s in a.compare_prefill.split(",")]
            rows = compare_rows(a.calls, shapes, a.compare, a.rounds, a.write_kv, prefill)
            print(f"{'batch':>6} {'ctx':>6} {'spec':28} {'median us':>10} {'TB/s':>6} "
                  f"{'TFLOP/s':>8} {'max diff':>9}")  # fmt: skip
            for r in rows:
                print(f"{r['batch']:>6} {r['context']:>6} {r['spec']:28} {r['us']:>10.1f} "
                      f"{r['tb_per_s']:>6.2f} {r['tflop_per_s']:>8.0f} "
                      f"{r['max_abs_diff']:>9.2e}")  # fmt: skip
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(device=device, torch=torch.__version__, head_dim=D,
                               kv_dtype=a.kv_dtype, rows=rows), f, indent=1)  # fmt: skip
        return
    rows = decode_rows(a.calls, shapes, splits, override)
    if KV_DTYPE.itemsize == 2:  # the KV-write row is a bf16 measurement
        rows += [*prefill_rows(a.calls), write_kv_row(a.calls)]
    else:  # FP8 cache: the prefill kernel and the unified one
        rows += prefill_rows(a.calls, with_unified=True)
    print(f"{'kind':8} {'batch':>6} {'ctx':>6} {'mode':9} {'seg':>3} {'us':>9} {'figure':>16}")
    for r in rows:
        fig = (
            f"{r['tflop_per_s']:.0f} TFLOP/s" if "tflop_per_s" in r else f"{r['tb_per_s']:.2f} TB/s"
        )
        print(
            f"{r['kind']:8} {r['batch']:>6} {r.get('context', ''):>6} {r.get('mode', ''):9} "
            f"{r.get('segments', ''):>3} {r['us']:>9.1f} {fig:>16}"
        )
    result = dict(
        device=device, torch=torch.__version__, head_dim=D, kv_dtype=a.kv_dtype, rows=rows
    )
    if a.sweep:
        caps = tuple(None if c == "none" else int(c) for c in a.sweep_caps.split(","))
        sweep_shapes = None
        if a.sweep_shapes:
            sweep_shapes = tuple(
                tuple(int(x) for x in s.split("x")) for s in a.sweep_shapes.split(",")
            )
        result["sweep"] = sweep(
            a.calls,
            set(a.sweep_kinds.split(",")),
            caps,
            sweep_shapes,
            tuple(int(w) for w in a.sweep_warps.split(",")),
            tuple(int(t) for t in a.sweep_tiles.split(",")),
            tuple(int(n) for n in a.sweep_splits.split(",")) if a.sweep_splits else None,
        )
        for name in sorted({r["shape"] for r in result["sweep"]}):
            ok = [r for r in result["sweep"] if r["shape"] == name and "us" in r]
            for r in sorted(ok, key=lambda r: r["us"])[:3]:
                print(f"sweep {name}: {r['us']:.1f} us  {r}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
