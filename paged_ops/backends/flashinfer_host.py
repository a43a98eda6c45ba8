"""Host-side pieces of the FlashInfer backend: no GPU and no flashinfer import needed.

Everything here runs on CPU tensors (the metadata builder's host copies) before a step's forward,
so FlashInfer's ``plan()`` never waits on the GPU; the KV write fallback and the FP8 scale folding
are plain torch ops on any device. It is unit-tested in CI without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_ops.backends import LayerSpec
from paged_ops.fp8 import FP8_DTYPES, is_fp8, per_head, quantize

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # query (and unquantized cache) dtypes
# From this GQA group size on, decode runs on tensor cores (FlashInfer's prefill kernel with one
# query row per request); below it the CUDA-core decode kernel is faster and supports groups 1-3.
TENSOR_CORE_MIN_GROUP = 4


def unsupported_reason(spec: LayerSpec, device: torch.device) -> str | None:
    """Why FlashInfer cannot serve a layer with ``spec`` on ``device``, or ``None`` if it can.

    Only static facts are checked (no GPU, no import), so "auto" can decide per layer group.
    """
    if device.type != "cuda":
        return f"it runs on CUDA devices only, got device {str(device)!r}"
    if spec.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head size {spec.head_dim} is not one of {list(SUPPORTED_HEAD_DIMS)}"
    kv_dtype = spec.dtype if spec.kv_dtype is None else spec.kv_dtype
    if spec.dtype not in SUPPORTED_DTYPES:
        what = "query dtype" if kv_dtype != spec.dtype else "dtype"
        return f"{what} {spec.dtype} is not float16 or bfloat16"
    if kv_dtype != spec.dtype and kv_dtype not in FP8_DTYPES:
        return (
            f"cache dtype {kv_dtype} is neither the query dtype ({spec.dtype}) nor FP8 "
            "(float8_e4m3fn/float8_e5m2)"
        )
    if spec.has_sinks:
        return "attention sinks are not supported by its paged prefill/decode kernels"
    if spec.has_alibi:
        return "ALiBi with per-head slopes is not supported"
    return None


def use_tensor_cores(num_q_heads: int, num_kv_heads: int) -> bool:
    """Decode on tensor cores when the GQA group ``Hq / Hkv`` is at least 4."""
    return num_q_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP


@dataclass(frozen=True, slots=True)
class PagedKVIndex:
    """FlashInfer's CSR description of a batch's pages (CPU int32 tensors).

    indptr: ``[S+1]``, pages of request ``s`` are ``indices[indptr[s]:indptr[s+1]]``;
    indices: ``[nnz]`` block ids; last_page_len: ``[S]`` entries used in the last page, in
    ``[1, page_size]`` (1 for a padded request, which has no pages at all).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


def paged_kv_index(
    seq_lens: torch.Tensor,  # [S] int32, CPU; 0 = padded sequence
    block_table: torch.Tensor,  # [S, W] int32, CPU
    block_size: int,
) -> PagedKVIndex:
    """Turn the metadata's ``seq_lens`` + ``block_table`` into FlashInfer's page CSR.

    A padded sequence (``seq_len == 0``) gets zero pages, so ``indptr`` repeats its last value, and
    ``last_page_len = 1`` (FlashInfer requires ``[1, page_size]``; a request without pages has
    length 0 whatever that value is).
    """
    lens = seq_lens.to(torch.int64)
    num_pages = (lens + block_size - 1) // block_size  # [S]
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32)
    torch.cumsum(num_pages, 0, out=indptr[1:])
    width = block_table.shape[1]
    used = torch.arange(width)[None, :] < num_pages[:, None]  # [S, W]
    indices = block_table[used].to(torch.int32)  # row-major: sequence 0's pages first
    last_page_len = torch.where(lens > 0, (lens - 1) % block_size + 1, 1).to(torch.int32)
    return PagedKVIndex(indptr=indptr, indices=indices, last_page_len=last_page_len)


@dataclass(frozen=True, slots=True)
class StepShape:
    """Which wrapper serves a step, decided from host facts only (never from tensor values).

    kind: "decode" (every real sequence adds one token; served by the CUDA-graph-safe decode
    wrapper of bucket ``batch_size = padded_num_seqs``), "prefill" (prefill or mixed; the eager
    prefill wrapper over the ``batch_size = num_seqs`` real sequences) or "empty" (no sequences).
    num_tokens: real query tokens of the step; rows past it are padding.
    """

    kind: str
    batch_size: int
    num_tokens: int


