"""The ``paged_ops::`` custom ops: schemas, fake kernels, and the public wrappers.

The ops are defined with the low-level ``torch.library.Library`` API (cheaper per call than
``custom_op``). Each op is one opaque node for torch.compile: its fake kernel derives the output
shape from the inputs' shapes only. Per-layer constants (scale, window, softcap, backend name, plan
handle) are scalar arguments, so they are baked into a trace; per-step facts are tensors.
"""

from __future__ import annotations

import torch

from paged_ops.backends import LayerSpec, get_backend, resolve_backend
from paged_ops.checks import check_paged_attention, check_write_kv
from paged_ops.rope import rope_rows

_lib = torch.library.Library("paged_ops", "DEF")  # noqa: TOR901 (kept alive for the process)
_lib.define(
    "write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor? k_scale, "
    "Tensor? v_scale, str backend) -> ()"
)
_lib.define(
    "paged_attention(Tensor query, Tensor kv_cache, Tensor cu_seqlens_q, Tensor seq_lens, "
    "Tensor block_table, float scale, bool causal, int window, float softcap, Tensor? sinks, "
    "Tensor? alibi_slopes, Tensor? k_scale, Tensor? v_scale, str backend, int plan_handle) -> Tensor"
)
# write_kv then paged_attention into ``out``, for backends that have ``write_kv_and_attend``
# (triton): one launch where the step is a decode step (at most one query token per sequence;
# ``decode_step`` a CPU bool ``[]`` tensor, read on the host). The step's kind is a per-step fact,
# so a tensor: a trace holds no guard on it, and a CUDA graph keeps the launch of the step it
# captured (decode graphs replay decode steps only). ``rope_cos``/``rope_sin`` (``[T, D]`` or
# ``[1, T, D]``, as a rotary module returns them): query and key come unrotated and the op rotates
# them (rotate-half, paged_ops/rope.py): the triton decode kernel as it loads the query and writes
# the key, every other step first (what the engine's RoPE pass hands over).
_lib.define(
    "write_kv_and_attend(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
    "Tensor(b!) out, Tensor slot_mapping, Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_table, "
    "Tensor decode_step, float scale, bool causal, int window, float softcap, Tensor? sinks, "
    "Tensor? alibi_slopes, Tensor? k_scale, Tensor? v_scale, str backend, int plan_handle, "
    "Tensor? rope_cos=None, Tensor? rope_sin=None) -> ()"
)


def _write_kv_impl(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    backend: str,
) -> None:
    get_backend(backend).write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale)


# The attention ops' trailing schema arguments, in order: the layer's constants, then the backend
# and its plan handle. The backends take them as keywords.
_LAYER_ARGS = (
    "scale",
    "causal",
    "window",
    "softcap",
    "sinks",
    "alibi_slopes",
    "k_scale",
    "v_scale",
)


def _backend_and_keywords(layer: tuple) -> tuple[str, dict]:
    """``(scale, ..., v_scale, backend, plan_handle)`` -> the backend's name and its keywords."""
    *constants, backend, plan_handle = layer
    return backend, dict(zip(_LAYER_ARGS, constants, strict=True), plan_handle=plan_handle)


def _paged_attention_impl(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *layer: object,  # scale, causal, window, softcap, sinks, alibi_slopes, k/v_scale, backend, handle
) -> torch.Tensor:
    backend, keywords = _backend_and_keywords(layer)
    return get_backend(backend).paged_attention(
        query, kv_cache, cu_seqlens_q, seq_lens, block_table, **keywords
    )


def _write_kv_and_attend_impl(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    slot_mapping: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    decode_step: torch.Tensor,
    *layer: object,  # as _paged_attention_impl's
    rope_cos: torch.Tensor | None = None,  # [T, D] or [1, T, D]
    rope_sin: torch.Tensor | None = None,
) -> None:
    # the dispatcher passes the arguments it was given by position, up to the last one given
    given = layer[len(_LAYER_ARGS) + 2 :]
    if given:
        rope_cos, rope_sin = (*given, None)[:2]  # type: ignore[assignment]
    backend, keywords = _backend_and_keywords(layer[: len(_LAYER_ARGS) + 2])
    rope = None
    if rope_cos is not None or rope_sin is not None:
        if rope_cos is None or rope_sin is None:
            raise ValueError("rope_cos and rope_sin go together; got one of them")
        rope = rope_rows(rope_cos, rope_sin, query.shape[0], query.shape[2])  # type: ignore[arg-type]
    get_backend(backend).write_kv_and_attend(
        query, key, value, kv_cache, slot_mapping, cu_seqlens_q, seq_lens, block_table, out=out,
        decode_step=bool(decode_step.item()), rope=rope, **keywords,
    )  # fmt: skip


