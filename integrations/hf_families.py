"""Which transformers families paged attention serves, and what it reads from their modules.

Per-layer constants are read from the attention modules (``module.scaling``, the layer's sliding
window, ``attn_logit_softcapping``, gpt-oss sinks) into :class:`~paged_ops.module.LayerConfig`.
The values transformers passes per call are checked against them when the forward is traced
(:func:`check_call`), so a family that computes attention differently from what was read fails
loudly, never silently.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paged_ops.cache import blocks_needed
from paged_ops.module import LayerConfig, PagedAttention

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_CACHE_SEQS = 8  # the default cache holds this many full-length sequences

# model_type -> where each layer's sliding window comes from:
#   "none":   the family has no sliding window;
#   "config": config.sliding_window applies to every layer (Mistral, Phi-3, Starcoder2, Mixtral);
#   "layer":  the attention module's own ``sliding_window`` (set from config.layer_types).
# Every family here is checked against eager attention in tests/test_hf_parity.py.
FAMILIES: dict[str, str] = {
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
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(FAMILIES))


def attention_modules(model: nn.Module) -> list[nn.Module]:
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


def check_supported(model: nn.Module) -> list[nn.Module]:
    """The model's attention modules, or ValueError saying why paged attention cannot serve it."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"model_type {model_type!r} is an encoder-decoder model")
    if getattr(config, "kv_lora_rank", None) is not None:
        raise ValueError(f"model_type {model_type!r} uses multi-head latent attention (MLA)")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not in the table")
    modules = attention_modules(model)
    head_dims = {int(m.head_dim) for m in modules}
    if len(head_dims) != 1:
        raise ValueError(f"layers have different head sizes {sorted(head_dims)}")
    if not all(getattr(m, "is_causal", True) for m in modules):
        raise ValueError(f"model_type {model_type!r} is configured for bidirectional attention")
    return modules


def refusal(reason: str) -> str:
    return (
        f"paged_ops cannot serve this model: {reason}. Supported model types: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)} (decoder-only, causal, one head size, no MLA)."
    )


def layer_config(module: nn.Module, config: Any) -> LayerConfig:
    """The paged-attention constants of one HF attention module."""
    window_rule = FAMILIES[config.model_type]
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


def check_call(cfg: LayerConfig, layer_idx: int, kwargs: dict[str, Any], has_sinks: bool) -> None:
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


def tensor_parallel_size(model: nn.Module | Any) -> int:
    """How many ranks the heads of ``model`` (or of the model running with this config) are
    sharded over: the ``tp_size`` transformers records when ``from_pretrained(..., tp_plan=...)``
    shards a model under ``torchrun`` (1 otherwise)."""
    size = getattr(model, "_tp_size", None)
    if size is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        size = getattr(getattr(model, "distributed_config", None), "tp_size", None)
    return int(size or 1)


def _local_rows(module: nn.Module | None) -> int | None:
    """Output rows of this rank's shard of a linear's weight (``None`` unless a DTensor)."""
    weight = getattr(module, "weight", None)
    return int(weight.to_local().shape[0]) if hasattr(weight, "to_local") else None