def step_shape(
    *, num_seqs: int, padded_num_seqs: int, num_tokens: int, is_decode: bool
) -> StepShape:
    """Pick the wrapper for a step: the decode bucket is the padded sequence count."""
    if num_seqs == 0:
        return StepShape("empty", 0, 0)
    if is_decode:
        return StepShape("decode", padded_num_seqs, num_tokens)
    return StepShape("prefill", num_seqs, num_tokens)


def scatter_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [N, 2, B, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [] or [Hkv] float32 (FP8 cache)
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write K/V into the paged cache with torch ops only: no host sync, CUDA-graph capturable.

    Boolean indexing would need the count of valid slots on the host, so every token writes
    somewhere: a padded token (slot -1) rewrites the first real token's slot with that token's own
    key/value (duplicate writes of equal values are deterministic); if the step has no real token
    at all, padded tokens rewrite slot 0 with its current contents.

    An FP8 cache stores :func:`paged_ops.fp8.quantize` of the K/V (bit for bit); the bytes are
    moved as ``uint8`` so no selection or scatter op needs FP8 support.
    """
    if slot_mapping.shape[0] == 0:
        return
    fp8 = is_fp8(kv_cache.dtype)
    store = kv_cache.view(torch.uint8) if fp8 else kv_cache  # same bytes, same strides
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0  # [T]
    any_valid = valid.any()
    # [1], not 0-d: indexing with a 0-d tensor would read it on the host
    first = valid.to(torch.int8).argmax().reshape(1)
    fallback = torch.where(any_valid, slot_mapping.index_select(0, first), 0)  # [1]
    slots = torch.where(valid, slot_mapping, fallback)  # [T], all in range
    blocks, offsets = slots // block_size, slots % block_size
    keep = valid[:, None, None]
    for i, (new, scale) in enumerate(((key, k_scale), (value, v_scale))):
        if fp8:
            new = quantize(new, scale, kv_cache.dtype).view(torch.uint8)
        else:
            new = new.to(kv_cache.dtype)
        old = store[0, i, 0]  # [Hkv, D], read before the write below (stream order)
        filler = torch.where(any_valid, new.index_select(0, first), old)  # [1, Hkv, D]
        store[blocks, i, offsets] = torch.where(keep, new, filler)


def _per_q_head(scale: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """A ``[]`` or ``[Hkv]`` scale as ``[Hkv, 1, 1]`` float32, to broadcast over ``[T, Hkv, G, D]``
    (query head ``h`` is row ``h // G`` of KV head group ``G = Hq / Hkv``)."""
    return per_head(scale, num_kv_heads)[:, :, None]


def fold_k_scale(
    query: torch.Tensor,  # [T, Hq, D] float16/bfloat16
    k_scale: torch.Tensor | None,  # [] or [Hkv] float32
    num_kv_heads: int,
) -> torch.Tensor:  # [T, Hq, D], query's dtype
    """``query[:, h] * k_scale[h // G]``, multiplied in float32 and rounded to the query dtype.

    A score is ``q . (stored * k_scale) = (q * k_scale) . stored``, so a kernel that reads the
    stored FP8 values as they are (scale 1) computes the scores of the dequantized keys. The
    scale stays on the device: no host sync, no recompile per value, CUDA-graph capturable.
    ``None`` returns ``query`` itself.
    """
    if k_scale is None:
        return query
    grouped = query.float().unflatten(1, (num_kv_heads, -1))  # [T, Hkv, G, D]
    return (grouped * _per_q_head(k_scale, num_kv_heads)).flatten(1, 2).to(query.dtype)


def apply_v_scale_(
    out: torch.Tensor,  # [T, Hq, D], attention over the stored values; updated in place
    v_scale: torch.Tensor | None,  # [] or [Hkv] float32
    num_kv_heads: int,
) -> torch.Tensor:
    """``out[:, h] *= v_scale[h // G]`` (in float32, rounded back): the output over the values
    ``stored * v_scale`` is the output over ``stored`` times the scale, since the softmax weights
    of each query head sum to one (or to zero, for a row that sees no key). Device-side, like
    :func:`fold_k_scale`. Returns ``out``."""
    if v_scale is None:
        return out
    grouped = out.float().unflatten(1, (num_kv_heads, -1))  # [T, Hkv, G, D]
    out.copy_((grouped * _per_q_head(v_scale, num_kv_heads)).flatten(1, 2))
    return out
