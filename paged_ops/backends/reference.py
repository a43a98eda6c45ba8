"""Reference backend: plain PyTorch, CPU and CUDA. It defines correctness; it is not fast.

Each sequence's blocks are gathered into a contiguous K/V, scores are computed in float32 and the
contract of ARCHITECTURE.md is applied literally: scale, softcap, ALiBi, causal and sliding-window
masks, optional attention sinks. A query row that sees no key (a padding query at a negative position,
``q_len > seq_len``, or any query of a sequence with ``seq_len == 0``) reads exact zeros, never NaN:
with sinks too, since the sink's value vector is zero. An FP8 cache is written with
:func:`paged_ops.fp8.quantize` and read with :func:`paged_ops.fp8.dequantize` (float32).
"""

from __future__ import annotations

import torch

from paged_ops.backends import LayerSpec
from paged_ops.fp8 import dequantize, is_fp8, quantize


def is_available() -> bool:
    return True


def unsupported_reason(spec: LayerSpec, device: torch.device) -> str | None:
    return None


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [N, 2, B, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [] or [Hkv] float32 (FP8 cache)
    v_scale: torch.Tensor | None = None,
) -> None:
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    for i, (new, scale) in enumerate(((key, k_scale), (value, v_scale))):
        new = new[valid]  # [T', Hkv, D]
        if is_fp8(kv_cache.dtype):
            new = quantize(new, scale, kv_cache.dtype)
        kv_cache[blocks, i, offsets] = new.to(kv_cache.dtype)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [N, 2, B, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_table: torch.Tensor,  # [S, max_blocks] int32
    *,
    scale: float,
    causal: bool,
    window: int,  # <= 0: no sliding window
    softcap: float,  # <= 0: no softcap
    sinks: torch.Tensor | None,  # [Hq] float32
    alibi_slopes: torch.Tensor | None,  # [Hq] float32
    k_scale: torch.Tensor | None = None,  # [] or [Hkv] float32 (FP8 cache)
    v_scale: torch.Tensor | None = None,
    plan_handle: int = -1,
    out: torch.Tensor | None = None,  # [T, Hq, D]: written and returned when given
) -> torch.Tensor:  # [T, Hq, D]
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    # padded query tokens read zeros: finite, unread
    out = torch.zeros_like(query) if out is None else out.zero_()
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for s, kv_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = -(-kv_len // block_size)
        blocks = block_table[s, :num_blocks].long()
        # gather this sequence's pages: [kv_len, Hkv, D] -> expand GQA -> [kv_len, Hq, D]
        k = dequantize(kv_cache[blocks, 0].reshape(-1, num_kv_heads, head_dim)[:kv_len], k_scale)
        v = dequantize(kv_cache[blocks, 1].reshape(-1, num_kv_heads, head_dim)[:kv_len], v_scale)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()  # [q_len, Hq, D]

        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, q_len, kv_len]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
        k_pos = torch.arange(kv_len, device=query.device)
        rel = k_pos[None, :] - q_pos[:, None]  # [q_len, kv_len], j - p
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.float()[:, None, None] * rel[None]
        allowed = torch.ones_like(rel, dtype=torch.bool)
        if causal:
            allowed &= rel <= 0
        if window > 0:
            allowed &= rel > -window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        # a query that sees no key (padding before the sequence's tokens: p < 0) reads zeros, not
        # the NaN of a softmax over nothing but -inf
        probs = probs.masked_fill(~allowed.any(-1)[None, :, None], 0.0)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
