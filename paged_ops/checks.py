"""Input validation for the public op wrappers: clear ``TypeError``/``ValueError`` before any kernel.

Shape, dtype and device checks are free (they read metadata only) and always run. Checks that read
index *values* (block ids in range, lengths consistent) need a host sync, so they run in eager mode
only; the compiled hot path gets its indices from the metadata builder, which checks them on the host.
"""

from __future__ import annotations

import torch

from paged_ops.fp8 import FLOAT_DTYPES, FP8_DTYPES, is_fp8

_CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def _expect_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")


def _expect_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    check_tensor("kv_cache", kv_cache)
    _expect_ndim("kv_cache", kv_cache, 5, "[num_blocks, 2, block_size, Hkv, D]")
    if kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache dim 1 must be 2 (keys, values), got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in _CACHE_DTYPES:
        raise TypeError(f"kv_cache dtype must be one of {_CACHE_DTYPES}, got {kv_cache.dtype}")


def check_kv_scales(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, kv_cache: torch.Tensor
) -> None:
    """Scales are float32 tensors ``[]`` (per layer) or ``[Hkv]`` (per KV head) on the cache's
    device, and only for an FP8 cache."""
    num_kv_heads = kv_cache.shape[3]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        if not is_fp8(kv_cache.dtype):
            raise ValueError(
                f"{name} is given but the kv_cache is {kv_cache.dtype}; scales apply only to an "
                f"FP8 cache ({FP8_DTYPES})"
            )
        if not isinstance(scale, torch.Tensor):
            raise TypeError(
                f"{name} must be a float32 tensor of shape [] or [Hkv], got "
                f"{type(scale).__name__} (a tensor, so that a new scale neither recompiles nor "
                "breaks a CUDA graph)"
            )
        _expect_dtype(name, scale, torch.float32)
        if scale.shape not in ((), (num_kv_heads,)):
            raise ValueError(
                f"{name} must have shape [] (per layer) or [Hkv] = [{num_kv_heads}] (per KV "
                f"head), got {tuple(scale.shape)}"
            )
        if scale.device != kv_cache.device:
            raise ValueError(f"{name} is on {scale.device} but kv_cache is on {kv_cache.device}")


def check_kv_dtype(name: str, t: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """``t`` (query, key or value) is a float tensor matching the cache (any float for FP8)."""
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} dtype must be one of {FLOAT_DTYPES} (an FP8 cache takes float "
            f"{'queries' if name == 'query' else 'keys/values'} and quantizes), got {t.dtype}"
        )
    if not is_fp8(kv_cache.dtype) and t.dtype != kv_cache.dtype:
        raise TypeError(f"{name} dtype {t.dtype} != kv_cache dtype {kv_cache.dtype}")


def check_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        check_tensor(name, t)
    check_kv_cache(kv_cache)
    _expect_ndim("key", key, 3, "[T, Hkv, D]")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if key.shape[1:] != kv_cache.shape[3:]:
        raise ValueError(
            f"key [T, Hkv, D] = {tuple(key.shape)} does not match kv_cache [.., Hkv, D] = "
            f"{tuple(kv_cache.shape)}"
        )
    for name, t in (("key", key), ("value", value)):
        check_kv_dtype(name, t, kv_cache)
    check_kv_scales(k_scale, v_scale, kv_cache)
    _expect_dtype("slot_mapping", slot_mapping, torch.int64)
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be [T] = [{key.shape[0]}], got {tuple(slot_mapping.shape)}"
        )
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")
    if not torch.compiler.is_compiling() and slot_mapping.numel():
        num_slots = kv_cache.shape[0] * kv_cache.shape[2]
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(
                f"slot_mapping values must be -1 (skip) or in [0, {num_slots}) "
                f"(num_blocks * block_size), got range [{lo}, {hi}]"
            )


