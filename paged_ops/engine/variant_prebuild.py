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
first start, benchmarks/NOTES.md section 32).

The warm-up's later steps meet more of our kernels' variants than the attention's and the
GEMM's: the GEMVs, norm, rotation, SiLU-mul and argmax kernels at each step size (4-5 s of an
H200's cold first start, benchmarks/NOTES.md sections 37-38). Which ones the compiled forward
launches is known only once it is compiled, so after the first step the warm-up runs its later
steps once more with every new variant of ours recorded and skipped (:func:`recording_variants`;
the step's outputs mean nothing, as every warm-up step's), the workers (several child processes,
kept from the start: their imports are done) compile those records in parallel
(:meth:`Prebuild.more`), and the steps then run for real and find them on disk. The metadata
copy kernel is never skipped (:data:`ALWAYS_RUN`): a step's attention reads what it copied.

``PAGED_OPS_PREBUILD_VARIANTS=0`` turns it off (to measure it); ``PAGED_OPS_PREBUILD_STEPS=0``
turns off the later steps' part only.
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from paged_ops.metadata import MetadataBuilder
from paged_ops.module import PagedAttention

logger = logging.getLogger("paged_ops")

Step = tuple[int, int]  # (T tokens, S sequences)
OUR_MODULES = "paged_ops."  # kernels whose variants are recorded (others compile as usual)
# kernels that run (compiling in this process if they must) even while recording: the step's
# metadata copy, whose output later kernels index memory with
ALWAYS_RUN = ("paged_ops.backends.triton_copy_kernels",)
CHILD = "import sys; from paged_ops.engine.variant_prebuild import main; sys.exit(main())"
MAX_WORKERS = 4  # child processes compiling at once (each also takes a core while it imports)


def enabled() -> bool:
    return os.environ.get("PAGED_OPS_PREBUILD_VARIANTS", "1") != "0"


def later_steps_enabled() -> bool:
    """Whether the warm-up records and prebuilds its later steps' variants (module docstring)."""
    return enabled() and os.environ.get("PAGED_OPS_PREBUILD_STEPS", "1") != "0"


