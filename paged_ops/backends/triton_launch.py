"""Launches of the package's Triton kernels, and a mode that only compiles them, in parallel.

Triton compiles a kernel variant the first time a launch meets its specialisation (constexprs,
launch options, value classes of the integer arguments), one after another on the launching
thread. An engine's warm-up meets a dozen or more variants this way (benchmarks/NOTES.md section
12: "39 more shapes" took 3.5-4.1 s of a first start on an H100/H200, ~0.7 s with a warm cache).
Inside :func:`compile_ahead` every launch through :func:`launch` only submits its variant's
compile to a thread pool (Triton's ``AsyncCompileMode``; the MLIR, LLVM and ``ptxas`` stages
release the GIL) and returns without running the kernel: a warm-up runs its steps once inside
(outputs are garbage) and then for real, when every variant is already built.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

COMPILE_AHEAD_ENV = "PAGED_OPS_COMPILE_AHEAD"  # "0": warm-ups compile as they launch

_compile_only: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "paged_ops_triton_compile_only", default=False
)
_launched: set[Any] = set()  # every kernel launch() has seen (a handful of module-level kernels)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``; under :func:`compile_ahead`, only submit its compile."""
    _launched.add(kernel)
    if _compile_only.get():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def compiled_variants() -> int:
    """Compiled variants (all devices) of the kernels :func:`launch` has seen, as Triton's JIT
    keeps them in memory; 0 for kernels without that cache (the interpreter's)."""
    total = 0
    for kernel in _launched:
        for caches in getattr(kernel, "device_caches", {}).values():
            total += len(caches[0])  # (kernel_cache, key cache, target, backend, binder)
    return total


def can_compile_ahead() -> bool:
    """Whether warm-ups compile ahead: this Triton has the asynchronous compile mode
    :func:`compile_ahead` needs, and ``PAGED_OPS_COMPILE_AHEAD`` is not ``"0"``."""
    if os.environ.get(COMPILE_AHEAD_ENV) == "0":
        return False
    try:
        from triton.runtime._async_compile import AsyncCompileMode  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def compile_ahead(workers: int | None = None) -> Iterator[None]:
    """Inside: launches through :func:`launch` compile their variant on one of ``workers`` threads
    (default: the CPUs, at most 16) and do not run; outputs of the ops are left unwritten. On exit
    every compile has finished and the variants sit in Triton's in-memory and on-disk caches.

    Raises:
        RuntimeError: :func:`can_compile_ahead` says no.
    """
    if not can_compile_ahead():
        raise RuntimeError(
            f"compile_ahead is off: {COMPILE_AHEAD_ENV}={os.environ.get(COMPILE_AHEAD_ENV)!r} "
            "or this Triton has no AsyncCompileMode"
        )
    from triton.runtime._async_compile import AsyncCompileMode

    workers = workers or max(1, min(16, os.cpu_count() or 1))
    pool = ThreadPoolExecutor(workers, thread_name_prefix="paged_ops_triton_compile")
    with pool, AsyncCompileMode(pool):  # (leaving it waits for every compile)
        token = _compile_only.set(True)
        try:
            yield
        finally:
            _compile_only.reset(token)
