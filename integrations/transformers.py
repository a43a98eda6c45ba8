"""Hugging Face integration: swap a causal LM's attention for paged-KV-cache attention.

``patch_model(model)`` registers one attention function under the name ``"paged_ops"`` in
``transformers.AttentionInterface`` and switches the model to it. Because no attention *mask*
function is registered under that name, transformers builds no 4D mask (the function receives
``attention_mask=None``); masking is the paged op's job (causal, sliding window, per sequence).

Each attention module gets a plain (unregistered) reference to the model's
:class:`~paged_ops.module.PagedAttention`, so two patched models in one process stay apart, the
state dict is unchanged, and ``torch.compile`` sees a constant attribute (no graph break).

Per-layer constants are read from the model at patch time (``module.scaling``, the layer's sliding
window, ``attn_logit_softcapping``, gpt-oss sinks) into :class:`~paged_ops.module.LayerConfig`.
The values transformers passes per call are checked against them when the forward is traced, so a
family that computes attention differently from what was read fails loudly, never silently.

The model then runs on packed inputs: see :func:`forward_step` and the README for the loop.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from paged_ops.cache import blocks_needed
from paged_ops.module import LayerConfig, PagedAttention

ATTN_IMPLEMENTATION = "paged_ops"
_PA_ATTR = "_paged_ops_attention"  # on each attention module: the model's PagedAttention
_STATE_ATTR = "_paged_ops_state"  # on the model: (original config, pa, patched private config)
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_CACHE_SEQS = 8  # the default cache holds this many full-length sequences

# model_type -> where each layer's sliding window comes from:
#   "none":   the family has no sliding window;
#   "config": config.sliding_window applies to every layer (Mistral, Phi-3, Starcoder2, Mixtral);
#   "layer":  the attention module's own ``sliding_window`` (set from config.layer_types).
# Every family here is checked against eager attention in tests/test_hf_parity.py.
_FAMILIES: dict[str, str] = {
    "apertus": "none",
    "arcee": "none",
    "cohere": "none",
    "cohere2": "layer",
    "ernie4_5": "none",
    "gemma": "none",
    "gemma2": "layer",
    "gemma3_text": "layer",
    "glm": "none",
    "glm4": "none",
    "gpt_oss": "layer",
    "granite": "none",
    "granitemoe": "none",
    "helium": "none",
    "hunyuan_v1_dense": "none",
    "llama": "none",
    "ministral": "layer",
    "mistral": "config",
    "mixtral": "config",
    "nemotron": "none",
    "olmo": "none",
    "olmo2": "none",
    "olmo3": "layer",
    "phi": "none",
    "phi3": "config",
    "qwen2": "layer",
    "qwen2_moe": "layer",  # the window reaches eager attention through the mask only
    "qwen3": "layer",
    "qwen3_moe": "layer",
    "seed_oss": "none",
    "smollm3": "layer",
    "stablelm": "none",
    "starcoder2": "config",
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_FAMILIES))


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's ``self_attn`` in layer order; ValueError when the layout differs."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError("the model has no decoder `.layers`")
    modules = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or getattr(attn, "layer_idx", None) != i:
            raise ValueError(f"decoder layer {i} has no `self_attn` with `layer_idx == {i}`")
        modules.append(attn)
    return modules


def _check_supported(model: nn.Module) -> list[nn.Module]:
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"model_type {model_type!r} is an encoder-decoder model")
    if getattr(config, "kv_lora_rank", None) is not None:
        raise ValueError(f"model_type {model_type!r} uses multi-head latent attention (MLA)")
    if model_type not in _FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not in the table")
    modules = _attention_modules(model)
    head_dims = {int(m.head_dim) for m in modules}
    if len(head_dims) != 1:
        raise ValueError(f"layers have different head sizes {sorted(head_dims)}")
    if not all(getattr(m, "is_causal", True) for m in modules):
        raise ValueError(f"model_type {model_type!r} is configured for bidirectional attention")
    if hasattr(model, _STATE_ATTR):
        raise ValueError("the model is already patched; call unpatch_model(model) first")
    return modules


def _layer_config(module: nn.Module, config: Any, window_rule: str) -> LayerConfig:
    """The paged-attention constants of one HF attention module."""
    if window_rule == "layer":
        window = getattr(module, "sliding_window", None)
    elif window_rule == "config":
        window = getattr(config, "sliding_window", None)
    else:
        window = None
    softcap = getattr(module, "attn_logit_softcapping", None)
    return LayerConfig(
        scale=float(module.scaling),
        sliding_window=int(window) if window else None,
        softcap=float(softcap) if softcap else None,
        has_sinks=isinstance(getattr(module, "sinks", None), torch.Tensor),
        causal=True,
    )


def _check_call(cfg: LayerConfig, layer_idx: int, kwargs: dict[str, Any], has_sinks: bool) -> None:
    """Trace-time check: the per-call constants transformers passes agree with the layer config.

    A constant the model does not pass (e.g. Qwen2-MoE applies its window through the mask only)
    is not checked; the value read at patch time stands.
    """
    window = kwargs.get("sliding_window", cfg.sliding_window) or None
    softcap = kwargs.get("softcap", cfg.softcap) or None
    scaling = kwargs.get("scaling")
    if (
        window != cfg.sliding_window
        or softcap != cfg.softcap
        or has_sinks != cfg.has_sinks
        or (scaling is not None and abs(scaling - cfg.scale) > 1e-6 * abs(cfg.scale))
    ):
        raise ValueError(
            f"layer {layer_idx}: the model called attention with sliding_window={window}, "
            f"softcap={softcap}, scaling={scaling}, sinks={has_sinks}, but patch_model read {cfg}"
        )


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``"paged_ops"`` attention function transformers calls from each attention layer.

    Args:
        query: ``[1, Hq, T, D]``; key, value: ``[1, Hkv, T, D]`` (after RoPE and q/k norms), the
            packed tokens of every sequence of the step prepared by ``pa.prepare``.
        attention_mask: ignored (``None`` for a patched model); the metadata carries the masking.
        kwargs: ``sliding_window``, ``softcap``, ``s_aux`` (gpt-oss sinks ``[Hq]``) as the model
            passes them; checked against the layer config read by :func:`patch_model`.
    Returns:
        ``([1, T, Hq, D], None)``.
    """
    pa: PagedAttention | None = module.__dict__.get(_PA_ATTR)
    if pa is None:
        raise RuntimeError(
            f"{type(module).__name__} has no PagedAttention attached: run patch_model(model) on "
            f"this model, or set its attention implementation away from {ATTN_IMPLEMENTATION!r}"
        )
    if query.shape[0] != 1:
        raise ValueError(f"paged attention takes packed inputs of batch 1, got {query.shape[0]}")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported (call model.eval())")
    layer_idx = module.layer_idx
    sinks = kwargs.get("s_aux")
    _check_call(pa.layers[layer_idx], layer_idx, {"scaling": scaling, **kwargs}, sinks is not None)
    q = query[0].transpose(0, 1).contiguous()  # [T, Hq, D]
    k = key[0].transpose(0, 1).contiguous()  # [T, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()  # [T, Hkv, D]
    if sinks is not None:
        sinks = sinks.to(torch.float32)  # [Hq]
    out = pa(layer_idx, q, k, v, sinks=sinks)  # [T, Hq, D]
    return out[None], None  # [1, T, Hq, D]


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def _refuse(reason: str, strict: bool) -> None:
    message = (
        f"paged_ops cannot serve this model: {reason}. Supported model types: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)} (decoder-only, causal, one head size, no MLA)."
    )
    if strict:
        raise ValueError(message)
    warnings.warn(message + " The model was left unchanged.", stacklevel=3)


