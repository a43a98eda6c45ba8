"""Backend registry, availability and "auto" selection.

A backend is a module under ``paged_ops.backends`` that exposes

- ``is_available() -> bool``: can it run on this machine at all (imports, devices)?
- ``unsupported_reason(spec: LayerSpec, device: torch.device) -> str | None``: ``None`` when it can
  serve a layer with these parameters on that device, else a sentence saying why not.
- ``write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale) -> None``
- ``paged_attention(query, kv_cache, cu_seqlens_q, seq_lens, block_table, *, scale, causal,
  window, softcap, sinks, alibi_slopes, k_scale, v_scale, plan_handle, out=None) -> Tensor``
  (``out``: a contiguous ``[T, Hq, D]`` tensor to write and return instead of a new one)
- optionally ``write_kv_and_attend(query, key, value, kv_cache, slot_mapping, cu_seqlens_q,
  seq_lens, block_table, *, out, decode_step, **paged_attention's keywords) -> None``: both, the
  output into ``out``, in one launch where ``decode_step`` (at most one query token per
  sequence); a PagedAttention layer on such a backend calls ``paged_ops::write_kv_and_attend``

An FP8 cache (``float8_e4m3fn``/``float8_e5m2``) comes with float32 ``k_scale``/``v_scale`` of shape
``[]`` or ``[Hkv]`` (or ``None`` = 1.0); :mod:`paged_ops.fp8` defines the quantization.

Modules load lazily, so ``import paged_ops`` needs only torch: triton and flashinfer are imported
the first time their backend is asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from paged_ops.metadata import STEP_KINDS

if TYPE_CHECKING:
    from paged_ops.backends.cost_table import AutoPolicy

# name -> module path of the backends a user can name.
_BACKEND_MODULES: dict[str, str] = {
    "flashinfer": "paged_ops.backends.flashinfer",
    "triton": "paged_ops.backends.triton",
    "reference": "paged_ops.backends.reference",
}
BACKEND_NAMES: tuple[str, ...] = tuple(_BACKEND_MODULES)
# Internal: the op's backend for a layer group whose "auto" backend depends on the step kind.
BY_STEP = "by_step"
_INTERNAL_MODULES: dict[str, str] = {BY_STEP: "paged_ops.backends.by_step"}


@dataclass(frozen=True)
class LayerSpec:
    """What a backend must support to serve one attention layer (or one call).

    Per-layer constants of a model: they are baked into a compiled trace, never per-step tensors.
    ``sliding_window`` and ``softcap`` are ``None`` when off; ``has_sinks``/``has_alibi`` say whether
    the call carries those tensors. ``dtype`` is the query's (and K/V's) dtype, ``kv_dtype`` the
    cache's (``None``: the same; an FP8 dtype for a quantized cache).
    """

    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    dtype: torch.dtype
    kv_dtype: torch.dtype | None = None
    causal: bool = True
    sliding_window: int | None = None
    softcap: float | None = None
    has_sinks: bool = False
    has_alibi: bool = False


def _load(name: str) -> ModuleType:
    if name not in _BACKEND_MODULES:
        raise ValueError(
            f"unknown backend {name!r}; expected 'auto' or one of {sorted(_BACKEND_MODULES)}"
        )
    return importlib.import_module(_BACKEND_MODULES[name])


def _is_available(name: str) -> bool:
    try:
        return bool(_load(name).is_available())
    except ImportError:
        return False


def get_backend(name: str) -> ModuleType:
    """The backend module called ``name`` (no availability check; ``resolve_backend`` does that)."""
    if name in _INTERNAL_MODULES:
        return importlib.import_module(_INTERNAL_MODULES[name])
    return _load(name)


def available_backends() -> list[str]:
    """Names of the backends that can run on this machine, e.g. ``["reference"]`` on a CPU box."""
    return [name for name in BACKEND_NAMES if _is_available(name)]


def _serves(name: str, spec: LayerSpec, device: torch.device) -> bool:
    return _is_available(name) and _load(name).unsupported_reason(spec, device) is None


def auto_candidates(spec: LayerSpec, device: torch.device | str) -> list[str]:
    """The backends "auto" chooses among for a layer on ``device``: triton (the baseline) and
    flashinfer, where available and able to serve the layer; none off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return []
    return [name for name in ("triton", "flashinfer") if _serves(name, spec, device)]


