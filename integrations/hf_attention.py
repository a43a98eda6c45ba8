"""The ``"paged_ops"`` attention and mask functions transformers calls, and how a step reaches them.

transformers builds a model's masks once per forward with the function registered under the
model's attention name in ``AttentionMaskInterface``, then calls the attention function of every
layer with what it returned. Paged attention uses that channel:

- the **mask function** runs before the first layer, with the 2D padding mask, the batch and query
  sizes, and (through :meth:`PagedLayer.get_mask_sizes`) the model's :class:`PagedCache`. It
  describes the step: a packed step already prepared by ``pa.prepare`` (engine, ``forward_step``)
  is checked; a ``[B, T]`` step is built on the host by the cache's rows (or by one-forward rows
  when there is no cache), which allocates blocks and copies the metadata once. It returns a
  zero-size 4D tensor (:data:`STEP_PREPARED`), which transformers passes through untouched.
  ``generate`` calls it *before* a compiled decode forward (its ``prepare_inputs_for_generation``),
  so that host work stays out of the graph; inside a compiled forward it only continues a decode
  step on the device (:meth:`PagedRows.decode_step`) and returns that step itself.
- the **attention function** packs ``[B, Hq, T, D]`` into the ops' ``[B*T, Hq, D]`` (row-major,
  the layout the step was built for), writes the new keys and values and attends.

A custom 4D mask, or a 2D mask with holes, gets a ``ValueError`` before any paged op runs: a mask is
never silently dropped.
"""

from __future__ import annotations

from typing import Any

import torch
from paged_ops.integrations.hf_binding import module_pa, pa_for_forward
from paged_ops.integrations.hf_cache import DeviceStep, PagedRows, cache_kwarg
from paged_ops.integrations.hf_families import check_call
from torch import nn

from paged_ops.module import PACKED_STEP, PagedAttention


class _PackedStep:
    """What the mask function hands the layers for a packed step prepared by ``pa.prepare``."""

    def __repr__(self) -> str:
        return "PACKED"


PACKED = _PackedStep()


def _step_prepared(batch_size: int, query_length: int, device: Any) -> torch.Tensor:
    """The mask function's answer: a zero-size 4D tensor (``[B, 0, T, 0]``), which transformers
    forwards as a ready-made mask, telling the attention layers the step is in ``pa.metadata``."""
    return torch.empty(batch_size, 0, query_length, 0, device=device)


def _is_step_prepared(mask: Any) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == 0


def paged_mask(
    batch_size: int,
    q_length: int,
    kv_length: int | None = None,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    config: Any = None,
    dtype: torch.dtype | None = None,
    device: Any = None,
    **kwargs: Any,
) -> torch.Tensor | DeviceStep:
    """The ``"paged_ops"`` entry of ``transformers.AttentionMaskInterface``: prepares the step."""
    rows = kv_offset if isinstance(kv_offset, PagedRows) else None
    if torch.compiler.is_compiling():
        if rows is not None:
            if q_length != 1:
                raise ValueError(
                    f"a compiled forward got {q_length} new tokens per row for a paged cache: only "
                    "decode steps run compiled (transformers compiles generate's decode step); "
                    "run steps of several tokens eagerly"
                )
            new = attention_mask[:, -1] if attention_mask is not None else None
            return rows.decode_step(new)
        return PACKED  # no host work here: only a step pa.prepare made can run (checked at layer 0)
    pa = rows.pa if rows is not None else pa_for_forward(config, dtype, torch.device(device))
    key = (id(rows), batch_size, q_length)
    if pa.pending_step == key:  # the second mask (sliding layers) of the same forward
        return _step_prepared(batch_size, q_length, device)
    if (
        rows is None
        and attention_mask is None
        and batch_size == 1
        and pa.pending_step == PACKED_STEP
    ):
        tokens = pa.metadata.padded_num_tokens
        if q_length != tokens:
            raise ValueError(
                f"a packed step of {tokens} tokens was prepared (pa.prepare), but the model got "
                f"{q_length}: feed input_ids/position_ids of shape [1, {tokens}]"
            )
        return PACKED
    owner = None
    if rows is None:  # a forward without a cache: its rows live until the next step
        owner = rows = (
            pa.step_owner if isinstance(pa.step_owner, PagedRows) else PagedRows(pa, None)
        )
        rows.reset()  # the previous forward's blocks go back (its builder's buffers are reused)
    md = rows.prepare(attention_mask, batch_size, q_length)
    pa.use_step(md, key, owner)
    return _step_prepared(batch_size, q_length, device)