def patch_model(
    model: nn.Module,
    *,
    backend: str = "auto",
    block_size: int = 16,
    num_blocks: int | None = None,
    max_num_seqs: int = 256,
    max_model_len: int | None = None,
    strict: bool = True,
    max_num_tokens: int | None = None,
) -> PagedAttention | None:
    """Switch a Hugging Face causal LM to paged-KV-cache attention; return its PagedAttention.

    Args:
        model: a transformers ``PreTrainedModel`` of a supported family (``SUPPORTED_MODEL_TYPES``).
        backend: "auto", "reference", "triton" or "flashinfer" (resolved per layer).
        block_size: tokens per KV block.
        num_blocks: KV blocks; default enough for ``min(max_num_seqs, 8)`` sequences of
            ``max_model_len`` tokens each.
        max_num_seqs: most sequences per step.
        max_model_len: longest sequence; default ``min(config.max_position_embeddings, 4096)``.
        max_num_tokens: most tokens per step; default ``max(max_model_len, max_num_seqs)``.
        strict: raise ``ValueError`` for a model that cannot be served; with ``False``, warn and
            return ``None``, leaving the model untouched.

    The cache has the model's parameter dtype and device. Run the model with packed inputs
    (``input_ids``/``position_ids`` ``[1, T]``, ``use_cache=False``) after ``pa.prepare``; see
    :func:`forward_step`.

    Example:
        >>> pa = patch_model(model, max_model_len=1024)
        >>> logits = forward_step(model, pa, {"a": [1, 2, 3], "b": [4, 5]})  # [2, vocab]
    """
    try:
        modules = _check_supported(model)
    except ValueError as err:
        _refuse(str(err), strict)
        return None
    config = model.config
    window_rule = _FAMILIES[config.model_type]
    layers = [_layer_config(m, config, window_rule) for m in modules]
    if max_model_len is None:
        max_model_len = min(
            getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN,
            DEFAULT_MAX_MODEL_LEN,
        )
    if num_blocks is None:
        num_blocks = blocks_needed(max_model_len, block_size) * min(
            max_num_seqs, DEFAULT_CACHE_SEQS
        )
    param = next(model.parameters())
    pa = PagedAttention(
        num_layers=len(modules),
        num_q_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=int(modules[0].head_dim),
        layers=layers,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_tokens=max_num_tokens,
        max_model_len=max_model_len,
        dtype=param.dtype,
        device=param.device,
        backend=backend,
    )
    _register()
    # transformers shares one config object between every model built from it: patch a private
    # copy, so that another model built from the same config keeps its attention and its cache.
    private = copy.deepcopy(config)
    _swap_config(model, config, private)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if private._attn_implementation != ATTN_IMPLEMENTATION:
        _swap_config(model, private, config)
        _refuse("its attention implementation cannot be switched at run time", strict)
        return None
    for m in modules:
        object.__setattr__(m, _PA_ATTR, pa)  # not a submodule: state dict and .to() unchanged
    # The KV cache is ours: a forward that forgets use_cache=False must not also grow a DynamicCache.
    private.use_cache = False
    object.__setattr__(model, _STATE_ATTR, (config, pa, private))
    return pa