def check_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float | None,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    for name, t in (
        ("query", query),
        ("cu_seqlens_q", cu_seqlens_q),
        ("seq_lens", seq_lens),
        ("block_table", block_table),
    ):
        check_tensor(name, t)
    check_kv_cache(kv_cache)
    _expect_ndim("query", query, 3, "[T, Hq, D]")
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, cache_head_dim = kv_cache.shape[3], kv_cache.shape[4]
    check_kv_dtype("query", query, kv_cache)
    if head_dim != cache_head_dim:
        raise ValueError(f"query head size {head_dim} != kv_cache head size {cache_head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of kv_cache heads ({num_kv_heads})"
        )
    _expect_ndim("cu_seqlens_q", cu_seqlens_q, 1, "[S+1]")
    _expect_ndim("seq_lens", seq_lens, 1, "[S]")
    _expect_ndim("block_table", block_table, 2, "[S, max_blocks]")
    for name, t in (
        ("cu_seqlens_q", cu_seqlens_q),
        ("seq_lens", seq_lens),
        ("block_table", block_table),
    ):
        _expect_dtype(name, t, torch.int32)
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1 or block_table.shape[0] != num_seqs:
        raise ValueError(
            f"inconsistent batch sizes: seq_lens [S]={tuple(seq_lens.shape)}, cu_seqlens_q must be "
            f"[S+1], got {tuple(cu_seqlens_q.shape)}, block_table must be [S, max_blocks], got "
            f"{tuple(block_table.shape)}"
        )
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if sliding_window is not None and (
        not isinstance(sliding_window, int)
        or isinstance(sliding_window, bool)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or softcap < 0):
        raise ValueError(f"softcap must be a non-negative float or None, got {softcap!r}")
    for name, t in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if t is None:
            continue
        check_tensor(name, t)
        _expect_dtype(name, t, torch.float32)
        if t.shape != (num_q_heads,):
            raise ValueError(f"{name} must be [Hq] = [{num_q_heads}], got {tuple(t.shape)}")
    for name, t in (
        ("cu_seqlens_q", cu_seqlens_q),
        ("seq_lens", seq_lens),
        ("block_table", block_table),
        ("sinks", sinks),
        ("alibi_slopes", alibi_slopes),
    ):
        if t is not None and t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}")
    if kv_cache.device != query.device:
        raise ValueError(f"kv_cache is on {kv_cache.device} but query is on {query.device}")
    check_kv_scales(k_scale, v_scale, kv_cache)
    if not torch.compiler.is_compiling():
        _check_index_values(query, kv_cache, cu_seqlens_q, seq_lens, block_table)


def _check_index_values(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> None:
    num_tokens, (num_blocks, _, block_size) = query.shape[0], kv_cache.shape[:3]
    cu, lens = cu_seqlens_q.long().cpu(), seq_lens.long().cpu()
    q_lens = cu[1:] - cu[:-1]
    if cu[0] != 0 or (q_lens < 0).any() or cu[-1] > num_tokens:
        raise ValueError(
            f"cu_seqlens_q must start at 0, never decrease and end at most at T={num_tokens}, "
            f"got {cu.tolist()}"
        )
    # seq_len < q_len is allowed: the first q_len - seq_len queries are padding with no keys.
    max_len = block_table.shape[1] * block_size
    if (lens > max_len).any():
        raise ValueError(
            f"seq_lens {lens.tolist()} exceed what block_table holds ({block_table.shape[1]} blocks "
            f"of {block_size} = {max_len} tokens)"
        )
    blocks_used = (lens + block_size - 1) // block_size  # [S]
    used = torch.arange(block_table.shape[1])[None, :] < blocks_used[:, None]
    ids = block_table.cpu()[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(
            f"block_table holds block ids out of range: expected [0, {num_blocks}), got "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )


def check_layer_heads(
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    num_q_heads: int,
) -> None:
    """PagedAttention's per-call check: q ``[T, Hq, D]`` and k/v ``[T, Hkv, D]`` have the heads the
    layer's cache ``[N, 2, B, Hkv, D]`` was sized for. It reads static shapes only, so under
    ``torch.compile`` it runs once per trace (no guard, no graph break) and costs nothing at run
    time; eagerly it is a few integer comparisons."""
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    got = (tuple(query.shape[1:]), tuple(key.shape[1:]), tuple(value.shape[1:]))
    want = ((num_q_heads, head_dim), (num_kv_heads, head_dim), (num_kv_heads, head_dim))
    if got != want:
        raise ValueError(
            f"layer {layer_idx}: attention got query [T, {got[0][0]}, {got[0][1]}], key "
            f"[T, {got[1][0]}, {got[1][1]}] and value [T, {got[2][0]}, {got[2][1]}], but its cache "
            f"was sized for {num_q_heads} query heads and {num_kv_heads} KV heads of size "
            f"{head_dim}: build the PagedAttention with the heads the layer computes (a "
            "tensor-parallel model's per-rank heads; patch_model reads them from the sharded model)"
        )