for _device in ("CPU", "CUDA"):
    _lib.impl("write_kv", _write_kv_impl, _device)
    _lib.impl("paged_attention", _paged_attention_impl, _device)
    _lib.impl("write_kv_and_attend", _write_kv_and_attend_impl, _device)


# The backward of paged_attention is an op of its own that raises when it runs: traceable (its
# fake kernel returns a tensor), so torch.compile with grad enabled can still build the graph.
_lib.define("inference_only_backward(Tensor grad) -> Tensor")


def _inference_only_backward(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError(
        "paged_ops attention is inference-only: it has no backward. Run the forward under "
        "torch.no_grad() / inference_mode(), or train with the model's own attention "
        "(unpatch_model(model), or another attn_implementation)"
    )


for _device in ("CPU", "CUDA"):
    _lib.impl("inference_only_backward", _inference_only_backward, _device)


@torch.library.register_fake("paged_ops::inference_only_backward", lib=_lib)
def _inference_only_backward_fake(grad):  # noqa: ANN001
    return torch.empty_like(grad)


def _attention_backward(ctx: object, grad: torch.Tensor) -> tuple:
    grad_query = torch.ops.paged_ops.inference_only_backward.default(grad)
    return (grad_query,) + (None,) * 14


def _save_nothing(ctx: object, inputs: tuple, output: object) -> None:
    return None


# With grad enabled the kernels run below autograd (no history inside them; the cache takes
# values only). The attention output carries a node whose backward raises: an output that
# silently did not require grad would let loss.backward() return wrong gradients.
torch.library.register_autograd(
    "paged_ops::paged_attention", _attention_backward, setup_context=_save_nothing, lib=_lib
)


def _write_kv_autograd(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    backend: str,
) -> None:
    # A mutating op cannot have an autograd formula; run it below autograd (values only).
    with torch._C._AutoDispatchBelowAutograd():
        torch.ops.paged_ops.write_kv.default(
            key, value, kv_cache, slot_mapping, k_scale, v_scale, backend
        )


_lib.impl("write_kv", _write_kv_autograd, "Autograd")


def _write_kv_and_attend_autograd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  *args: object) -> None:  # fmt: skip
    # PagedAttention.forward takes write_kv + paged_attention (whose output's backward raises)
    # whenever autograd records; this op serves forwards that record nothing.
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise RuntimeError(
            "paged_ops::write_kv_and_attend is inference-only; with grad enabled, call "
            "paged_ops::write_kv then paged_ops::paged_attention"
        )
    with torch._C._AutoDispatchBelowAutograd():
        torch.ops.paged_ops.write_kv_and_attend.default(query, key, value, *args)


_lib.impl("write_kv_and_attend", _write_kv_and_attend_autograd, "Autograd")


@torch.library.register_fake("paged_ops::write_kv", lib=_lib)
def _write_kv_fake(key, value, kv_cache, slot_mapping, k_scale, v_scale, backend):  # noqa: ANN001
    return None


@torch.library.register_fake("paged_ops::write_kv_and_attend", lib=_lib)
def _write_kv_and_attend_fake(*args):  # noqa: ANN002
    return None


@torch.library.register_fake("paged_ops::paged_attention", lib=_lib)
def _paged_attention_fake(query, kv_cache, *args):  # noqa: ANN001
    return torch.empty_like(query)  # [T, Hq, D]


def _resolve(backend: str, spec: LayerSpec, device: torch.device) -> str:
    return resolve_backend(backend, spec, device)