def auto_policy(spec: LayerSpec, device: torch.device | str, num_layers: int = 1) -> AutoPolicy:
    """What "auto" runs for a group of ``num_layers`` layers like ``spec``, per step kind.

    Reference off CUDA; the only candidate when one backend serves the layer; with triton and
    flashinfer both able, the cost table of a known GPU (H100, H200); on other GPUs triton for
    every kind until a self-timing decides (``measured=False``; PagedAttention runs it at the
    first step, :mod:`paged_ops.backends.self_timing`).
    """
    from paged_ops.backends import cost_table

    candidates = auto_candidates(spec, device)
    if not candidates:
        return cost_table.uniform_policy("reference", "no CUDA backend serves the layer")
    if len(candidates) == 1:
        return cost_table.uniform_policy(candidates[0], f"only {candidates[0]} serves the layer")
    family = cost_table.gpu_family(device)
    if family is not None:
        return cost_table.table_policy(family, spec, num_layers)
    pending = cost_table.uniform_policy("triton", "unknown GPU: triton until self-timed")
    return dataclasses.replace(pending, measured=False)


def resolve_backend(
    name: str, spec: LayerSpec, device: torch.device | str, step_kind: str = "decode"
) -> str:
    """Turn ``name`` ("auto" or a backend name) into the concrete backend for one layer.

    "auto" gives the backend of ``step_kind`` (one of "decode", "prefill", "mixed") from
    :func:`auto_policy`, as for a single layer and a prefill step of any size: triton or
    flashinfer on CUDA, reference elsewhere. An explicitly named backend serves every step kind;
    one that cannot serve the request raises a ``ValueError`` that says why and what to use
    instead.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__}")
    if step_kind not in STEP_KINDS:
        raise ValueError(f"unknown step kind {step_kind!r}; expected one of {list(STEP_KINDS)}")
    device = torch.device(device)
    if name == "auto":
        return auto_policy(spec, device).backends[step_kind]
    if name not in _BACKEND_MODULES:
        _load(name)  # raises the "unknown backend" error
    if not _is_available(name):
        raise ValueError(
            f"backend {name!r} is not available on this machine (available: "
            f"{available_backends()}); install its extra (pip install 'paged-ops[{name}]') or use "
            "backend='auto'"
        )
    reason = _load(name).unsupported_reason(spec, device)
    if reason is not None:
        hint = (
            " Use backend='triton' (any head size, sinks, ALiBi) or 'auto'."
            if name != "triton"
            else ""
        )
        raise ValueError(f"backend {name!r} cannot serve this layer: {reason}.{hint}")
    return name


# Backend state that is not a tensor (FlashInfer's planned wrappers) is held by its owner and reached
# from inside an op through a small integer handle, a constant of the trace.
_PLAN_STATES: dict[int, Any] = {}
_NEXT_HANDLE = itertools.count()  # never reused: a released handle never names another state


def register_plan_state(state: Any) -> int:
    """Store ``state`` and return the integer handle an op will receive as ``plan_handle``;
    :func:`release_plan_state` drops it (the PagedAttention does when it is unbound)."""
    handle = next(_NEXT_HANDLE)
    _PLAN_STATES[handle] = state
    return handle


def get_plan_state(handle: int) -> Any:
    if handle not in _PLAN_STATES:
        raise ValueError(f"no planned backend state under handle {handle}; was plan() called?")
    return _PLAN_STATES[handle]


def release_plan_state(handle: int) -> None:
    _PLAN_STATES.pop(handle, None)


def restore_plan_state(handle: int, state: Any) -> None:
    """Put a released state back under its own handle (handles are never reused)."""
    _PLAN_STATES[handle] = state
