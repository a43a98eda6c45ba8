"""Hugging Face integration: swap a causal LM's attention for paged-KV-cache attention.

``import paged_ops.integrations.transformers`` registers the name ``"paged_ops"`` with
transformers: an attention function (``AttentionInterface``) and a mask function
(``AttentionMaskInterface``) that prepares each step (see :mod:`.hf_attention`). A model then runs
on paged attention either because ``patch_model(model)`` switched it (explicit cache sizes), or
because it was loaded with ``from_pretrained/from_config(..., attn_implementation="paged_ops")``
(default sizes, created on first use).

Either way it stays a transformers model:

- ``model(input_ids [B, T], attention_mask [B, T], cache=...)`` (``past_key_values=`` before
  transformers 5.24) runs on the ops, each row one sequence (padding at either end of a row gets
  no KV slot);
- ``model.generate(...)`` keeps its keys in a :class:`~.hf_cache.PagedCache` it creates by itself
  (this module wraps transformers' ``_prepare_cache_for_generation`` for models running
  ``"paged_ops"`` only), including HF's compiled decode (``cache_implementation="static"``);
- the packed low-level loop (``pa.prepare`` + ``[1, T]`` inputs, :func:`forward_step`) that the
  ``LLM`` engine drives keeps working on the same cache.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from paged_ops.integrations.hf_attention import paged_attention_forward, paged_mask
from paged_ops.integrations.hf_binding import (
    ATTN_IMPLEMENTATION,
    bind,
    binding_of,
    paged_attention_of,
    unbind,
)
from paged_ops.integrations.hf_cache import PagedCache, adopt_cache, cache_kwarg
from paged_ops.integrations.hf_families import (
    DEFAULT_MAX_MODEL_LEN,
    SUPPORTED_MODEL_TYPES,
    attention_modules,
    check_supported,
    new_paged_attention,
    refusal,
    tensor_parallel_size,
)
from torch import nn

from paged_ops.module import PagedAttention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DEFAULT_MAX_MODEL_LEN",
    "SUPPORTED_MODEL_TYPES",
    "PagedCache",
    "forward_step",
    "paged_attention_of",
    "patch_model",
    "sizes_fixed",
    "unpatch_model",
]


def _paged_cache_for_generation(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``GenerationMixin._prepare_cache_for_generation``: a model running ``"paged_ops"``
    generates with a PagedCache; every other model goes through transformers' own code."""

    def _prepare_cache_for_generation(
        self: nn.Module,
        generation_config: Any,
        model_kwargs: dict[str, Any],
        generation_mode: Any,
        batch_size: int,
        max_cache_length: int,
    ) -> Any:
        if getattr(self.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            return original(
                self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        pa = paged_attention_of(self, create=True)
        impl = generation_config.cache_implementation
        key = cache_kwarg()  # "cache" from transformers 5.24 on, "past_key_values" before
        cache = model_kwargs.get(key)
        if cache is not None:
            if impl is not None:
                raise ValueError(f"pass either cache_implementation or {key} to generate, not both")
            adopt_cache(cache, pa)
            cache._is_user_defined = True
            return None
        if generation_config.use_cache is False:
            return None
        if impl in (None, "dynamic"):
            model_kwargs[key] = PagedCache(pa)
        elif impl == "static":
            longest = max(max_cache_length, getattr(generation_config, "max_cache_len", None) or 0)
            model_kwargs[key] = PagedCache(pa, max_cache_len=longest)
        else:
            raise ValueError(
                f"cache_implementation={impl!r} cannot hold a paged_ops model's keys: they live in "
                "paged_ops' block pool. Use None/'dynamic' (blocks as the rows grow) or 'static' "
                "(compileable: transformers compiles the decode step)"
            )
        return None

    _prepare_cache_for_generation.__wrapped__ = original  # type: ignore[attr-defined]
    return _prepare_cache_for_generation


def register() -> None:
    """Register ``"paged_ops"`` with transformers (done when this module is imported)."""
    from transformers import AttentionInterface
    from transformers.generation.utils import GenerationMixin
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, paged_mask)
    current = GenerationMixin._prepare_cache_for_generation
    if not hasattr(current, "__wrapped__"):
        GenerationMixin._prepare_cache_for_generation = _paged_cache_for_generation(current)


def _refuse(reason: str, strict: bool) -> None:
    message = refusal(reason)
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
    kv_cache_dtype: torch.dtype | str | None = None,
    calculate_kv_scales: bool = False,
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
        max_num_tokens: most tokens per packed step; default ``max(max_model_len, max_num_seqs)``.
        strict: raise ``ValueError`` for a model that cannot be served; with ``False``, warn and
            return ``None``, leaving the model untouched.
        kv_cache_dtype: ``None``/"auto" (the model's dtype), "fp8"/"fp8_e4m3" or "fp8_e5m2" (or the
            torch dtype): an FP8 cache holds twice the tokens per byte. Its scales come from the
            checkpoint when the attention modules carry ``k_scale``/``v_scale``, else 1.0.
        calculate_kv_scales: FP8 only: the first step with real tokens measures per-layer,
            per-head K/V amax and fixes the scales (see :class:`PagedAttention`); later tokens
            beyond twice that range saturate.

    The cache has the model's parameter dtype and device (patch after ``.to(device)``); for a model
    sharded by ``from_pretrained(..., tp_plan="auto")`` under ``torchrun`` it holds this rank's
    heads (``ValueError`` when the world size does not divide the KV heads). The model
    keeps working as a transformers model (``model(...)``, ``generate``); it patches a private
    copy of the config, so other models built from the same config object are untouched and
    ``save_pretrained`` writes the config as it was.

    Example:
        >>> pa = patch_model(model, max_model_len=1024)
        >>> model.generate(**tok(["Hi", "Hello there"], padding=True, return_tensors="pt"))
        >>> logits = forward_step(model, pa, {"a": [1, 2, 3], "b": [4, 5]})  # [2, vocab]
    """
    try:
        modules = check_supported(model)
        binding = binding_of(model)
        if binding is not None and binding.original_config is not None:
            raise ValueError("the model is already patched; call unpatch_model(model) first")
    except ValueError as err:
        _refuse(str(err), strict)
        return None
    param = next(model.parameters())
    pa = new_paged_attention(
        modules,
        model.config,
        dtype=param.dtype,
        device=param.device,
        backend=backend,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_tokens=max_num_tokens,
        kv_cache_dtype=kv_cache_dtype,
        calculate_kv_scales=calculate_kv_scales,
        tp_size=tensor_parallel_size(model),
    )
    if binding is not None:
        unbind(
            model
        )  # loaded with attn_implementation="paged_ops": explicit sizes replace defaults
    config = model.config
    # transformers shares one config object between every model built from it: patch a private
    # copy, so that another model built from the same config keeps its attention.
    private = copy.deepcopy(config)
    _swap_config(model, config, private)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if private._attn_implementation != ATTN_IMPLEMENTATION:
        _swap_config(model, private, config)
        _refuse("its attention implementation cannot be switched at run time", strict)
        return None
    bind(model, pa, modules, config)
    return pa


def _swap_config(model: nn.Module, old: object, new: object) -> None:
    """Point every module of ``model`` that holds config ``old`` at ``new``."""
    for m in model.modules():
        if m.__dict__.get("config") is old:
            m.config = new


def unpatch_model(model: nn.Module) -> None:
    """Undo :func:`patch_model`: restore the original config and attention, drop the cache.

    An ``LLM`` built on the model refuses to run afterwards. A model loaded with
    ``attn_implementation="paged_ops"`` has no other attention to go back to:
    ``model.set_attn_implementation("sdpa")`` switches it.
    """
    binding = binding_of(model)
    if binding is None:
        raise ValueError("the model is not patched by paged_ops")
    if binding.original_config is None:
        raise ValueError(
            "the model was loaded with attn_implementation='paged_ops', not patched; switch it "
            "with model.set_attn_implementation('sdpa') (or 'eager')"
        )
    unbind(model)
    _swap_config(model, model.config, binding.original_config)  # the config as it was


def snapshot_model(model: nn.Module) -> Callable[[], None]:
    """A function that puts back what patching, fusing and serving may change on ``model``: its
    paged_ops binding (or its absence), its config object, its parameter objects and its
    train/eval mode, as they are now. ``LLM`` calls it when its construction fails."""
    binding, config, training = binding_of(model), model.config, model.training
    params = [(m, name, p) for m in model.modules() for name, p in m._parameters.items()]

    def restore() -> None:
        now = binding_of(model)
        if now is not binding:
            if now is not None:
                unbind(model)
            _swap_config(model, model.config, config)
            if binding is not None:
                bind(model, binding.pa, list(attention_modules(model)), binding.original_config)
        for module, name, param in params:
            if module._parameters.get(name) is not param:
                setattr(module, name, param)
        model.train(training)

    return restore


def sizes_fixed(model: nn.Module) -> bool:
    """Whether the model's PagedAttention sizes are settled: chosen by ``patch_model``, or in use
    (a model loaded with ``attn_implementation="paged_ops"`` whose caches hold blocks). Otherwise
    ``patch_model`` may replace its default-sized one."""
    binding = binding_of(model)
    if binding is None:
        return False
    pa = binding.pa
    return binding.original_config is not None or pa.allocator.num_free < pa.kv_cache.num_blocks


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


register()