def num_workers() -> int:
    """Child processes to compile with: a quarter of the host's cores, 1 to :data:`MAX_WORKERS`
    (the main process compiles the model beside them, with Inductor's own workers)."""
    return max(1, min(MAX_WORKERS, (os.cpu_count() or 1) // 4))


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
        config_of = triton_backend.layer_launch_config(spec, max_kv_len, num_sms)
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


def _call_linears(weights: Sequence[torch.Tensor], steps: Sequence[Step]) -> int:
    """One split-K GEMM call per (weight, token count of ``steps``) that ``small_linear`` sends
    to it (``linear._split_k_gemm_config``: the rows, the weight's shape, the GPU), on an input of
    that many rows; returns how many calls were made."""
    from paged_ops import linear
    from paged_ops.triton_dispatch import kernel_module

    lo, hi = linear.SPLIT_K_GEMM_ROWS
    counts = sorted({tokens for tokens, _ in steps if lo <= tokens <= hi})
    calls = 0
    with torch.inference_mode():
        for weight in weights:
            for tokens in counts:
                x = torch.empty((tokens, weight.shape[1]), dtype=weight.dtype,
                                device=weight.device)  # [T, K]  # fmt: skip
                config = linear._split_k_gemm_config(x, weight)
                if config is None:
                    continue
                try:
                    gemm = kernel_module("paged_ops.backends.triton_gemm_kernels")
                    gemm.split_k_gemm(x, weight, config=config)
                except Exception as e:  # noqa: BLE001 - the step that meets it compiles it
                    logger.debug("variant prebuild: the GEMM call for %s at %d rows failed: %r",
                                 tuple(weight.shape), tokens, e)  # fmt: skip
                    continue
                calls += 1
    return calls


@contextlib.contextmanager
def recording_variants(always_run: Sequence[str] = ()) -> Iterator[list[dict[str, str]]]:
    """Within the block, a paged_ops Triton kernel launched with a variant this process has not
    built is recorded and neither compiled nor launched (Triton's ``jit_cache_hook`` returns
    True); other kernels, and ours in the modules ``always_run``, compile as usual. (The hook
    comes before Triton's disk cache: a variant on disk but not yet in this process is recorded
    too, and the child finds it there.) Yields the records: ``{"module", "name", "data"}``
    with ``data`` Triton's serialized specialization (``JITFunction.preload``'s input)."""
    from triton import knobs

    records: list[dict[str, str]] = []
    seen: set[str] = set()
    before = knobs.runtime.jit_cache_hook

    def hook(**kwargs: Any) -> bool | None:
        fn = kwargs["fn"].jit_function.fn
        module = getattr(fn, "__module__", "") or ""
        if not module.startswith(OUR_MODULES) or module in always_run:
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
    """Child processes (workers) compiling recorded variants into Triton's on-disk cache, a batch
    at a time: :meth:`wait` for the batch :func:`spawn` gave them, :meth:`more` for another,
    :meth:`close` when done (``wait`` closes by default)."""

    processes: list[subprocess.Popen]
    workdir: Path
    num_variants: int  # of the batch in progress
    batches: int = 1  # batches sent so far

    @property
    def process(self) -> subprocess.Popen:
        """The first worker."""
        return self.processes[0]

    def wait(self, timeout_s: float = 300.0, close: bool = True) -> int:
        """Wait for the batch in progress (the workers are killed after ``timeout_s``); returns
        the variants built or found in Triton's cache. Variants not built are logged (INFO) with
        the first reason. ``close=False`` keeps the workers for :meth:`more`."""
        deadline = time.monotonic() + timeout_s
        built, why = 0, ""
        for process in self.processes:
            result, err = self._result(process, deadline)
            if result is None:
                why = why or err
                continue
            built += int(result["built"])
            failed = result.get("failed", [])
            why = why or (failed[0] if failed else "")
        if built < self.num_variants:  # costs start-up time only: the steps compile the rest
            logger.info("variant prebuild: %d of %d kernel variants built; %s",
                        built, self.num_variants, why)  # fmt: skip
        if close:
            self.close()
        return built

    def _result(self, process: subprocess.Popen, deadline: float) -> tuple[dict | None, str]:
        """One worker's result line for the batch in progress, or None and why (a worker past
        the deadline is killed, and the workdir goes with :meth:`close`)."""
        import select

        if process.stdout is None or process.stdout.closed:
            return None, "the worker has stopped"
        ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            logger.debug("variant prebuild: a worker took longer than allowed; killed")
            self._kill()
            return None, "a worker took longer than allowed"
        line = process.stdout.readline()
        try:
            return json.loads(line), ""
        except ValueError as e:
            err = ""
            with contextlib.suppress(OSError):
                index = self.processes.index(process)
                err = (self.workdir / f"stderr-{index}.txt").read_text(errors="replace")[-1500:]
            return None, f"no result from the child ({e!r}): {err}"

    def more(self, records: list[dict[str, str]], timeout_s: float = 300.0) -> int:
        """Compile another batch of records on the workers (split among them) and wait for it;
        returns the variants built, as :meth:`wait`. The workers stay for the next batch."""
        alive = [p for p in self.processes if p.poll() is None and p.stdin is not None]
        if not records or not alive:
            return 0
        self.processes, self.num_variants = alive, len(records)
        for index, process in enumerate(alive):
            path = self.workdir / f"jobs-{self.batches}-{index}.json"
            path.write_text(json.dumps({"records": records[index :: len(alive)]}))
            try:
                process.stdin.write(f"{path}\n".encode())
                process.stdin.flush()
            except OSError:  # a worker that died: its result says so
                pass
        self.batches += 1
        return self.wait(timeout_s, close=False)

    def close(self, timeout_s: float = 10.0) -> None:
        """End the workers (they exit at the end of their input) and remove the workdir."""
        for process in self.processes:
            with contextlib.suppress(OSError):
                if process.stdin is not None:
                    process.stdin.close()
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def spawn(records: list[dict[str, str]], target: dict[str, Any], workers: int = 1) -> Prebuild:
    """Start ``workers`` child processes that compile ``records`` (split among them) for
    ``target`` into Triton's on-disk cache, then wait for more (:meth:`Prebuild.more`)."""
    workdir = Path(tempfile.mkdtemp(prefix="paged_ops_prebuild_"))
    (workdir / "target.json").write_text(json.dumps(target))
    workers = max(1, min(workers, len(records)))
    processes = []
    for index in range(workers):
        jobs = workdir / f"jobs-0-{index}.json"
        jobs.write_text(json.dumps({"records": records[index::workers]}))
        with open(workdir / f"stderr-{index}.txt", "wb") as err:
            processes.append(subprocess.Popen(
                [sys.executable, "-c", CHILD, str(jobs)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                env={**os.environ, "TRITON_INTERPRET": "0",  # imports as this process does:
                     "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            ))  # fmt: skip
    return Prebuild(processes, workdir, len(records))


def start(
    pa: PagedAttention,
    steps: Sequence[Step],
    linear_weights: Sequence[torch.Tensor] = (),
    rope: bool = False,
) -> Prebuild | None:
    """Record the variants of ``steps`` (the warm-up's, with its graph buckets) and start the
    child that compiles them; None when there is nothing to do (no triton layer and no split-K
    GEMM, off, not CUDA, every variant already built in this process). ``linear_weights``: the
    model's projection weights that go through ``small_linear`` (:func:`_call_linears`);
    ``rope``: whether the decode kernels will rotate q and k (a prediction made before the
    compile that decides it: a wrong one costs the warm-up those variants' compiles, nothing
    else)."""
    if pa.kv_cache.device.type != "cuda" or not enabled():
        return None
    work = _steps_per_variant(pa, steps)
    if not work and not linear_weights:
        return None
    try:
        with recording_variants() as records:
            _call_each(pa, work, rope)
            _call_linears(linear_weights, steps)
        if not records:
            return None
        return spawn(records, current_target(), num_workers())
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


def compile_records(records: list[dict[str, str]], target: dict[str, Any]) -> dict[str, Any]:
    """Compile each record's variant (``JITFunction.preload``) for ``target`` into Triton's
    on-disk cache, a variant at a time; returns ``{"built": n, "failed": [why, ...], "s": t}``."""
    import importlib

    from triton.runtime import driver

    t0 = time.perf_counter()
    driver.set_active(_TargetOnlyDriver(target))
    built, failed = 0, []
    for record in records:
        try:
            kernel = getattr(importlib.import_module(record["module"]), record["name"])
            kernel.preload(record["data"])
            built += 1
        except Exception as e:  # noqa: BLE001 - reported; the parent compiles it if it must
            failed.append(f"{record['module']}.{record['name']}: {e!r}")
    return {"built": built, "failed": failed, "s": round(time.perf_counter() - t0, 3)}


def main(argv: Sequence[str] | None = None) -> int:
    """A worker (``python -c CHILD JOBS``): compiles the records of the jobs file ``JOBS`` (its
    directory's ``target.json`` names the target) and writes the result as one JSON line on
    stdout; then the same for each jobs file named by a line of stdin, until its end."""
    jobs = Path((sys.argv[1:] if argv is None else argv)[0])
    target = json.loads((jobs.parent / "target.json").read_text())
    out = os.fdopen(os.dup(1), "w")  # the results' channel; anything else printed goes to stderr
    os.dup2(2, 1)
    while True:
        records = json.loads(jobs.read_text())["records"]
        out.write(json.dumps(compile_records(records, target)) + "\n")
        out.flush()
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        jobs = Path(line.strip())