def local_heads(modules: list[nn.Module], config: Any, tp_size: int = 1) -> tuple[int, int]:
    """``(query heads, KV heads)`` that one rank's attention computes.

    transformers' tp plan shards ``q_proj``/``k_proj``/``v_proj`` column-wise: each of ``tp_size``
    ranks holds ``Hq / tp_size`` query and ``Hkv / tp_size`` KV heads. It does not replicate KV
    heads (5.17 and 5.24: over more ranks than KV heads a head is split, and the model's own
    reshape fails), so a ``tp_size`` that does not divide both counts is a ``ValueError``; so are
    sharded projections (DTensor weights) that hold another number of heads (a custom plan).
    """
    num_q = int(config.num_attention_heads)
    num_kv = int(getattr(config, "num_key_value_heads", None) or num_q)
    if tp_size == 1:
        return num_q, num_kv
    if num_q % tp_size or num_kv % tp_size:
        raise ValueError(
            f"tensor parallelism over {tp_size} ranks needs the query heads ({num_q}) and the KV "
            f"heads ({num_kv}) to be multiples of {tp_size}: the tp plan shards q/k/v "
            "column-wise and would split a KV head (neither transformers nor paged_ops "
            f"replicates KV heads). Run on a number of processes that divides {num_kv}"
        )
    want = {"q_proj": num_q // tp_size, "k_proj": num_kv // tp_size, "v_proj": num_kv // tp_size}
    for i, module in enumerate(modules):
        head_dim = int(module.head_dim)
        for name, heads in want.items():
            rows = _local_rows(getattr(module, name, None))
            if rows is not None and rows != heads * head_dim:
                raise ValueError(
                    f"layer {i}: {name} holds {rows} output rows on this rank, expected {heads} "
                    f"heads x {head_dim} (the config's heads over {tp_size} ranks); paged_ops "
                    "serves tp plans that shard q/k/v column-wise by heads (tp_plan='auto')"
                )
    return want["q_proj"], want["k_proj"]


def new_paged_attention(
    modules: list[nn.Module],
    config: Any,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: str = "auto",
    block_size: int = 16,
    num_blocks: int | None = None,
    max_num_seqs: int = 256,
    max_model_len: int | None = None,
    max_num_tokens: int | None = None,
    kv_cache_dtype: torch.dtype | str | None = None,
    calculate_kv_scales: bool = False,
    tp_size: int = 1,
) -> PagedAttention:
    """A PagedAttention for a model with these attention modules (defaults sized from config).

    The cache holds one rank's heads of a model sharded over ``tp_size`` ranks (:func:`local_heads`).
    Defaults: ``max_model_len = min(max_position_embeddings, 4096)``; ``num_blocks`` holds
    ``min(max_num_seqs, 8)`` sequences of ``max_model_len`` tokens. An FP8 cache takes the
    checkpoint's KV scales when its attention modules carry them (:func:`checkpoint_kv_scales`).
    """
    if max_model_len is None:
        max_model_len = min(
            getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN,
            DEFAULT_MAX_MODEL_LEN,
        )
    if num_blocks is None:
        num_blocks = blocks_needed(max_model_len, block_size) * min(
            max_num_seqs, DEFAULT_CACHE_SEQS
        )
    num_q_heads, num_kv_heads = local_heads(modules, config, tp_size)
    with torch.inference_mode(False):  # a cache made under inference_mode must serve later too
        pa = PagedAttention(
            num_layers=len(modules),
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(modules[0].head_dim),
            layers=[layer_config(m, config) for m in modules],
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_tokens=max_num_tokens,
            max_model_len=max_model_len,
            dtype=dtype,
            device=device,
            backend=backend,
            kv_cache_dtype=kv_cache_dtype,
            calculate_kv_scales=calculate_kv_scales,
        )
        scales = checkpoint_kv_scales(modules) if pa.k_scales is not None else None
        if scales is not None:
            pa.set_kv_scales(*scales)
            if calculate_kv_scales:  # measuring overrides the checkpoint's
                pa.recalibrate_kv_scales()
        return pa


def checkpoint_kv_scales(modules: list[nn.Module]) -> tuple[list, list] | None:
    """The KV-cache scales a quantized checkpoint stores on its attention modules, or ``None``.

    Read as compressed-tensors / llm-compressor FP8 checkpoints carry them through transformers:
    ``self_attn.k_scale``/``v_scale`` (a tensor of 1 or Hkv values), or the older
    ``self_attn.k_proj.output_scale``/``v_proj.output_scale``. Every layer must have both.
    """
    found: tuple[list, list] = ([], [])
    for module in modules:
        for i, name in enumerate(("k", "v")):
            scale = getattr(module, f"{name}_scale", None)
            if scale is None:
                proj = getattr(module, f"{name}_proj", None)
                scale = getattr(proj, "output_scale", None) if proj is not None else None
            if scale is None or getattr(scale, "is_meta", False):
                return None
            found[i].append(torch.as_tensor(scale).detach().float().cpu())
    return found
