"""A cheaper host path for launching a ``@triton.jit`` kernel that has already run with the same
argument specialisation: :class:`Launcher`.

``kernel[grid](*args)`` runs ``JITFunction.run`` every time: it binds the arguments, specialises
each one (dtype, 16-byte alignment of pointers, integers equal to 1 or divisible by 16), builds a
cache key string from the options, looks the compiled kernel up, checks the kernel's globals,
builds the launch metadata and only then calls the compiled kernel's C launcher. A step that runs
eagerly (prefill, mixed steps) pays that for each of our launches in each layer, where Inductor's
generated code calls its launchers directly (benchmarks/NOTES.md section 36).

:class:`Launcher` keeps, per key of the things Triton specialises on (computed here in Python,
never coarser than Triton's own: a key that differs where Triton's would not only costs one more
slow launch), the compiled kernel that Triton's first launch returned, and calls its launcher
(``CompiledKernel.run``, the call ``JITFunction.run`` itself makes) on the next launches. The first
launch of every key goes through ``kernel[grid]`` (compile, autotuned options, errors as Triton
raises them); so does every launch whose first argument is not a CUDA tensor (a CPU build of
torch, a stand-in driver), every launch under the interpreter (``TRITON_INTERPRET=1``), while a
launch hook (a profiler such as Proton) is set, and with ``PAGED_OPS_FAST_LAUNCH=0`` (or
:data:`ENABLED` set False) for A/B runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

_I32_MIN, _I32_MAX, _I64_MAX = -(2**31), 2**31 - 1, 2**63 - 1
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_SIMPLE_KEYWORD_TYPES = (int, float, bool, str, type(None))
ENABLED = os.environ.get("PAGED_OPS_FAST_LAUNCH", "1") != "0"  # False: every launch is Triton's


def specialisation_key(args: Sequence[Any]) -> tuple:
    """What Triton's launch specialises on for each of ``args``, as a hashable key: a tensor's
    dtype and whether its data pointer is 16-byte aligned; an integer's width class and whether
    it is 1 or a multiple of 16; the type of a float, bool or None; ``NotImplemented`` for
    anything else (the launch then takes Triton's own path). One loop (it is the cached path's
    main cost), not a call per argument."""
    key = []
    append = key.append
    for a in args:
        kind = type(a)
        if kind is int:
            append((a == 1, not a & 15, _I32_MIN <= a <= _I32_MAX, a <= _I64_MAX))
        elif kind in _TENSOR_TYPES or isinstance(a, torch.Tensor):
            append((a.dtype, not a.data_ptr() & 15))
        elif kind is float or kind is bool or a is None:
            append(kind)
        else:
            append(NotImplemented)
    return tuple(key)


def arg_key(value: Any) -> Any:
    """:func:`specialisation_key` of one argument."""
    return specialisation_key((value,))[0]


def _cuda_tensor(value: Any) -> bool:
    """Whether ``value`` (a launch's first argument) is a CUDA tensor: the launches this path
    serves."""
    return type(value) in _TENSOR_TYPES and value.is_cuda


def _hooks_idle(runtime: Any) -> bool:
    """Whether no launch hook is set on ``triton.knobs.runtime`` (None, or an empty hook chain as
    triton 3.6 keeps them); True without knobs."""
    if runtime is None:
        return True
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is None or not getattr(enter, "calls", True)) and (
        leave is None or not getattr(leave, "calls", True)
    )


def _launch_hooks() -> Any:
    """``triton.knobs.runtime`` (the launch hooks' home), or None for a triton without knobs."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs.runtime


class Launcher:
    """``Launcher(kernel)[grid](*args, **constexprs_and_options)`` launches ``kernel`` as
    ``kernel[grid](...)`` would, on a shorter host path once a launch with the same specialisation
    has run (see the module docstring).

    ``args`` are the kernel's leading parameters by position (tensors, ints, floats, bools,
    None); the keywords name its remaining parameters (constexprs) and launch options
    (``num_warps``, ``num_stages``). ``grid`` is a tuple of one to three ints.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        params = getattr(kernel, "params", ())
        self._params: tuple[str, ...] = tuple(p.name for p in params)
        self._defaults: dict[str, Any] = {p.name: p.default for p in params if p.has_default}
        self._interpreted = (
            not self._params
            or os.environ.get("TRITON_INTERPRET") == "1"
            or type(kernel).__name__ == "InterpretedFunction"
        )
        self._hooks = _launch_hooks()
        # key -> (run, function, packed metadata, the parameters after the positional ones)
        self._compiled: dict[Any, tuple[Callable, Any, Any, tuple]] = {}

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: Sequence[int], args: tuple, kwargs: dict[str, Any]) -> None:
        """Launch on ``grid`` with positional ``args`` and keyword ``kwargs``."""
        if (
            not ENABLED
            or self._interpreted
            or not (args and _cuda_tensor(args[0]))  # CUDA launches only
            or callable(grid)
            or not _hooks_idle(self._hooks)
        ):
            self.kernel[grid](*args, **kwargs)
            return
        device = torch._C._cuda_getDevice()
        key = (device, tuple(kwargs.items()), specialisation_key(args))
        try:
            entry = self._compiled.get(key)
        except TypeError:  # an unhashable keyword value: Triton's path, uncached
            self.kernel[grid](*args, **kwargs)
            return
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if NotImplemented not in key[2]:
                entry = self._entry(compiled, len(args), kwargs)
                if entry is not None:
                    self._compiled[key] = entry
            return
        run, function, packed_metadata, tail = entry
        size = len(grid)
        stream = torch._C._cuda_getCurrentRawStream(device)
        run(
            grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, stream, function,
            packed_metadata, None, None, None, *args, *tail,
        )  # fmt: skip

    def _entry(
        self, compiled: Any, num_positional: int, kwargs: dict[str, Any]
    ) -> tuple[Callable, Any, Any, tuple] | None:
        """The cached launch of ``compiled`` (what ``kernel[grid]`` returned), or None when it is
        not a compiled kernel this path knows how to call, or the keywords are not plain values."""
        needed = ("run", "function", "packed_metadata")
        if compiled is None or not all(hasattr(compiled, a) for a in needed):
            return None
        if not all(type(v) in _SIMPLE_KEYWORD_TYPES for v in kwargs.values()):
            return None
        run = compiled.run  # loads the binary on first access (it has run once already)
        tail = []
        for name in self._params[num_positional:]:
            if name in kwargs:
                tail.append(kwargs[name])
            elif name in self._defaults:
                tail.append(self._defaults[name])
            else:  # a parameter we cannot fill: leave this key on Triton's path
                return None
        return run, compiled.function, compiled.packed_metadata, tuple(tail)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code: ``triton.cdiv`` is a ``ConstexprFunction`` whose wrapper
    costs ~1.4 us a call, which eager steps pay per launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1), as ``triton.next_power_of_2`` (whose wrapper
    costs as ``triton.cdiv``'s)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


_LAUNCHERS: dict[int, Launcher] = {}


def launcher(kernel: Any) -> Launcher:
    """The process's :class:`Launcher` of ``kernel`` (one per kernel object): call sites write
    ``launcher(my_kernel)[grid](...)`` where they wrote ``my_kernel[grid](...)``."""
    found = _LAUNCHERS.get(id(kernel))
    if found is None or found.kernel is not kernel:
        found = _LAUNCHERS[id(kernel)] = Launcher(kernel)
    return found
