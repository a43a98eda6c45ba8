"""Precompiled forward: a second start loads the compiled forward whole instead of tracing it.

Inductor's and AOTAutograd's caches (``engine/compile_cache.py``) spare a second start the
compile, but not Dynamo's trace of the model: 4.7-7.2 s of an H100 host's 10-13 s second start
for the 1B model (benchmarks/NOTES.md section 19). With ``LLM(precompile=True)`` the runner
compiles its forward with Dynamo's ahead-of-time API (``torch.compile(...).aot_compile``, torch
>= 2.11) on the first warm-up step and saves the result (Dynamo's transformed bytecode and the
compiled graph, not the weights) under the compile-cache root; the next start with the same key
loads it and runs it without Dynamo.

What this gives up, and how it is made safe:

* **No Dynamo guards.** A saved guard set cannot be rebuilt in a new process for this forward
  (guards on the model's modules, and the key-order guards of their child dicts, are read through
  objects that exist only in the saving process), so the loaded forward runs unguarded. The file
  is found by a key over everything the trace depends on: the torch, transformers and paged_ops
  versions, a digest of paged_ops' own sources, the model's class, the source file of each of its
  module classes, its config and every parameter's and buffer's name, shape and dtype, its
  modules' forward hooks, torch's global module hooks and any ``forward`` set on a module
  instance (name, bytecode and the scalars they close over), the engine's settings (cache,
  tables, backends per layer and step kind), where each function and class that the modeling
  modules hold as a global comes from (a run-time swap of ``apply_rotary_pos_emb``) and
  the configurations of Dynamo, AOTAutograd (functorch) and Inductor. Not covered: a plain
  Python attribute of a module changed at run time (not through the config), and what a hook
  reads from objects other than its closure's scalars and tensors; the check at load catches
  such a change only when it moves the logits beyond the dtype's noise. The engine's steps are the only calls, and the usual whole-model compile makes
  one graph for all of them (1 unique graph after a warm-up and greedy and sampled generation on
  the CPU), so one unguarded function serves what the guarded path served.
* **Checked at load.** Inductor's generated code asserts every input's size and stride. And one
  step (a sequence of up to 64 tokens) runs both eagerly and through the loaded forward: logits
  must agree within the dtype's noise (:func:`outputs_agree`), or the file is deleted and the
  forward compiled as without it (a warning).
* **Torch-private pieces.** The serializer wraps the compiled graph in
  ``BundledAOTAutogradSerializableCallable`` and loading replaces Dynamo's guard rebuild by a
  guard set that always passes; both are torch internals of 2.11-2.13. Any failure to save or load
  falls back to the normal compile with a warning: the flag can cost time, never a wrong answer
  that the check above can see.

On by default for CUDA models (``LLM(precompile=None)``): on an H100 the 1B model's second start
takes 4.2-4.9 s against 11.0 s, with tokens/s and greedy tokens equal to the usual compile's
(benchmarks/NOTES.md section 20). Off on the CPU unless asked for, and ruled out with
speculative decoding, per-layer regions and tensor parallelism (their forwards differ, untested
here): ``precompile=True`` with one of them is a ``ValueError``, the default just leaves it off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import logging
import os
import re
import tempfile
import types
import unittest.mock
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("paged_ops")

FORMAT = 1  # bump when what is saved changes
RESTARTS = 3  # retraces compile_ahead allows when Dynamo asks to restart its analysis
KEEP_ENV = "PAGED_OPS_PRECOMPILED_KEEP"  # saved forwards kept per directory (default KEEP)
KEEP = 8  # ~5 MB each for a 1B model: a new key (model, settings, versions) is a new file


class _AlwaysPasses:
    """Stands in for Dynamo's rebuilt guard manager (see the module docstring)."""

    def check(self, f_locals: dict[str, Any]) -> bool:
        return True


def _no_guards(entries: Sequence[Any]) -> list[bool]:
    return [False] * len(entries)


