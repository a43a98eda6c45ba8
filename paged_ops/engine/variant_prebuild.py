"""Compile the triton attention's kernel variants (and the split-K GEMM's, where
``small_linear`` will run it) in a child process beside the first start's model compile.

Each launch configuration of the triton backend is a kernel variant that Triton compiles the
first time a step picks it (~0.5 s each on an H100 host); the warm-up's steps after the first
(``ModelRunner._warm_up_shapes``) meet them one at a time, 2.7-4.1 s of a first start
(benchmarks/NOTES.md sections 18-21). The first step's compile before them is 26-37 s of mostly
single-threaded Python (Dynamo, AOTAutograd, Inductor).

How: :func:`start` calls the backend's ``paged_attention`` once per distinct (layer kind, launch
configuration, K/V written by the kernel), on the layer's own cache (left as it was: a decode
variant that writes the K/V is given slots -1) and metadata from a builder of its own with the
engine's sizes, so every argument that Triton specialises on (dtypes, strides, the block table's
width, the sequence and token counts, pointer alignment) is what the engine's step passes. During
these calls Triton's ``jit_cache_hook`` records each new variant of a paged_ops kernel (Triton's
own serialized specialization, the data of ``JITFunction.preload``) and skips its compile, so
nothing is built or launched here; a child process (:func:`main`) then compiles the recorded
variants into Triton's on-disk cache (``TRITON_CACHE_DIR``, inherited), with a driver that only
names the GPU's target: it needs no GPU of its own. The warm-up waits for the child after its
first step; the steps then find every variant on disk (milliseconds each). A variant the child did
not build (an error, a specialisation it did not foresee) compiles in the step that meets it, as
without it.

Why a process and not a thread: a thread compiling beside Dynamo and Inductor holds up their
Python for most of its own compile time (the GIL, taken back after each of Triton's native
stages), measured on the CPU at 2.5 s of main-thread time lost for 4.1 s of compiles; an H200's
first starts had the compile phase 27-32 s without and 33-37 s with the thread (NOTES section 21).

The same goes for the split-K TMA GEMM that ``paged_ops.small_linear`` runs for 64-256 rows of a
deep, narrow weight on Hopper (:mod:`paged_ops.backends.triton_gemm_kernels`): one call per model
weight and warm-up token count that the op would send there (:func:`_call_linears`), its reduce
kernel included; they would otherwise compile in the warm-up's later steps (~1.2 s of an H200's
first start, benchmarks/NOTES.md section 32). With ``LLM(down_norm_fusion)`` (on by default)
also the kernel that sums the GEMM's partials with the next norm (an H200 first start with the
flag and without this spent 6.3 s in the later warm-up steps against 0.7 s without the flag,
section 40; with it, 22 variants built by the child and first starts of 36.0 / 36.8 s against
39.5 / 41.2 s without the flag, fresh caches on one lease, section 41).

The child also builds each variant's C launcher where Triton compiles one per kernel signature
(triton 3.6, the GPU machine's: the host's C compiler, ~0.25 s each, when a kernel first loads in
a process; :func:`build_launcher`): on an H200 first start that was ~5 s of the first step and
2.3 s of the later warm-up steps (benchmarks/NOTES.md section 42). The second child, for the
projection, norm and argmax kernels the compiled graph calls, is
:mod:`paged_ops.engine.graph_prebuild`'s.

``PAGED_OPS_PREBUILD_VARIANTS=0`` turns both off (to measure them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from paged_ops.metadata import MetadataBuilder
from paged_ops.module import PagedAttention

logger = logging.getLogger("paged_ops")

Step = tuple[int, int]  # (T tokens, S sequences)
OUR_MODULES = "paged_ops."  # kernels whose variants are recorded (others compile as usual)
CHILD = "import sys; from paged_ops.engine.variant_prebuild import main; sys.exit(main())"


def enabled() -> bool:
    return os.environ.get("PAGED_OPS_PREBUILD_VARIANTS", "1") != "0"


def _steps_per_variant(pa: PagedAttention, steps: Sequence[Step]) -> list[tuple[int, Step]]:
    """``(layer, step)`` for each distinct (layer kind, kernel variant: launch configuration and
    whether the kernel writes the K/V) of ``steps`` on the layers that the triton backend serves
    for some step kind."""
    from paged_ops.backends import triton as triton_backend
    from paged_ops.backends.triton_variants import step_variant

    table = pa.backend_table()
    max_kv_len = pa.builder.max_blocks_per_seq * pa.block_size
    num_sms = triton_backend._num_sms(pa.kv_cache.device)
    out, seen = [], set()
    for layer, spec in enumerate(pa.layer_specs):
        if not any(names[layer] == "triton" for names in table.values()):
            continue
        config_of = triton_backend.layer_launch_config(
            spec, max_kv_len, num_sms, triton_backend._shared_memory(pa.kv_cache.device)
        )
        variant = step_variant(config_of, pa.attention_writes_decode_kv(layer))
        for step in steps:
            key = (spec, variant(*step))
            if key not in seen:
                seen.add(key)
                out.append((layer, step))
    return out


def _call_each(pa: PagedAttention, work: list[tuple[int, Step]], rope: bool = False) -> int:
    """One backend ``paged_attention`` call per ``(layer, step)`` of ``work``, with the engine's
    own argument values; returns how many calls the backend accepted. ``rope``: the kernels that
    write a decode step's K/V also rotate q and k, and other steps launch the rotation kernel
    first (the engine's RoPE pass moved the rotation into ``paged_ops::write_kv_and_attend``)."""
    from paged_ops.backends import triton as triton_backend
    from paged_ops.backends.triton_rope_kernels import rotate_heads
    from paged_ops.engine.runner import warm_up_slices  # (the runner imports this module)

    src = pa.builder
    builder = MetadataBuilder(
        max_num_tokens=src.max_num_tokens,
        max_num_seqs=src.max_num_seqs,
        max_blocks_per_seq=src.max_blocks_per_seq,
        block_size=src.block_size,
        num_blocks=src.num_blocks,
        device=src.device,
    )
    device = pa.kv_cache.device
    accepted = 0
    with torch.inference_mode():
        for layer, (tokens, seqs) in work:
            spec = pa.layer_specs[layer]
            cache, k_scale, v_scale = pa.layer_inputs(layer)  # [N, 2, B, Hkv, D]
            slices = warm_up_slices(0, tokens, seqs, pa)  # as the warm-up's own steps
            md = builder.build(slices, num_tokens=tokens, num_seqs=seqs)
            query = torch.zeros(tokens, spec.num_q_heads, spec.head_dim, dtype=spec.dtype,
                                device=device)  # [T, Hq, D]  # fmt: skip
            extra = torch.zeros(spec.num_q_heads, dtype=torch.float32, device=device)  # [Hq]
            rows = torch.zeros(tokens, spec.head_dim, dtype=spec.dtype, device=device)  # [T, D]
            write: dict[str, torch.Tensor] = {}
            if pa.attention_writes_decode_kv(layer) and md.is_decode:  # the kernel's K/V write
                new_kv = torch.zeros(tokens, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype,
                                     device=device)  # [T, Hkv, D]  # fmt: skip
                # slots -1: nothing written even where the variant is built and launches
                slots = torch.full_like(md.slot_mapping, -1)  # [T]
                write = dict(new_key=new_kv, new_value=new_kv, slot_mapping=slots)
                if rope:  # cos, sin [T, D] in the model's dtype, as the graph passes them
                    write["rope"] = (rows, rows)
            elif rope:  # other steps rotate q and k first (one launch of their own)
                new_kv = torch.zeros(tokens, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype,
                                     device=device)  # [T, Hkv, D]  # fmt: skip
                rotate_heads(query, new_kv, rows, rows)
            try:
                triton_backend.paged_attention(
                    query, cache, md.cu_seqlens_q, md.seq_lens, md.block_table,
                    scale=spec.head_dim**-0.5, causal=spec.causal,
                    window=int(spec.sliding_window or 0), softcap=float(spec.softcap or 0.0),
                    sinks=extra if spec.has_sinks else None,
                    alibi_slopes=extra if spec.has_alibi else None,
                    k_scale=k_scale, v_scale=v_scale, **write,
                )  # fmt: skip
            except Exception as e:  # noqa: BLE001 - the step that meets it compiles it
                logger.debug("variant prebuild: the call for %s at %s failed: %r",
                             spec, (tokens, seqs), e)  # fmt: skip
                continue
            accepted += 1
    return accepted


def _call_linears(
    weights: Sequence[torch.Tensor], steps: Sequence[Step], norm_reduce: bool = False
) -> int:
    """One split-K GEMM call per (weight, token count of ``steps``) that ``small_linear`` sends
    to it (``linear._split_k_gemm_config``: the rows, the weight's shape, the GPU), on an input of
    that many rows; returns how many calls were made. With ``norm_reduce``
    (``LLM(down_norm_fusion)``, on by default) each call's partials also go through the kernel
    that sums them with the next norm (``reduce_add_rms_norm``, as
    ``paged_ops.silu_mul_add_rms_norm_linear`` calls it: a contiguous residual and norm weight of
    the weight's dtype)."""
    from paged_ops import linear
    from paged_ops.triton_dispatch import kernel_module

    def launch(x: torch.Tensor, weight: torch.Tensor, config: Any) -> None:
        gemm = kernel_module("paged_ops.backends.triton_gemm_kernels")
        gemm.split_k_gemm(x, weight, config=config)
        if norm_reduce:
            _call_norm_reduce(gemm.split_k_gemm(x, weight, config=config, reduce=False), x.dtype)

    lo, hi = linear.SPLIT_K_GEMM_ROWS
    counts = sorted({tokens for tokens, _ in steps if lo <= tokens <= hi})
    return _call_at_rows(weights, counts, lambda x, w: linear._split_k_gemm_config(x, w), launch,
                         "GEMM")  # fmt: skip


def _call_gated(weights: Sequence[torch.Tensor], steps: Sequence[Step]) -> int:
    """One gated GEMM call per (``[2I, K]`` gate/up weight, token count of ``steps``) that
    ``paged_ops.add_rms_norm_gated_mlp`` sends to it (``linear.gated_gemm_config``: the rows,
    the weight, the GPU), on an input of that many rows; returns how many calls were made. (The
    graph prebuild meets these calls too, but only once the compile hands over its graph: made
    here, their variants build from the warm-up's start.)"""
    from paged_ops import linear
    from paged_ops.triton_dispatch import kernel_module

    def launch(x: torch.Tensor, weight: torch.Tensor, config: Any) -> None:
        kernel_module("paged_ops.backends.triton_gemm_kernels").gated_gemm(x, weight, config)

    counts = sorted({tokens for tokens, _ in steps if tokens >= linear.GATED_GEMM_MIN_ROWS})
    return _call_at_rows(weights, counts, lambda x, w: linear.gated_gemm_config(x, w), launch,
                         "gated GEMM")  # fmt: skip


def _call_at_rows(
    weights: Sequence[torch.Tensor],
    counts: Sequence[int],
    config_of: Callable[[torch.Tensor, torch.Tensor], Any],
    launch: Callable[[torch.Tensor, torch.Tensor, Any], None],
    what: str,
) -> int:
    """``launch(x, weight, config)`` for each weight and row count whose ``config_of(x, weight)``
    (the op's route) is not None, ``x`` a fresh ``[T, K]`` input of the weight's dtype; returns
    the calls made. A call that fails is logged and left to the step that meets it."""
    calls = 0
    with torch.inference_mode():
        for weight in weights:
            for tokens in counts:
                x = torch.empty((tokens, weight.shape[1]), dtype=weight.dtype,
                                device=weight.device)  # [T, K]  # fmt: skip
                config = config_of(x, weight)
                if config is None:
                    continue
                try:
                    launch(x, weight, config)
                except Exception as e:  # noqa: BLE001 - the step that meets it compiles it
                    logger.debug("variant prebuild: the %s call for %s at %d rows failed: %r",
                                 what, tuple(weight.shape), tokens, e)  # fmt: skip
                    continue
                calls += 1
    return calls


def _call_norm_reduce(partials: torch.Tensor, dtype: torch.dtype) -> None:
    """``reduce_add_rms_norm`` on ``partials`` (``[SPLIT_K, T, N]`` float32) with a ``[T, N]``
    residual and an ``[N]`` norm weight of ``dtype`` (the model's; the next layer's RMSNorm)."""
    from paged_ops.triton_dispatch import kernel_module

    _, tokens, width = partials.shape
    norms = kernel_module("paged_ops.backends.triton_norm_linear_kernels")
    residual = torch.empty((tokens, width), dtype=dtype, device=partials.device)  # [T, N]
    norms.reduce_add_rms_norm(partials, residual, residual.new_empty(width), 1e-5)


@contextlib.contextmanager
def recording_variants() -> Iterator[list[dict[str, str]]]:
    """Within the block, a paged_ops Triton kernel launched with a variant this process has not
    built is recorded and neither compiled nor launched (Triton's ``jit_cache_hook`` returns
    True); other kernels compile as usual. Yields the records: ``{"module", "name", "data"}``
    with ``data`` Triton's serialized specialization (``JITFunction.preload``'s input)."""
    from triton import knobs

    records: list[dict[str, str]] = []
    seen: set[str] = set()
    before = knobs.runtime.jit_cache_hook

    def hook(**kwargs: Any) -> bool | None:
        fn = kwargs["fn"].jit_function.fn
        module = getattr(fn, "__module__", "") or ""
        if not module.startswith(OUR_MODULES):
            return before(**kwargs) if before is not None else None
        data = kwargs["compile"]["specialization_data"]
        if data not in seen:
            seen.add(data)
            records.append({"module": module, "name": fn.__name__, "data": data})
        return True  # recorded: skip the compile (and so the launch)

    knobs.runtime.jit_cache_hook = hook
    try:
        yield records
    finally:
        knobs.runtime.jit_cache_hook = before


def current_target() -> dict[str, Any]:
    """The active GPU's Triton target (``GPUTarget`` fields: backend, arch, warp_size)."""
    from triton.runtime import driver

    return dataclasses.asdict(driver.active.get_current_target())


@dataclasses.dataclass
class Prebuild:
    """A child process compiling recorded variants; :meth:`wait` for it."""

    process: subprocess.Popen
    workdir: Path
    num_variants: int

    def wait(self, timeout_s: float = 300.0) -> int:
        """Wait for the child (killed after ``timeout_s``); returns the variants it compiled or
        found in Triton's cache. Variants not built are logged (INFO) with the first reason."""
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            shutil.rmtree(self.workdir, ignore_errors=True)
            logger.debug("variant prebuild: the child took more than %.0f s; killed", timeout_s)
            return 0
        built, why = 0, ""
        try:
            result = json.loads((self.workdir / "result.json").read_text())
            built, failed = int(result["built"]), result.get("failed", [])
            why = failed[0] if failed else ""
        except (OSError, ValueError, KeyError) as e:
            err = (self.workdir / "stderr.txt").read_text(errors="replace")[-1500:]
            why = f"no result from the child ({e!r}): {err}"
        if built < self.num_variants:  # costs start-up time only: the steps compile the rest
            logger.info("variant prebuild: %d of %d kernel variants built; %s",
                        built, self.num_variants, why)  # fmt: skip
        elif why:  # a launcher the child could not build: the LLM's process builds it
            logger.debug("variant prebuild: %s", why)
        shutil.rmtree(self.workdir, ignore_errors=True)
        return built


def spawn(records: list[dict[str, str]], target: dict[str, Any]) -> Prebuild:
    """Start the child that compiles ``records`` for ``target`` into Triton's on-disk cache."""
    workdir = Path(tempfile.mkdtemp(prefix="paged_ops_prebuild_"))
    jobs = workdir / "jobs.json"
    jobs.write_text(json.dumps({"target": target, "records": records}))
    with open(workdir / "stderr.txt", "wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(workdir)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            env={**os.environ, "TRITON_INTERPRET": "0",  # imports as this process does:
                 "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )  # fmt: skip
    return Prebuild(process, workdir, len(records))


def start(
    pa: PagedAttention,
    steps: Sequence[Step],
    linear_weights: Sequence[torch.Tensor] = (),
    rope: bool = False,
    norm_reduce: bool = False,
    gated_weights: Sequence[torch.Tensor] = (),
) -> Prebuild | None:
    """Record the variants of ``steps`` (the warm-up's, with its graph buckets) and start the
    child that compiles them; None when there is nothing to do (no triton layer and no split-K
    GEMM, off, not CUDA, every variant already built in this process). ``linear_weights``: the
    model's projection weights that go through ``small_linear`` (:func:`_call_linears`);
    ``rope``: whether the decode kernels will rotate q and k (a prediction made before the
    compile that decides it: a wrong one costs the warm-up those variants' compiles, nothing
    else); ``norm_reduce``: whether the down projections' partials will be summed by the next
    norm's kernel (``LLM(down_norm_fusion)``, on by default; the same kind of prediction);
    ``gated_weights``: ``[2I, K]`` gate/up weights (or stand-ins) whose MLPs the gated GEMM will
    serve (:func:`_call_gated`)."""
    if pa.kv_cache.device.type != "cuda" or not enabled():
        return None
    work = _steps_per_variant(pa, steps)
    if not work and not linear_weights and not gated_weights:
        return None
    try:
        with recording_variants() as records:
            _call_each(pa, work, rope)
            _call_linears(linear_weights, steps, norm_reduce)
            _call_gated(gated_weights, steps)
        if not records:
            return None
        return spawn(records, current_target())
    except Exception as e:  # noqa: BLE001 - the steps compile what is missing, as without it
        logger.debug("variant prebuild did not start: %r", e)
        return None


class _TargetOnlyDriver:
    """The child's Triton driver: names the parent's GPU target and nothing else (no CUDA
    context: compiling needs the target only; ``JITFunction.preload`` asks for a device)."""

    def __init__(self, target: dict[str, Any]) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget(**target)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):  # -> GPUTarget
        return self.target


def build_launcher(compiled: Any, target: dict[str, Any]) -> bool:
    """Build the C launcher of ``compiled`` (a ``CompiledKernel``) into Triton's on-disk cache
    where Triton compiles one per kernel signature: triton 3.6 (the GPU machine's) runs the host's
    C compiler for it when a kernel is first loaded in a process, ~0.25 s each on an H200 host
    (benchmarks/NOTES.md section 42: 0.7-0.8 s of each of the warm-up steps 64/2 and 1/1 on a
    first start); later Triton versions launch through one generic launcher and have nothing to
    build. Returns whether it built (or found) one."""
    if target.get("backend") != "cuda":
        return False
    from triton.backends.nvidia import driver as nvidia

    if not hasattr(nvidia, "make_launcher"):  # a generic launcher (triton >= 3.7)
        return False
    nvidia.CudaLauncher(compiled.src, compiled.metadata)  # compiles it, or loads it from the cache
    return True


def compile_records(records: list[dict[str, str]], target: dict[str, Any]) -> dict[str, Any]:
    """Compile each record's variant (``JITFunction.preload``) for ``target`` into Triton's
    on-disk cache, a variant at a time, and its launcher where Triton builds one per signature
    (:func:`build_launcher`); returns ``{"built": n, "launchers": n, "failed": [why, ...], "s":
    t}`` (a launcher that did not build is reported in ``failed`` and does not count against its
    variant: the LLM's process builds it as without the child)."""
    import importlib

    from triton.runtime import driver

    t0 = time.perf_counter()
    driver.set_active(_TargetOnlyDriver(target))
    built, launchers, failed = 0, 0, []
    for record in records:
        name = f"{record['module']}.{record['name']}"
        try:
            kernel = getattr(importlib.import_module(record["module"]), record["name"])
            compiled = kernel.preload(record["data"])
            built += 1
        except Exception as e:  # noqa: BLE001 - reported; the parent compiles it if it must
            failed.append(f"{name}: {e!r}")
            continue
        try:
            launchers += build_launcher(compiled, target)
        except Exception as e:  # noqa: BLE001 - reported; the parent builds it if it must
            failed.append(f"{name}'s launcher: {e!r}")
    return {"built": built, "launchers": launchers, "failed": failed,
            "s": round(time.perf_counter() - t0, 3)}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """The child (``python -c CHILD WORKDIR``): compiles ``WORKDIR/jobs.json``'s records and
    writes ``WORKDIR/result.json``."""
    workdir = Path((sys.argv[1:] if argv is None else argv)[0])
    jobs = json.loads((workdir / "jobs.json").read_text())
    result = compile_records(jobs["records"], jobs["target"])
    (workdir / "result.json").write_text(json.dumps(result))
    return 0
