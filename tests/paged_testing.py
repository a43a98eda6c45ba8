"""Test helpers: random paged batches and an independent float64 dense attention; random operands
of a linear layer (:func:`linear_operands`).

The dense reference is deliberately written differently from the reference backend: it loops over
query tokens, builds each one's visible key set explicitly and works in float64 on the un-paged K/V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import paged_ops


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D] (T includes padding tokens)
    new_key: torch.Tensor  # [T, Hkv, D] this step's keys (padding rows random)
    new_value: torch.Tensor  # [T, Hkv, D]
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding
    kv_cache: torch.Tensor  # [N, 2, B, Hkv, D], context already written, new tokens not yet
    cu_seqlens_q: torch.Tensor  # [S+1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32
    keys: list[torch.Tensor]  # per real sequence, [kv_len, Hkv, D] un-paged (context + new)
    values: list[torch.Tensor]
    q_lens: list[int]


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    pad_tokens: int = 0,
    pad_seqs: int = 0,
    extra_blocks: int = 3,
    seed: int = 0,
) -> PagedBatch:
    """A batch of sequences given as ``(context_len, q_len)`` with shuffled block tables.

    The context K/V are written straight into the cache by indexing; the new tokens' K/V are returned
    with their slot mapping so a test can write them with ``write_kv``.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil((c + q) / block_size) for c, q in seqs]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    max_blocks = max(blocks_per_seq + [1]) + 1
    perm = torch.randperm(num_blocks, generator=g).tolist()  # shuffled, non-contiguous tables
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    num_seqs = len(seqs) + pad_seqs
    block_table = torch.randint(
        0, num_blocks, (num_seqs, max_blocks), generator=g, dtype=torch.int32
    )
    cu, lens, slots, keys, values, queries, new_k, new_v = [0], [], [], [], [], [], [], []
    for s, (ctx, q_len) in enumerate(seqs):
        kv_len = ctx + q_len
        ids = [perm.pop() for _ in range(blocks_per_seq[s])]
        block_table[s, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(kv_len, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(kv_len, num_kv_heads, head_dim, generator=g).to(dtype)
        for p in range(kv_len):
            block, off = ids[p // block_size], p % block_size
            if p < ctx:
                kv_cache[block, 0, off], kv_cache[block, 1, off] = k[p], v[p]
            else:
                slots.append(block * block_size + off)
        keys.append(k)
        values.append(v)
        new_k.append(k[ctx:])
        new_v.append(v[ctx:])
        queries.append(torch.randn(q_len, num_q_heads, head_dim, generator=g).to(dtype))
        cu.append(cu[-1] + q_len)
        lens.append(kv_len)
    for _ in range(pad_seqs):
        cu.append(cu[-1])
        lens.append(0)
    queries.append(torch.randn(pad_tokens, num_q_heads, head_dim, generator=g).to(dtype))
    new_k.append(torch.randn(pad_tokens, num_kv_heads, head_dim, generator=g).to(dtype))
    new_v.append(torch.randn(pad_tokens, num_kv_heads, head_dim, generator=g).to(dtype))
    slots.extend([-1] * pad_tokens)
    dev = torch.device(device)
    return PagedBatch(
        query=torch.cat(queries).to(dev),
        new_key=torch.cat(new_k).to(dev),
        new_value=torch.cat(new_v).to(dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        kv_cache=kv_cache.to(dev),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        block_table=block_table.to(dev),
        keys=keys,
        values=values,
        q_lens=[q for _, q in seqs],
    )


def with_leading_padding(batch: PagedBatch, pads: list[int], seed: int = 0) -> PagedBatch:
    """``batch`` with ``pads[s]`` padding queries before sequence ``s``'s tokens (slot ``-1``):
    its query length grows, its KV length does not (left padding of a Hugging Face batch)."""
    g = torch.Generator().manual_seed(seed)
    starts = batch.cu_seqlens_q.tolist()
    parts: dict[str, list[torch.Tensor]] = {"query": [], "new_key": [], "new_value": []}
    slots, cu = [], [0]
    for s, q_len in enumerate(batch.q_lens):
        rows = slice(starts[s], starts[s] + q_len)
        for name, parts_of in parts.items():
            t = getattr(batch, name)
            noise = torch.randn((pads[s], *t.shape[1:]), generator=g).to(t.dtype).to(t.device)
            parts_of += [noise, t[rows]]
        slots += [-1] * pads[s] + batch.slot_mapping[rows].tolist()
        cu.append(cu[-1] + pads[s] + q_len)
    tail = slice(starts[len(batch.q_lens)], None)  # padding tokens past every sequence
    for name, parts_of in parts.items():
        parts_of.append(getattr(batch, name)[tail])
    slots += batch.slot_mapping[tail].tolist()
    cu += [cu[-1]] * (len(starts) - 1 - len(batch.q_lens))
    dev = batch.query.device
    return PagedBatch(
        query=torch.cat(parts["query"]),
        new_key=torch.cat(parts["new_key"]),
        new_value=torch.cat(parts["new_value"]),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        kv_cache=batch.kv_cache,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        keys=batch.keys,
        values=batch.values,
        q_lens=[q + p for q, p in zip(batch.q_lens, pads, strict=True)],
    )


# A Hugging Face batch with left padding, mixed with unpadded sequences: per sequence (context, new
# tokens) and how many padding queries (slot -1, nothing written) come before its tokens. Padding of a
# fresh sequence sits at p < 0 and sees no key, down to p = -40 (more than two 16-wide KV tiles below
# 0); (0, 0) + 3 is a sequence with seq_len 0 and q_len 3; the 2 padding queries of (9, 3) sit at
# p >= 0 and see the context like any query.
LEFT_PADDED = [(0, 7), (0, 5), (13, 1), (9, 3), (0, 0), (30, 2), (0, 1), (21, 1)]
LEFT_PADS = [0, 3, 0, 2, 3, 0, 40, 0]


def make_left_padded_batch(**kwargs: object) -> PagedBatch:
    """:data:`LEFT_PADDED` with :data:`LEFT_PADS`, plus 2 padding tokens and one padded sequence;
    kwargs go to :func:`make_batch` (heads, head size, block size, dtype, seed)."""
    batch = make_batch(LEFT_PADDED, pad_tokens=2, pad_seqs=1, **kwargs)  # type: ignore[arg-type]
    return with_leading_padding(batch, LEFT_PADS)


# Layer features (public wrapper keywords) for a batch with 4 query heads. "window_1": every row
# with p >= 0 sees exactly one key, itself; no window empties a row with p >= 0 (it keeps j = p), so
# under the contract a row sees no key only at p < 0 (causal) or with seq_len 0.
PADDED_FEATURES = {
    "plain": {},
    "window_1": dict(sliding_window=1),
    "window_4": dict(sliding_window=4),
    "softcap": dict(softcap=3.0, scale=0.4),
    "sinks": dict(sinks=torch.tensor([-1.0, 0.0, 2.0, 0.5])),
    "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "non_causal": dict(causal=False),
    "non_causal_window_sinks": dict(
        causal=False, sliding_window=3, sinks=torch.tensor([0.0, 1.0, -2.0, 3.0])
    ),
    "everything": dict(
        sliding_window=6,
        softcap=4.0,
        scale=0.3,
        sinks=torch.tensor([1.0, -1.0, 0.5, 2.0]),
        alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]),
    ),
}


def rows_without_keys(batch: PagedBatch, causal: bool = True) -> list[int]:
    """Packed query rows that see no key under the op contract, from the metadata alone.

    Causal: the rows at ``p = seq_len - q_len + i < 0``. A sliding window never empties a row with
    ``p >= 0`` (it keeps ``j = p``, and ``p < seq_len``), so it adds none. Non-causal: only the rows
    of a sequence with ``seq_len == 0``.
    """
    starts, lens = batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist()
    rows = []
    for s, q_len in enumerate(batch.q_lens):
        for i in range(q_len):
            if lens[s] == 0 or (causal and lens[s] - q_len + i < 0):
                rows.append(starts[s] + i)
    return rows


def assert_rows_zero(out: torch.Tensor, rows: list[int]) -> None:
    """``out[rows]`` is exactly zero (not NaN, not merely small)."""
    got = out[rows]
    assert torch.isfinite(got.float()).all(), "rows without keys must be finite"
    assert torch.equal(got, torch.zeros_like(got)), "rows without keys must read exactly zero"


def dense_attention_f64(
    q: torch.Tensor,  # [q_len, Hq, D]
    k: torch.Tensor,  # [kv_len, Hkv, D]
    v: torch.Tensor,  # [kv_len, Hkv, D]
    *,
    scale: float,
    causal: bool = True,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:  # [q_len, Hq, D] float64
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    q_len, num_q_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q_len):
        p = kv_len - q_len + i
        visible = [
            j
            for j in range(kv_len)
            if (not causal or j <= p) and (window is None or j > p - window)
        ]
        if not visible and sinks is None:
            out[i] = 0.0  # a padding query before the sequence's tokens sees no key
            continue
        idx = torch.tensor(visible, dtype=torch.long)
        for h in range(num_q_heads):
            kh, vh = k[idx, h // group], v[idx, h // group]  # [n, D]
            x = (kh @ q[i, h]) * scale
            if softcap:
                x = softcap * torch.tanh(x / softcap)
            if alibi_slopes is not None:
                x = x + float(alibi_slopes[h]) * (idx.double() - p)
            m = x.max() if len(visible) else torch.tensor(float("-inf"), dtype=torch.float64)
            if sinks is not None:
                m = torch.maximum(m, sinks[h].double().cpu())
            w = torch.exp(x - m)
            denom = w.sum() + (torch.exp(sinks[h].double().cpu() - m) if sinks is not None else 0.0)
            out[i, h] = (w @ vh) / denom
    return out


def dense_batch_f64(batch: PagedBatch, **kwargs: object) -> list[torch.Tensor]:
    """Dense float64 outputs, one ``[q_len, Hq, D]`` per real sequence."""
    starts = batch.cu_seqlens_q.tolist()
    return [
        dense_attention_f64(
            batch.query[starts[s] : starts[s] + q_len], batch.keys[s], batch.values[s], **kwargs
        )
        for s, q_len in enumerate(batch.q_lens)
    ]


def assert_matches_dense(
    out: torch.Tensor, batch: PagedBatch, expected: list[torch.Tensor], rtol: float
) -> None:
    """Relative Frobenius error per sequence below ``rtol``; padded rows finite."""
    starts = batch.cu_seqlens_q.tolist()
    assert torch.isfinite(out.float()).all(), "non-finite values in the output"
    for s, ref in enumerate(expected):
        got = out[starts[s] : starts[s] + batch.q_lens[s]].double().cpu()
        err = (got - ref).norm() / ref.norm().clamp_min(1e-12)
        assert err <= rtol, f"sequence {s}: relative error {err:.2e} > {rtol:.0e}"


def write_and_attend(
    batch: PagedBatch,
    backend: str,
    num_segments: int | None = None,
    config: object = None,
    **kwargs: object,
):
    """``paged_ops.write_kv`` of the batch's new K/V through ``backend``, then :func:`attend`
    (``k_scale``/``v_scale`` in kwargs go to both)."""
    paged_ops.write_kv(
        batch.new_key, batch.new_value, batch.kv_cache, batch.slot_mapping, backend=backend,
        k_scale=kwargs.get("k_scale"), v_scale=kwargs.get("v_scale"),
    )  # fmt: skip
    return attend(batch, backend, num_segments, config, **kwargs)


def attend(
    batch: PagedBatch,
    backend: str,
    num_segments: int | None = None,
    config: object = None,
    **kwargs: object,
):
    """``paged_ops.paged_attention`` over ``batch``; with ``num_segments`` or ``config`` (a triton
    ``LaunchConfig``), the triton backend directly with that split-KV segment count or those tiles
    forced. kwargs are the public wrapper's keywords."""
    if num_segments is None and config is None:
        return paged_ops.paged_attention(
            batch.query, batch.kv_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_table,
            backend=backend, **kwargs,
        )  # fmt: skip
    from paged_ops.backends import triton as triton_backend

    return triton_backend.paged_attention(
        batch.query, batch.kv_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_table,
        scale=kwargs.get("scale", batch.query.shape[2] ** -0.5),
        causal=kwargs.get("causal", True),
        window=kwargs.get("sliding_window") or 0,
        softcap=kwargs.get("softcap") or 0.0,
        sinks=kwargs.get("sinks"),
        alibi_slopes=kwargs.get("alibi_slopes"),
        k_scale=kwargs.get("k_scale"),
        v_scale=kwargs.get("v_scale"),
        num_segments=num_segments,
        config=config,
    )  # fmt: skip


def fp8_scales(
    kind: str, num_kv_heads: int, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(k_scale, v_scale) of ``kind`` "none", "layer" (``[]``) or "head" (``[Hkv]``): for K/V ~ N(0, 1)
    they put the largest values near the top of e4m3's range."""
    if kind == "none":
        return None, None
    if kind == "layer":
        return torch.tensor(0.011, device=device), torch.tensor(0.0093, device=device)
    k = torch.linspace(0.009, 0.02, num_kv_heads, device=device)
    return k, k.flip(0) * 0.8


def quantized_batch(
    batch: PagedBatch,
    fp8_dtype: torch.dtype,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> PagedBatch:
    """``batch`` on an FP8 cache: the context is quantized into it (``paged_ops.fp8.quantize``),
    the new K/V stay float for ``write_kv`` to quantize, and ``keys``/``values`` become the
    dequantized values an exact kernel attends over (dense on this batch: the dequantized cache;
    dense on ``batch``: the unquantized K/V)."""
    from paged_ops.fp8 import dequantize, quantize

    cache = torch.empty(batch.kv_cache.shape, dtype=fp8_dtype, device=batch.kv_cache.device)
    cache[:, 0] = quantize(batch.kv_cache[:, 0], k_scale, fp8_dtype)
    cache[:, 1] = quantize(batch.kv_cache[:, 1], v_scale, fp8_dtype)

    def roundtrip(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        scale = None if scale is None else scale.to(x.device)  # keys/values live on the CPU
        return dequantize(quantize(x, scale, fp8_dtype), scale)

    return PagedBatch(
        query=batch.query,
        new_key=batch.new_key,
        new_value=batch.new_value,
        slot_mapping=batch.slot_mapping,
        kv_cache=cache,
        cu_seqlens_q=batch.cu_seqlens_q,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        keys=[roundtrip(k, k_scale) for k in batch.keys],
        values=[roundtrip(v, v_scale) for v in batch.values],
        q_lens=batch.q_lens,
    )


def count_write_kv_launches(monkeypatch) -> list:  # noqa: ANN001 (pytest's MonkeyPatch)
    """Each call of the triton backend's ``write_kv`` (a write kernel launch) appends 1 to the
    returned list, for the rest of the test."""
    from paged_ops.backends import triton as triton_backend

    calls: list = []
    write_kv = triton_backend.write_kv
    monkeypatch.setattr(triton_backend, "write_kv", lambda *a: calls.append(1) or write_kv(*a))
    return calls


def force_split_k_route(monkeypatch) -> None:  # noqa: ANN001 (pytest's MonkeyPatch)
    """For the rest of the test every projection of 17 or more rows takes the split-K GEMM with
    small tiles and two slices, as a Hopper graph step takes a deep, narrow one (CPU tensors:
    the interpreter runs it)."""
    from paged_ops import linear
    from paged_ops.backends.triton_gemm_kernels import GemmConfig

    config = GemmConfig(block_m=16, block_n=32, block_k=32, split_k=2, num_stages=2)
    monkeypatch.setattr(linear, "_graph_step", lambda x: True)
    monkeypatch.setattr(
        linear, "_split_k_gemm_config", lambda x2d, w: config if x2d.shape[0] >= 17 else None
    )


def count_fused_reduces(monkeypatch) -> list:  # noqa: ANN001 (pytest's MonkeyPatch)
    """Each call of ``reduce_add_rms_norm`` (the split-K reduce + add + RMSNorm kernel's launch)
    appends 1 to the returned list, for the rest of the test."""
    from paged_ops.backends import triton_norm_linear_kernels as norm_kernels

    calls: list = []
    launch = norm_kernels.reduce_add_rms_norm
    monkeypatch.setattr(
        norm_kernels, "reduce_add_rms_norm", lambda *a: calls.append(1) or launch(*a)
    )
    return calls


def linear_operands(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    """CPU ``x [M, K]``, ``w [N, K]`` (scaled by ``K**-0.5``) and ``b [N]`` (or None) of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)  # [M, K]
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)  # [N, K]
    b = torch.randn(n, generator=g).to(dtype) if bias else None  # [N]
    return x, w, b


def attend_writing_kv(batch: PagedBatch, **launch: object) -> torch.Tensor:
    """The triton attention over ``batch`` given its new K/V and slots (``new_key``...): the
    kernel writes them (or the write kernel first where it cannot); ``launch``: ``config``,
    ``rope``."""
    from paged_ops.backends import triton as triton_backend

    return triton_backend.paged_attention(
        batch.query, batch.kv_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_table,
        scale=batch.query.shape[2] ** -0.5, causal=True, window=0, softcap=0.0, sinks=None,
        alibi_slopes=None, new_key=batch.new_key, new_value=batch.new_value,
        slot_mapping=batch.slot_mapping, **launch,
    )  # fmt: skip


def record_attention_calls(monkeypatch: object) -> list[tuple[bool, bool]]:
    """Wrap the triton backend's ``paged_attention`` (through ``monkeypatch``); the list gets
    ``(rope given, the kernel writes K/V)`` per call."""
    from paged_ops.backends import triton as triton_backend

    calls: list[tuple[bool, bool]] = []
    attention = triton_backend.paged_attention

    def recorded(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append((kwargs.get("rope") is not None, kwargs.get("new_key") is not None))
        return attention(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_attention", recorded)  # type: ignore[attr-defined]
    return calls
