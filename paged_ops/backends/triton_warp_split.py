"""FP8 decode kernel whose warps each own a slice of every KV tile (the triton backend's
``kernel="warp_split"``; launch logic in :mod:`paged_ops.backends.triton`).

The unified kernel (:mod:`.triton_kernels`) puts a program's warps side by side along the KV tile of
its 16-row M tile, so every tile's row max, row sum and the change of P to the dot-operand layout
cross warps through shared memory: nine barriers per tile at D=128 on sm_90. Here the tile is
``[W, SUB]`` positions and the dots are batched over ``W`` (``[W, BLOCK_M, D] @ [W, D, SUB]``):
Triton gives each warp one batch entry, so each warp keeps its own running max, sum and
accumulator for its positions (reductions stay inside the warp: two barriers per tile, the copy
waits) and the ``W`` partial softmax states merge once after the loop, as split-KV segments do
across programs. Offline SASS at D=128 (Triton 3.6, sm_90, ``W=2, SUB=32``, 3 stages): 788 loop
instructions per 64 positions per thread, no spills (187 registers), 2 barriers per tile.

**An experiment, not a default**: the launch logic never picks it; a forced ``LaunchConfig(...,
kernel="warp_split")`` runs it (benchmarks, tests). H100: a first version timed in its own script
read 746.5 vs 752.6 us (256 x 4096) and 190.9 vs 192.3 us (64 x 4096) against the unified
kernel; this one, made the default for a run of ``bench_attention.py``, read 839.9 and 285.4 us
there against the unified kernel's 753 and 193 in earlier runs. The difference between the two
measurements is not explained yet (benchmarks/NOTES.md section 10 lists what differs).

Served: FP8 caches read by 16-bit queries (float16 dots, V as int16 pairs: ``F16_DOT`` and
``V_PAIRS`` of the unified kernel), one KV head and one segment per program, plain causal
attention (no window, softcap, sinks or ALiBi); the launch logic sends everything else to the
unified kernel. Same grid and query-block mapping as the unified kernel (query blocks of
``BLOCK_Q`` tokens x the GQA group, spare programs zero the padded query rows).
"""

import triton
import triton.language as tl

from .triton_kernels import (
    LOG2E,
    PER_STEP_INTS,
    _float16_query,
    _fp8_bits_to_float,
    _fp8_pairs_to_float16,
    _load_query_rows,
    _locate_query_block,
    _zero_spare_rows,
)