# Same as decorating with torch.compiler.assume_constant_result: dynamo calls _resolve at trace time
# instead of tracing it (availability checks import optional packages). Set by hand so that
# `import paged_ops` does not import torch._dynamo (which pulls in triton when installed).
_resolve._dynamo_marked_constant = True  # type: ignore[attr-defined]


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Write this step's keys and values into one layer's paged cache, in place.

    Args:
        key, value: ``[T, Hkv, D]``, the cache's dtype; any float dtype for an FP8 cache.
        kv_cache: ``[num_blocks, 2, block_size, Hkv, D]``; ``[:, 0]`` keys, ``[:, 1]`` values.
            float16/bfloat16/float32, or float8_e4m3fn/float8_e5m2 (quantized, see
            :mod:`paged_ops.fp8`).
        slot_mapping: ``[T]`` int64, ``block_id * block_size + offset`` per token; ``-1`` skips it.
        k_scale, v_scale: FP8 cache only: float32 ``[]`` (per layer) or ``[Hkv]`` (per KV head);
            stored = saturate(x / scale) rounded to the cache dtype. ``None`` = 1.0.
        backend: "auto", "reference", "triton" or "flashinfer".
    """
    check_write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    spec = LayerSpec(
        head_dim=key.shape[2],
        num_q_heads=key.shape[1],
        num_kv_heads=key.shape[1],
        dtype=key.dtype,
        kv_dtype=kv_cache.dtype,
    )
    name = _resolve(backend, spec, kv_cache.device)
    torch.ops.paged_ops.write_kv.default(key, value, kv_cache, slot_mapping, k_scale, v_scale, name)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of packed, variable-length queries over a paged KV cache.

    Prefill, decode and mixed batches go through the same call. Query token ``i`` of sequence ``s``
    sits at absolute position ``seq_lens[s] - q_len + i`` and (with ``causal``) sees KV positions
    ``<= `` its own; ``sliding_window=W`` (Hugging Face's meaning) keeps the last ``W`` of them.

    Args:
        query: ``[T, Hq, D]``, sequence-major packing of every sequence's new tokens.
        kv_cache: ``[num_blocks, 2, block_size, Hkv, D]``, same dtype as query, or FP8
            (float8_e4m3fn/float8_e5m2, read as ``stored * scale``); ``Hq % Hkv == 0``.
        cu_seqlens_q: ``[S+1]`` int32 query offsets; tokens past ``cu_seqlens_q[-1]`` are padding.
        seq_lens: ``[S]`` int32 KV length of each sequence after this step's write.
        block_table: ``[S, max_blocks]`` int32 block ids of each sequence, in order.
        scale: score scale, default ``D ** -0.5``.
        causal: mask future positions.
        sliding_window: keep KV positions ``j > p - sliding_window``; ``None`` = all.
        softcap: ``c * tanh(x / c)`` on each scaled score; ``None`` = off.
        sinks: ``[Hq]`` float32, one extra logit per head in the softmax denominator.
        alibi_slopes: ``[Hq]`` float32, adds ``slope_h * (j - p)`` to each score.
        k_scale, v_scale: FP8 cache only: float32 ``[]`` or ``[Hkv]``; ``None`` = 1.0.
        backend: "auto", "reference", "triton" or "flashinfer".

    Returns:
        ``[T, Hq, D]`` in query's dtype; padded query tokens hold finite values nobody should read.

    Example:
        >>> out = paged_ops.paged_attention(q, cache, cu_seqlens_q, seq_lens, block_table)
    """
    check_paged_attention(
        query,
        kv_cache,
        cu_seqlens_q,
        seq_lens,
        block_table,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    spec = LayerSpec(
        head_dim=query.shape[2],
        num_q_heads=query.shape[1],
        num_kv_heads=kv_cache.shape[3],
        dtype=query.dtype,
        kv_dtype=kv_cache.dtype,
        causal=causal,
        sliding_window=sliding_window,
        softcap=softcap or None,
        has_sinks=sinks is not None,
        has_alibi=alibi_slopes is not None,
    )
    name = _resolve(backend, spec, query.device)
    return torch.ops.paged_ops.paged_attention.default(
        query,
        kv_cache,
        cu_seqlens_q,
        seq_lens,
        block_table,
        float(query.shape[2] ** -0.5 if scale is None else scale),
        bool(causal),
        int(sliding_window or 0),
        float(softcap or 0.0),
        sinks,
        alibi_slopes,
        k_scale,
        v_scale,
        name,
        -1,
    )