@functools.cache
def _source_digest() -> str:
    """sha256 of paged_ops' own Python sources (a code change invalidates saved forwards)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _model_sources(model: nn.Module) -> list[tuple[str, str]]:
    """``(class, sha256 of its source file)`` for every module class in ``model``: a modeling file
    edited in place, or remote code, changes the key even when no version does."""
    out = {}
    for module in model.modules():
        cls = type(module)
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name in out:
            continue
        try:
            path = inspect.getsourcefile(cls)
            out[name] = hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else ""
        except (OSError, TypeError):
            out[name] = ""
    return sorted(out.items())


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")  # what a forward runs of a module's hooks
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # in default reprs: differs between processes


def _code_digest(code: types.CodeType) -> str:
    """sha256 of a code object's bytecode and constants (nested code objects by their own digest,
    not their repr, which holds an address)."""
    h = hashlib.sha256(code.co_code)
    for const in code.co_consts:
        h.update(_code_digest(const).encode() if isinstance(const, types.CodeType) else
                 repr(const).encode())  # fmt: skip
    h.update(repr(code.co_names).encode())
    return h.hexdigest()[:16]


def _function_identity(fn: Any) -> str:
    """A hook's or an instance ``forward``'s name, code digest and simple closure values (a
    float captured by a hook is baked into the graph as a constant)."""
    fn = getattr(fn, "__func__", fn)
    if isinstance(fn, functools.partial):
        bound = _ADDRESS.sub("", f"{fn.args!r:.200}, {fn.keywords!r:.200}")
        return f"partial({_function_identity(fn.func)}, {bound})"
    code = getattr(fn, "__code__", None)
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    if code is None:
        return name
    cells = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            cells.append(_ADDRESS.sub("", repr(value)))
        elif isinstance(value, torch.Tensor):
            cells.append(f"tensor{tuple(value.shape)}:{value.dtype}")
    return f"{name}:{_code_digest(code)}:{','.join(cells)}"


def _model_hooks(model: nn.Module) -> list[tuple[str, str, str]]:
    """``(module, kind, function)`` for every forward hook on ``model``'s modules, torch's global
    module hooks and every ``forward`` set on a module instance: the trace runs them (a hook that
    adds a steering vector changes the outputs), so a loaded forward must not outlive them."""
    from torch.nn.modules import module as module_mod

    out = []
    for name, module in model.named_modules():
        for kind in _HOOK_DICTS:
            for hook in getattr(module, kind, {}).values():
                out.append((name, kind, _function_identity(hook)))
        if "forward" in vars(module):
            out.append((name, "forward", _function_identity(vars(module)["forward"])))
    for kind in ("_global_forward_pre_hooks", "_global_forward_hooks"):
        for hook in getattr(module_mod, kind, {}).values():
            out.append(("", kind, _function_identity(hook)))
    return out


def _modeling_globals(model: nn.Module) -> list[tuple[str, str]]:
    """``(module.name, where the value comes from)`` for every function and class that the
    modules defining ``model``'s classes hold as globals: the trace calls them, and a run-time
    swap (``modeling_llama.apply_rotary_pos_emb = my_rope``) leaves every source file as it was."""
    import sys

    names = {type(m).__module__ for m in model.modules()}
    out = []
    for module_name in sorted(names):
        module = sys.modules.get(module_name)
        for name, value in sorted(vars(module).items()) if module is not None else ():
            if name.startswith("__") or not callable(value) or isinstance(value, types.ModuleType):
                continue
            origin = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
            out.append((f"{module_name}.{name}", origin))
    return out


def _portable(config: Any) -> dict[str, Any]:
    """A torch config module's portable settings, with sets sorted (their order changes between
    processes with string hashing)."""
    return {
        name: sorted(map(str, value)) if isinstance(value, (set, frozenset)) else value
        for name, value in config.save_config_portable().items()
    }


def artifact_key(model: nn.Module, settings: dict[str, Any]) -> str:
    """A hex key over what the traced forward depends on; ``settings``: the engine's (JSON-able
    with ``str`` for the rest)."""
    from importlib import metadata

    try:
        paged_ops_version = metadata.version("paged_ops")
    except metadata.PackageNotFoundError:
        paged_ops_version = None
    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config as inductor_config

    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    parts = dict(
        format=FORMAT,
        torch=torch.__version__,
        transformers=transformers_version,
        paged_ops=paged_ops_version,
        sources=_source_digest(),
        model=f"{type(model).__module__}.{type(model).__qualname__}",
        model_sources=_model_sources(model),
        hooks=_model_hooks(model),
        modeling_globals=_modeling_globals(model),
        config=to_json(use_diff=False) if callable(to_json) else repr(config),
        tensors=[
            (name, tuple(t.shape), str(t.dtype), t.device.type)
            for name, t in (*model.named_parameters(), *model.named_buffers())
        ],
        settings=settings,
        inductor=inductor_config.save_config_portable(),  # e.g. a caller's config.patch(...)
        dynamo=_portable(torch._dynamo.config),  # what the trace does (e.g. scalar outputs)
        functorch=_portable(torch._functorch.config),  # AOTAutograd's partitioning and more
    )
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:40]


def supported() -> str | None:
    """None when this torch has the pieces used here, else why not."""
    try:
        from torch._dynamo import package  # noqa: F401
        from torch._dynamo.aot_compile import AOTCompiledFunction  # noqa: F401
        from torch._dynamo.aot_compile_types import (  # noqa: F401
            BundledAOTAutogradSerializableCallable,
        )
    except ImportError as e:
        return f"torch {torch.__version__} has no ahead-of-time Dynamo compile ({e})"
    if not hasattr(torch._dynamo.config, "enable_aot_compile"):
        return f"torch {torch.__version__} has no torch._dynamo.config.enable_aot_compile"
    return None


def compile_ahead(
    function: Callable, backend: str | Callable, args: tuple[torch.Tensor, ...]
) -> Callable:
    """Dynamo's whole trace of ``function`` at ``args`` (dynamic marks as set on them), compiled
    by ``backend``, without guards; returns the compiled function (what :func:`save` takes)."""
    from torch._dynamo import lookup_backend
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    inner = lookup_backend(backend) if isinstance(backend, str) else backend

    def serializable(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        return BundledAOTAutogradSerializableCallable(inner(gm, example_inputs))

    with torch._dynamo.config.patch(enable_aot_compile=True):
        compiled = torch.compile(
            function, fullgraph=True, backend=serializable, options={"guard_filter_fn": _no_guards}
        )
        for attempt in range(RESTARTS + 1):
            # Dynamo's own compile retraces when its analysis asks for a restart (e.g. a Python
            # float that it first traced as a symbol); the ahead-of-time entry point passes the
            # request up, and the state it recorded makes the next trace succeed
            try:
                return compiled.aot_compile((args, {}))
            except torch._dynamo.exc.RestartAnalysis:
                if attempt == RESTARTS:
                    raise
    raise AssertionError("unreachable")


def save(compiled: Callable, path: Path, owner: object) -> int:
    """Write ``compiled`` (from :func:`compile_ahead`) to ``path`` atomically; ``owner``: the object
    bound as its first argument (kept out of the file). Returns the bytes written."""
    data = type(compiled).serialize(compiled, external_data={"self": owner}).serialized_data
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    prune(path.parent)
    return len(data)


def kept() -> int:
    """How many saved forwards a directory keeps: ``PAGED_OPS_PRECOMPILED_KEEP`` or :data:`KEEP`."""
    value = os.environ.get(KEEP_ENV, str(KEEP))
    try:
        keep = int(value)
    except ValueError:
        keep = -1
    if keep < 1:
        raise ValueError(f"{KEEP_ENV}={value!r}: expected an integer >= 1")
    return keep


def prune(directory: Path, keep: int | None = None) -> list[Path]:
    """Delete all but the ``keep`` (default :func:`kept`) most recently used saved forwards
    (``*.bin``; :func:`load` marks a file used) in ``directory``; returns the deleted paths.
    Every other model or setting saves its own file, so without this the directory only grows."""
    keep = kept() if keep is None else keep
    files = []
    for path in directory.glob("*.bin"):
        with contextlib.suppress(OSError):  # (another process may prune at the same time)
            files.append((path.stat().st_mtime, path))
    files.sort(reverse=True)
    deleted = []
    for _, path in files[keep:]:
        with contextlib.suppress(OSError):
            path.unlink()
            deleted.append(path)
    return deleted


def load(path: Path, owner: object, f_globals: dict[str, Any]) -> Callable:
    """The compiled function saved at ``path``, bound to ``owner`` again; raises on any failure.
    ``f_globals``: the module globals of the traced function."""
    from torch._dynamo import package
    from torch._dynamo.aot_compile import AOTCompiledFunction

    data = path.read_bytes()
    with contextlib.suppress(OSError):
        os.utime(path)  # used: the last to be pruned
    with (
        in_process_kernels(),
        unittest.mock.patch.object(
            package, "load_guard_manager", lambda *args, **kwargs: _AlwaysPasses()
        ),
    ):
        compiled = AOTCompiledFunction.deserialize(
            data, f_globals=f_globals, external_closure_data={"self": owner}
        )
    compiled.disable_guard_check()
    return compiled


def in_process_kernels() -> contextlib.AbstractContextManager:
    """Inductor loads the loaded forward's kernels in this process, without its pool of compile
    workers: the kernels come from the compile caches, so the pool (16 subprocesses booting torch
    beside the warm-up on an H100 host) would only cost, and a pool still booting holds up the
    process's exit for 8-10 s (benchmarks/NOTES.md section 20)."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(compile_threads=1)


def outputs_agree(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether logits ``got`` (loaded forward) and ``want`` (eager) of one step agree within the
    dtype's noise: the same shape, finite, and every row's cosine similarity at least 0.98 for 16-bit
    dtypes (0.9999 for float32). A compiled bf16 forward drifts from eager (Inductor keeps the
    residual stream in float32 across fused ops): cosine 0.9957, largest difference 9% of the
    largest logit for a correct 16-layer forward on the dev CPU; a wrong one (the warm-up's
    aliased blocks) read 0.02."""
    if got.shape != want.shape or not torch.isfinite(got).all():
        return False
    floor = 0.9999 if want.dtype == torch.float32 else 0.98
    cosine = torch.nn.functional.cosine_similarity(got.float(), want.float(), dim=-1)
    return bool((cosine >= floor).all())


def discard(path: Path, why: str) -> None:
    """Delete a saved forward that failed, with a warning that says why."""
    logger.warning(
        "precompiled forward %s not used (%s); compiling the forward as usual", path, why
    )
    with contextlib.suppress(OSError):
        path.unlink()