@triton.jit(do_not_specialize=PER_STEP_INTS)
def warp_split_decode_kernel(
    out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D] float16 / bfloat16
    cache_ptr,  # [N, 2, B, Hkv, D] FP8 (uint8 bit patterns under the interpreter)
    cache_pairs_ptr,  # [N, 2, B, Hkv, D / 2] int16 view of the same cache
    cu_ptr,  # [S+1] int32
    seq_lens_ptr,  # [S] int32
    block_table_ptr,  # [S, W] int32
    k_scale_ptr,  # [] or [Hkv] fp32
    v_scale_ptr,
    stride_ks,  # 0: one scale per layer, 1: one per KV head
    stride_vs,
    scale,
    num_seqs,
    num_tokens,
    stride_ot,
    stride_oh,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_cn,
    stride_ckv,
    stride_cb,
    stride_ch,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    W: tl.constexpr,  # warps per program = KV sub-tiles per tile
    SUB: tl.constexpr,  # KV positions per warp and tile
    D: tl.constexpr,  # head size, a power of two (the pairs view needs it)
    USE_K_SCALE: tl.constexpr,
    USE_V_SCALE: tl.constexpr,
    FP8_BITS: tl.constexpr,  # the interpreter: decode FP8 bit patterns by hand
    FP8_MAN: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_SUB_ULP: tl.constexpr,
):
    pid = tl.program_id(1)  # query block; program_id(0) is the KV head (heads run together)
    kv_head = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    d_all = offs_d < D  # (all true: D is the padded size)
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head of each row

    tail = pid - (tl.load(cu_ptr + num_seqs) // BLOCK_Q + num_seqs)
    if tail >= 0:  # spare program: zero the padded query rows
        _zero_spare_rows(
            out_ptr, cu_ptr, num_seqs, num_tokens, tail, head, offs_m, offs_d, d_all,
            stride_ot, stride_oh, GROUP, BLOCK_Q, BLOCK_M, D,
        )  # fmt: skip
        return
    seq, q_start, q_len, local, kv_len = _locate_query_block(
        cu_ptr, seq_lens_ptr, pid, num_seqs, BLOCK_Q
    )
    if local * BLOCK_Q >= q_len:
        return
    context = kv_len - q_len
    q, q_pos, q_tok, row_valid = _load_query_rows(
        q_ptr, q_start, q_len, local, context, head, offs_m, offs_d, d_all, stride_qt,
        stride_qh, stride_qd, GROUP, BLOCK_Q,
    )  # fmt: skip
    q, scale = _float16_query(q, scale)  # [BLOCK_M, D] float16
    if USE_K_SCALE:
        scale = scale * tl.load(k_scale_ptr + kv_head * stride_ks)
    qk_scale = scale * LOG2E
    q3 = tl.broadcast_to(q[None, :, :], (W, BLOCK_M, D))  # [W, BLOCK_M, D]: one copy per warp

    # causal: the block's last row sees positions < last_pos + 1 (<= kv_len)
    last_pos = tl.minimum(context + local * BLOCK_Q + BLOCK_Q, kv_len) - 1
    TILE: tl.constexpr = W * SUB
    offs_w = tl.arange(0, W)
    offs_s = tl.arange(0, SUB)
    offs_p = tl.arange(0, D // 2)
    m_i = tl.full([W, BLOCK_M], float("-inf"), dtype=tl.float32)  # per warp, log2 units
    l_i = tl.zeros([W, BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([W, BLOCK_M, D // 2], dtype=tl.float32)  # even columns
    acc_odd = tl.zeros([W, BLOCK_M, D // 2], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = cache_ptr + kv_head * stride_ch
    v_base = cache_pairs_ptr + (kv_head * stride_ch + stride_ckv) // 2
    for tile in range(0, tl.cdiv(last_pos + 1, TILE)):
        pos = tile * TILE + offs_w[:, None] * SUB + offs_s[None, :]  # [W, SUB] KV positions
        n_valid = pos < kv_len
        blk = tl.load(table_row + pos // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        off = blk * stride_cn + (pos % BLOCK_SIZE) * stride_cb  # [W, SUB]
        k_ptrs = k_base + off[:, :, None] + offs_d[None, None, :]  # [W, SUB, D]
        if FP8_BITS:
            k = _fp8_bits_to_float(
                tl.load(k_ptrs, mask=n_valid[:, :, None], other=0), FP8_MAN, FP8_BIAS, FP8_SUB_ULP
            )
        else:
            k = tl.load(k_ptrs, mask=n_valid[:, :, None], other=0.0)
        s = tl.dot(q3, tl.trans(k.to(tl.float16), 0, 2, 1)) * qk_scale  # [W, BLOCK_M, SUB]
        visible = (
            row_valid[None, :, None]
            & n_valid[:, None, :]
            & (pos[:, None, :] <= q_pos[None, :, None])
        )
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2))  # [W, BLOCK_M]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet
        p = tl.exp2(s - m_safe[:, :, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 2)
        v_pairs = tl.load(
            v_base + off[:, :, None] // 2 + offs_p[None, None, :], mask=n_valid[:, :, None], other=0
        )  # [W, SUB, D / 2] int16
        v, v_odd = _fp8_pairs_to_float16(v_pairs, FP8_MAN, FP8_BIAS, FP8_SUB_ULP, FP8_BITS)
        p16 = p.to(tl.float16)
        acc = acc * alpha[:, :, None] + tl.dot(p16, v)  # [W, BLOCK_M, D / 2]
        acc_odd = acc_odd * alpha[:, :, None] + tl.dot(p16, v_odd)
        m_i = m_new

    # merge the W warps' softmax states: [W, BLOCK_M] -> [BLOCK_M]
    m_all = tl.max(m_i, 0)
    weight = tl.exp2(m_i - tl.where(m_all == float("-inf"), 0.0, m_all)[None, :])  # [W, BLOCK_M]
    l_all = tl.sum(l_i * weight, 0)
    acc = tl.sum(acc * weight[:, :, None], 0)  # [BLOCK_M, D / 2]
    acc_odd = tl.sum(acc_odd * weight[:, :, None], 0)
    out = tl.reshape(tl.join(acc, acc_odd), [BLOCK_M, D])  # columns 2c, 2c + 1 side by side
    if USE_V_SCALE:
        out = out * tl.load(v_scale_ptr + kv_head * stride_vs)
    out = out / tl.where(l_all == 0.0, 1.0, l_all)[:, None]  # a row that sees no key reads zeros
    ptrs = out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