def _swap_config(model: nn.Module, old: object, new: object) -> None:
    """Point every module of ``model`` that holds config ``old`` at ``new``."""
    for m in model.modules():
        if m.__dict__.get("config") is old:
            m.config = new


def unpatch_model(model: nn.Module) -> None:
    """Undo :func:`patch_model`: restore the original attention implementation, drop the cache."""
    state = model.__dict__.get(_STATE_ATTR)
    if state is None:
        raise ValueError("the model is not patched by paged_ops")
    shared, _, private = state
    _swap_config(model, private, shared)  # the config as it was, never modified
    for m in _attention_modules(model):
        m.__dict__.pop(_PA_ATTR, None)
    del model.__dict__[_STATE_ATTR]


def paged_attention_of(model: nn.Module) -> PagedAttention | None:
    """The PagedAttention :func:`patch_model` attached to ``model``, or ``None`` if unpatched."""
    state = model.__dict__.get(_STATE_ATTR)
    return None if state is None else state[1]


def forward_step(
    model: nn.Module | Callable[..., Any],
    pa: PagedAttention,
    tokens: Mapping[Hashable, Sequence[int]],
    *,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
) -> torch.Tensor:
    """One packed step: new tokens per sequence in, each sequence's last-token logits out.

    Args:
        model: the patched model, or a compiled wrapper of it (called with keyword arguments).
        pa: the PagedAttention :func:`patch_model` returned.
        tokens: ``{seq_id: new token ids}``; a new ``seq_id`` starts a sequence (its prompt).
        num_tokens, num_seqs: pad the step to these sizes (fixed shapes for compiled decode).
    Returns:
        ``[S, vocab]`` logits in the order of ``tokens`` (S = real sequences).
    """
    md = pa.prepare(
        {sid: len(ids) for sid, ids in tokens.items()}, num_tokens=num_tokens, num_seqs=num_seqs
    )
    flat = [t for ids in tokens.values() for t in ids]
    input_ids = torch.zeros(md.padded_num_tokens, dtype=torch.long)
    input_ids[: len(flat)] = torch.tensor(flat, dtype=torch.long)
    out = model(
        input_ids=input_ids.to(md.positions.device)[None],  # [1, T]
        position_ids=md.positions[None],  # [1, T]
        use_cache=False,
        logits_to_keep=md.logits_indices,  # [S_padded]
    )
    return out.logits[0, : md.num_seqs]  # [S, vocab]