def _foreign_cache_error(module: nn.Module, queries: int, keys: int) -> ValueError:
    return ValueError(
        f"{type(module).__name__} got {keys} keys for {queries} new queries: a transformers cache "
        "that is not a PagedCache is holding this model's keys (e.g. a DynamicCache made by a "
        f"forward with use_cache=True). Pass {cache_kwarg()}=PagedCache(model) to continue a "
        "sequence step by step, or use generate(), which creates one"
    )


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``"paged_ops"`` attention function transformers calls from each attention layer.

    Args:
        query: ``[B, Hq, T, D]``; key, value: ``[B, Hkv, T, D]`` (after RoPE and q/k norms): the
            step the mask function prepared (``B = 1`` and T the packed tokens for a packed step).
        attention_mask: what :func:`paged_mask` returned.
        kwargs: ``sliding_window``, ``softcap``, ``s_aux`` (gpt-oss sinks ``[Hq]``) as the model
            passes them; checked against the layer config read at patch time.
    Returns:
        ``([B, T, Hq, D], None)``.
    """
    pa: PagedAttention = module_pa(module)
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported (call model.eval())")
    layer_idx = module.layer_idx
    sinks = kwargs.get("s_aux")
    check_call(pa.layers[layer_idx], layer_idx, {"scaling": scaling, **kwargs}, sinks is not None)
    bsz, num_heads, t, head_dim = query.shape
    if key.shape[2] != t:
        raise _foreign_cache_error(module, t, key.shape[2])
    if isinstance(attention_mask, DeviceStep):
        md = attention_mask.metadata
        if layer_idx == 0:
            attention_mask.commit()
    elif _is_step_prepared(attention_mask):
        md = pa.metadata
    elif attention_mask is PACKED or attention_mask is None:
        md = pa.metadata
        if layer_idx == 0 and (md is None or pa.pending_step != PACKED_STEP):
            raise RuntimeError(
                "no paged step is prepared for this forward: inside torch.compile (or for a model "
                "that builds no transformers mask) only packed steps prepared by pa.prepare() "
                "run; run [B, T] batches eagerly or through generate()"
            )
    else:
        raise ValueError(
            f"paged attention takes a 2D padding mask ([batch, columns]); got a custom mask of "
            f"shape {tuple(attention_mask.shape)}. Pass the 2D padding mask instead, or run this "
            "model with another attention implementation for custom masks"
        )
    if md.padded_num_tokens != bsz * t:
        raise ValueError(
            f"the prepared step has {md.padded_num_tokens} tokens, the model runs {bsz} x {t}: "
            "prepare the step for these inputs (pa.prepare for packed [1, T] inputs)"
        )
    if layer_idx == 0:
        pa.pending_step = None  # consumed: the next forward needs a step of its own
    q = query.transpose(1, 2).reshape(bsz * t, num_heads, head_dim)  # [B*T, Hq, D]
    k = key.transpose(1, 2).reshape(bsz * t, key.shape[1], head_dim)  # [B*T, Hkv, D]
    v = value.transpose(1, 2).reshape(bsz * t, value.shape[1], head_dim)  # [B*T, Hkv, D]
    if sinks is not None:
        sinks = sinks.to(torch.float32)  # [Hq]
    # the prepared step (pa.metadata) goes by default: the forward then knows its kind
    device_step = md if isinstance(attention_mask, DeviceStep) else None
    out = pa(layer_idx, q, k, v, sinks=sinks, metadata=device_step)  # [B*T, Hq, D]
    return out.view(bsz, t, num_heads, head_dim), None  # [B, T, Hq, D]
