"""Which PagedAttention serves which transformers model.

A model gets its PagedAttention from ``patch_model`` (explicit sizes), or lazily when it was
loaded with ``attn_implementation="paged_ops"``: from the model itself the first time something
asks for it (``generate``, ``PagedCache(model)``, ``paged_attention_of(model, create=True)``), or,
for a first plain forward, from the config the forward runs with (its layer constants read from a
meta-device copy of the model). The link lives in three places, each minimal:

- each attention module holds a plain (unregistered) reference to the PagedAttention, so the
  state dict and ``.to()`` are unchanged and ``torch.compile`` sees a constant attribute;
- the model holds a :class:`Binding` (the PagedAttention, the config before patching, the hook
  that fills packed steps' positions), which ``unpatch_model`` undoes;
- a registry maps the config object the model runs with to its PagedAttention: the mask function
  transformers calls receives only the config.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from paged_ops.integrations.hf_families import (
    FAMILIES,
    attention_modules,
    check_supported,
    new_paged_attention,
    refusal,
    tensor_parallel_size,
)
from torch import nn
from torch.utils.hooks import RemovableHandle

from paged_ops.module import PACKED_STEP, PagedAttention

ATTN_IMPLEMENTATION = "paged_ops"
PA_ATTR = "_paged_ops_attention"  # on each attention module: the model's PagedAttention
STATE_ATTR = "_paged_ops_state"  # on the model: its Binding

# id(config) -> (weak reference to the config, its PagedAttention)
_BY_CONFIG: dict[int, tuple[weakref.ref, PagedAttention]] = {}


@dataclass
class Binding:
    """What links a model to its PagedAttention (``model._paged_ops_state``)."""

    pa: PagedAttention
    original_config: Any | None  # patch_model: the config before patching; None if loaded so
    hook: RemovableHandle


def pa_for_config(config: Any) -> PagedAttention | None:
    entry = _BY_CONFIG.get(id(config))
    return entry[1] if entry is not None and entry[0]() is config else None


def _register_config(config: Any, pa: PagedAttention) -> None:
    key = id(config)
    _BY_CONFIG[key] = (weakref.ref(config, lambda _: _BY_CONFIG.pop(key, None)), pa)


def _fill_packed_positions(pa: PagedAttention) -> Any:
    """A forward pre-hook for the decoder: a packed step without ``position_ids`` gets the
    prepared step's positions (transformers would otherwise use ``0..T-1``)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        if (
            kwargs.get("position_ids") is not None
            or kwargs.get("past_key_values") is not None
            or kwargs.get("cache") is not None  # the same argument from transformers 5.24 on
            or kwargs.get("attention_mask") is not None
            or pa.pending_step != PACKED_STEP
        ):
            return None
        inputs = kwargs.get("input_ids")
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        if inputs is None or inputs.shape[:2] != (1, pa.metadata.padded_num_tokens):
            return None  # not this step's shape: the mask function says what is wrong
        kwargs["position_ids"] = pa.metadata.positions[None]  # [1, T]
        return args, kwargs

    return hook


def bind(
    model: nn.Module, pa: PagedAttention, modules: list[nn.Module], original_config: Any | None
) -> None:
    """Attach ``pa`` to the model's attention modules, its decoder and its config."""
    pa.routing.restore()  # a PagedAttention unbound before (e.g. by a failed LLM) is bound again
    for m in modules:
        object.__setattr__(m, PA_ATTR, pa)  # not a submodule: state dict and .to() unchanged
    decoder = model.get_decoder()
    hook = decoder.register_forward_pre_hook(_fill_packed_positions(pa), with_kwargs=True)
    object.__setattr__(model, STATE_ATTR, Binding(pa, original_config, hook))
    _register_config(model.config, pa)


def unbind(model: nn.Module) -> Binding:
    """Undo :func:`bind`; returns the binding (ValueError if the model has none)."""
    binding = model.__dict__.get(STATE_ATTR)
    if binding is None:
        raise ValueError("the model is not patched by paged_ops")
    binding.hook.remove()
    binding.pa.routing.release()  # the registry would keep its planners (and their buffers)
    for m in attention_modules(model):
        m.__dict__.pop(PA_ATTR, None)
    _BY_CONFIG.pop(id(model.config), None)
    del model.__dict__[STATE_ATTR]
    return binding


def binding_of(model: nn.Module) -> Binding | None:
    return model.__dict__.get(STATE_ATTR)


def paged_attention_of(model: nn.Module, *, create: bool = False) -> PagedAttention | None:
    """The PagedAttention serving ``model``, or ``None`` if it runs another attention.

    A model loaded with ``attn_implementation="paged_ops"`` gets one with default sizes on first
    use; ``create=True`` makes it now (``ValueError`` for a model paged attention cannot serve).
    """
    binding = binding_of(model)
    if binding is not None:
        return binding.pa
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return None
    pa = pa_for_config(config)
    if pa is None and not create:
        return None
    try:
        modules = check_supported(model)
    except ValueError as err:
        raise ValueError(refusal(str(err))) from None
    if pa is None:
        param = next(model.parameters())
        pa = new_paged_attention(
            modules,
            config,
            dtype=param.dtype,
            device=param.device,
            tp_size=tensor_parallel_size(model),
        )
    bind(model, pa, modules, None)
    return pa


def pa_for_forward(config: Any, dtype: torch.dtype, device: torch.device) -> PagedAttention:
    """The PagedAttention of the model running with ``config`` (eager code only).

    For a model loaded with ``attn_implementation="paged_ops"`` whose first use is a plain
    forward, it is created here with default sizes; its layer constants come from a meta-device
    copy of the model (no memory), read exactly as ``patch_model`` reads them.
    """
    pa = pa_for_config(config)
    if pa is not None:
        return pa
    if getattr(config, "model_type", None) not in FAMILIES:
        raise ValueError(
            refusal(f"model_type {getattr(config, 'model_type', None)!r} is not in the table")
        )
    import transformers

    with torch.device("meta"):
        shadow = transformers.AutoModelForCausalLM.from_config(config)
    try:
        modules = check_supported(shadow)
    except ValueError as err:
        raise ValueError(refusal(str(err))) from None
    tp_size = tensor_parallel_size(config)  # the meta shadow is whole; the config knows the ranks
    pa = new_paged_attention(modules, config, dtype=dtype, device=device, tp_size=tp_size)
    _register_config(config, pa)
    return pa


def module_pa(module: nn.Module) -> PagedAttention:
    """The PagedAttention of an attention module (attached on first use for a loaded model)."""
    pa = module.__dict__.get(PA_ATTR)
    if pa is not None:
        return pa
    pa = None if torch.compiler.is_compiling() else pa_for_config(getattr(module, "config", None))
    if pa is None:
        raise RuntimeError(
            f"{type(module).__name__} has no PagedAttention attached: run patch_model(model) on "
            f"this model (or one eager forward of a model loaded with attn_implementation="
            f"{ATTN_IMPLEMENTATION!r} before compiling it), or set its attention implementation "
            f"away from {ATTN_IMPLEMENTATION!r}"
        )
    object.__setattr__(module, PA_ATTR, pa)
    return pa
