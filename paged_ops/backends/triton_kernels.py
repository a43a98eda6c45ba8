"""Triton kernels of the triton backend: KV write, unified paged attention, split-KV reduce.

Launch logic lives in :mod:`paged_ops.backends.triton`; this module only defines kernels. Layouts
(ARCHITECTURE.md): query ``[T, Hq, D]``, kv_cache ``[N, 2, B, Hkv, D]``, ``cu_seqlens_q [S+1]``,
``seq_lens [S]``, ``block_table [S, W]`` (int32). Every stride is passed, so views work.

The attention kernel is "unified": one program serves a *query block* of ``BLOCK_Q`` consecutive
query tokens of one sequence times the ``GROUP`` query heads that share one KV head, packed into the
``BLOCK_M = BLOCK_Q * GROUP`` rows of the M tile (GQA packing: each K/V tile is loaded once for the
whole group). Prefill, decode and mixed batches are the same code; only the tile sizes differ.
The grid is an upper bound computed from shapes (``T // BLOCK_Q + S + 1``), and each program finds
its sequence by binary search over ``cu_seqlens_q[s] // BLOCK_Q + s`` (the first query-block index
of sequence ``s``), so no host sync is needed to size it. Spare programs past the last sequence
write zeros into padded query rows, so every output row is finite.

With ``NUM_SEGMENTS > 1`` (split-KV, for small batches over long contexts) each program handles one
segment of its KV tiles and writes an unnormalised partial result, its running max and its sum;
``reduce_segments_kernel`` merges the segments (and the attention sink) into the output.

With ``KV_HEADS = 2`` (FP8 decode at D=64) a program serves two neighbouring KV heads: ``GROUP``
is then both heads' query heads (2 x the GQA group), K/V tiles are ``[TILE_N, 2 D_PAD]`` (both
heads' rows, 128 contiguous bytes per position instead of 64), and each row's query is zero in the
other head's half, so ``q @ k^T`` sums only its own head's products; ``p @ v`` yields both halves
and each row keeps its own.

With ``WRITE_KV`` (a decode step: one query token per sequence; 16/32-bit caches) the attention
kernel also stores the step's K/V: the program whose KV tiles hold a sequence's new position writes
that token's rows for its KV head before its loop reads them (then a CTA barrier), which spares the
``write_kv_kernel`` launch before it; no other program reads that slot in the step. With
``ROPE`` as well, the query and key come unrotated: each program rotates its query rows after
loading them (the partner half loaded as a second view) and the writing program rotates the key
row before its store (rotate-half, ``cos``/``sin`` rows of each token; paged_ops/rope.py), which
spares the model's RoPE kernel per layer (benchmarks/NOTES.md section 34).
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
SCAN = tl.constexpr(128)  # sequences one vector load covers in _find_seq


@triton.jit
def _round_to_fp8(
    x,  # fp32
    FP8_MAX: tl.constexpr,
    FP8_MAN: tl.constexpr,  # mantissa bits: 3 (e4m3) or 2 (e5m2)
    FP8_MIN_NORMAL: tl.constexpr,  # 2^(1 - bias)
    FP8_SUB_ULP: tl.constexpr,  # 2^(1 - bias - mantissa bits): spacing of the subnormals
):
    """fp32 -> the fp32 value of the nearest FP8 value (ties to even), saturated to +-FP8_MAX.

    Done with integer arithmetic so the result is exact on the GPU and under the interpreter
    (whose own fp32 -> fp8 conversion rounds wrongly across a binade); storing the result to an
    FP8 pointer is then an exact conversion.
    """
    sign = (x.to(tl.int32, bitcast=True) >> 31) << 31
    a = tl.minimum(tl.abs(x), FP8_MAX)
    # normal range: round the fp32 mantissa to FP8_MAN bits, ties to even (a carry bumps the exponent)
    bits = a.to(tl.int32, bitcast=True)
    bits = bits + ((1 << (22 - FP8_MAN)) - 1) + ((bits >> (23 - FP8_MAN)) & 1)
    normal = (bits & -(1 << (23 - FP8_MAN))).to(tl.float32, bitcast=True)
    # subnormal range: a multiple of FP8_SUB_ULP, rounded half to even (all exact in fp32)
    y = tl.minimum(a, FP8_MIN_NORMAL) / FP8_SUB_ULP  # (capped: a large a would overflow int32)
    t = y.to(tl.int32)
    frac = y - t.to(tl.float32)
    t = t + ((frac > 0.5) | ((frac == 0.5) & ((t & 1) == 1))).to(tl.int32)
    r = tl.where(a < FP8_MIN_NORMAL, t.to(tl.float32) * FP8_SUB_ULP, normal)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_bits_to_float(
    b,  # uint8 bit patterns
    FP8_MAN: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_SUB_ULP: tl.constexpr,
):
    """FP8 bit patterns -> fp32, by hand (the interpreter's fp8 conversion loses subnormals).
    Only used under the interpreter; the GPU converts in hardware. No NaN/inf: writes saturate."""
    b = b.to(tl.int32)
    man = b & ((1 << FP8_MAN) - 1)
    e = (b >> FP8_MAN) & ((1 << (7 - FP8_MAN)) - 1)
    normal = (((e + (127 - FP8_BIAS)) << 23) | (man << (23 - FP8_MAN))).to(tl.float32, bitcast=True)
    r = tl.where(e == 0, man.to(tl.float32) * FP8_SUB_ULP, normal)
    return tl.where(b >= 128, -r, r)


@triton.jit
def _load_kv(
    ptrs,
    mask,
    dtype: tl.constexpr,
    FP8_BITS: tl.constexpr,
    FP8_MAN: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_SUB_ULP: tl.constexpr,
):
    """Load a K or V tile and convert it (unscaled) to ``dtype``, the query's dtype.
    FP8_BITS: the cache tensor holds FP8 bit patterns as uint8 (interpreter) to decode by hand."""
    return _load_kv_raw(ptrs, mask, FP8_BITS, FP8_MAN, FP8_BIAS, FP8_SUB_ULP).to(dtype)


@triton.jit
def _load_kv_raw(
    ptrs,
    mask,
    FP8_BITS: tl.constexpr,
    FP8_MAN: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_SUB_ULP: tl.constexpr,
):
    """A K or V tile as stored (FP8), or as fp32 values decoded from FP8 bits (interpreter)."""
    if FP8_BITS:
        return _fp8_bits_to_float(tl.load(ptrs, mask=mask, other=0), FP8_MAN, FP8_BIAS, FP8_SUB_ULP)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _fp8_pairs_to_float16(
    x,  # [N, C] int16: two neighbouring FP8 values (columns 2c, 2c+1) of each row
    FP8_MAN: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_SUB_ULP: tl.constexpr,
    BY_HAND: tl.constexpr,  # the interpreter: integer decode (it has no inline PTX)
):
    """FP8 byte pairs -> (even columns, odd columns) as float16, ``[N, C]`` each, exact.

    V is the B operand of ``p @ v`` with its columns contiguous, so Triton moves an 8-bit V tile
    to the dot-operand layout by reading it back from shared memory a byte at a time (sm_90 has no
    8-bit ``ldmatrix.trans``). Read as 16-bit pairs, the tile takes the 16-bit transposing path
    (``ldmatrix.trans``) like a bf16 V; the pure, one-input conversion below lets Triton hoist that
    layout change above it. On the GPU: one byte permute and two packed hardware conversions
    (``cvt.rn.f16x2.e4m3x2`` / ``e5m2x2``, sm_89+) per two pairs. By hand: each byte through
    ``_fp8_bits_to_float`` (every FP8 value is a float16 value)."""
    if BY_HAND:
        lo = _fp8_bits_to_float(x & 0xFF, FP8_MAN, FP8_BIAS, FP8_SUB_ULP)
        hi = _fp8_bits_to_float((x >> 8) & 0xFF, FP8_MAN, FP8_BIAS, FP8_SUB_ULP)
        return lo.to(tl.float16), hi.to(tl.float16)
    # $2 holds two int16 elements = bytes (b0, b1 | b2, b3); the permute makes (b0, b2 | b1, b3):
    # the low bytes (even columns) of both elements, then their high bytes (odd columns).
    kind: tl.constexpr = "e5m2x2" if FP8_MAN == 2 else "e4m3x2"
    asm: tl.constexpr = (
        "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t; "
        "cvt.rn.f16x2." + kind + " $0, lo; cvt.rn.f16x2." + kind + " $1, hi; }"
    )
    return tl.inline_asm_elementwise(
        asm, "=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2
    )


@triton.jit
def _float16_query(q, scale):
    """FP8 cache, 16-bit queries: ``q`` [BLOCK_M, D_PAD] as float16 and the softmax scale to use.

    FP8 -> float16 is one packed conversion per two values; FP8 -> bfloat16 costs three, and
    conversion throughput, not memory, then bounds decode. So bf16 queries are rescaled by a power
    of two (largest |q| of the tile -> [2^8, 2^9)) and cast to float16 (10 mantissa bits: no
    precision lost, no overflow); the softmax scale takes the inverse power. P (in [0, 1]) and V
    are float16 as well; accumulators stay float32."""
    q_amax = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
    q_exp = (q_amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent, 0 for 0.0
    shift = tl.minimum(tl.maximum(135 - q_exp, -100), 100)  # 2^shift * q_amax in [2^8, 2^9)
    q = (q.to(tl.float32) * ((shift + 127) << 23).to(tl.float32, bitcast=True)).to(tl.float16)
    return q, scale * ((127 - shift) << 23).to(tl.float32, bitcast=True)


# Integers that change from step to step. Triton would otherwise compile a variant per value class
# (== 1, divisible by 16, other) of each: new compiles (seconds each) in the middle of serving when a
# step meets a class the warm-up did not; these kernels gain nothing from the specialisation.
PER_STEP_INTS = ("num_seqs", "num_tokens")


@triton.jit
def _slot_offset(slot, stride_cn, stride_cb, BLOCK_SIZE: tl.constexpr):
    """Offset of cache slot ``slot`` (``block_id * BLOCK_SIZE + position``) in a layer's cache."""
    return (slot // BLOCK_SIZE) * stride_cn + (slot % BLOCK_SIZE) * stride_cb


@triton.jit
def write_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    cache_ptr,  # [N, 2, B, Hkv, D]
    slot_ptr,  # [T] int64, -1 = skip
    k_scale_ptr,  # [] or [Hkv] fp32 (FP8 cache)
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cn,
    stride_ckv,
    stride_cb,
    stride_ch,
    stride_cd,
    stride_ks,  # 0: one scale per layer, 1: one per KV head
    stride_vs,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,  # KV block size (a constant: // and % become shifts)
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    QUANTIZE: tl.constexpr,  # FP8 cache: stored = saturate(x / scale) rounded to nearest even
    USE_K_SCALE: tl.constexpr,
    USE_V_SCALE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MAN: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_ULP: tl.constexpr,
):
    # One program per token moves all of its heads: [H_PAD, D_PAD] tiles of K and V.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    # (slot broadcast to a block first: the interpreter rejects a scalar & block mask)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    mask = mask & (offs_d[None, :] * 0 + slot >= 0)
    dst = cache_ptr + _slot_offset(slot, stride_cn, stride_cb, BLOCK_SIZE)
    dst = dst + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    k_src = key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd
    v_src = (
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd
    )
    k = tl.load(k_src, mask=mask)
    v = tl.load(v_src, mask=mask)
    if QUANTIZE:
        h_mask = offs_h < num_kv_heads
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        if USE_K_SCALE:
            ks = tl.load(k_scale_ptr + offs_h * stride_ks, mask=h_mask, other=1.0)
            k = tl.div_rn(k, ks[:, None])
        if USE_V_SCALE:
            vs = tl.load(v_scale_ptr + offs_h * stride_vs, mask=h_mask, other=1.0)
            v = tl.div_rn(v, vs[:, None])
        k = _round_to_fp8(k, FP8_MAX, FP8_MAN, FP8_MIN_NORMAL, FP8_SUB_ULP)
        v = _round_to_fp8(v, FP8_MAX, FP8_MAN, FP8_MIN_NORMAL, FP8_SUB_ULP)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _find_seq(cu_ptr, target, num_seqs, BLOCK_Q: tl.constexpr, PLUS_S: tl.constexpr = 1):
    """Largest ``s`` with ``cu[s] // BLOCK_Q + PLUS_S * s <= target``.

    With ``PLUS_S`` 1 these are the query blocks' starts (the sequence of query block target);
    with 0, the starts of the blocks after each sequence's first (``_locate_query_block`` with
    ``FIRST_BLOCKS``). Either key is non-decreasing in ``s``, so the answer is the number of keys
    <= target, minus one. A binary search narrows ``[lo, hi)`` to at most ``SCAN`` sequences
    (nothing to do for steps of <= SCAN sequences), then one vector load counts the rest: one
    dependent memory round trip instead of log2(S) for every program of a decode step.
    """
    lo = 0
    hi = num_seqs
    while hi - lo > SCAN:
        mid = (lo + hi) // 2
        start = tl.load(cu_ptr + mid) // BLOCK_Q + PLUS_S * mid
        if start <= target:
            lo = mid + 1
        else:
            hi = mid
    s = lo + tl.arange(0, SCAN)  # [SCAN] candidate sequences
    valid = s < hi
    starts = tl.load(cu_ptr + s, mask=valid, other=0) // BLOCK_Q + PLUS_S * s
    return lo + tl.sum((valid & (starts <= target)).to(tl.int32), 0) - 1


@triton.jit
def _grid_position(HEADS_FASTEST: tl.constexpr, REVERSE_BLOCKS: tl.constexpr = False):
    """This program's query block and head program. The grid's first two axes are (query blocks,
    head programs), or with ``HEADS_FASTEST`` (head programs, query blocks): a query block's head
    programs then launch together and read the same cache pages. ``REVERSE_BLOCKS``: program
    ``i`` takes query block ``n - 1 - i`` (a causal prompt's blocks with the most keys first)."""
    if HEADS_FASTEST:
        block = tl.program_id(1)
        head_prog = tl.program_id(0)
        num_blocks = tl.num_programs(1)
    else:
        block = tl.program_id(0)
        head_prog = tl.program_id(1)
        num_blocks = tl.num_programs(0)
    if REVERSE_BLOCKS:
        block = num_blocks - 1 - block
    return block, head_prog


@triton.jit
def _spare_program(
    out_ptr, cu_ptr, pid, num_seqs, num_tokens, head, offs_m, offs_d, d_mask, stride_ot,
    stride_oh, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    D_PAD: tl.constexpr, ZERO: tl.constexpr,
):  # fmt: skip
    """Whether program ``pid`` is spare (past every sequence's query blocks: ``tail >= 0``). With
    ``ZERO`` a spare program zeroes its share of the padded query rows ``[cu[S], T)``, so every
    output row is finite."""
    real_end = tl.load(cu_ptr + num_seqs)  # cu[S]: the first padded query row
    tail = pid - (real_end // BLOCK_Q + num_seqs)
    if ZERO:  # noqa: SIM102 (a constexpr, then a runtime branch)
        if tail >= 0:
            tok = real_end + tail * BLOCK_Q + offs_m // GROUP
            pad_mask = (offs_m < BLOCK_Q * GROUP) & (tok < num_tokens)
            ptrs = out_ptr + tok[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh
            zeros = tl.zeros([BLOCK_M, D_PAD], dtype=out_ptr.dtype.element_ty)
            tl.store(ptrs + offs_d[None, :], zeros, mask=pad_mask[:, None] & d_mask[None, :])
    return tail >= 0


@triton.jit
def _locate_query_block(
    cu_ptr, seq_lens_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr, FIRST_BLOCKS: tl.constexpr = False
):
    """Program ``pid``'s sequence, its query start and length, the block's index inside it and
    the sequence's KV length.

    The grid has ``T // BLOCK_Q + S + 1`` query blocks, more than the step's ``sum_s
    ceil(q_len_s / BLOCK_Q)``; the programs past ``cu[S] // BLOCK_Q + S`` are spare (they zero
    the padded query rows), the others without a block return at once. Two layouts:
    - default: sequence ``s``'s blocks start at ``cu[s] // BLOCK_Q + s`` (in order);
    - ``FIRST_BLOCKS`` (decode steps): programs ``[0, S)`` take each sequence's first block, and
      block ``j >= 1`` of sequence ``s`` is program ``S + cu[s] // BLOCK_Q + j - 1`` (these
      ranges never overlap: ``cu[s+1] // BLOCK_Q - cu[s] // BLOCK_Q >= ceil(q_len_s / BLOCK_Q) -
      1``). A decode step's working programs are then the grid's first ``S`` blocks, with no
      empty ones among them, where the default layout leaves every ``(BLOCK_Q + 1)``-th block
      of a one-token-per-sequence step empty. That costs most where the whole grid is resident
      at once (a decode program that fits five per SM: 148 us with the empty blocks at the end,
      237 us interleaved, 64 x 4096, H200), ~0.3% for the unified FP8 kernel (H100;
      benchmarks/NOTES.md section 10).
    """
    if FIRST_BLOCKS:
        first = pid < num_seqs
        later = pid - num_seqs  # (branch-free: a branch here costs the loop registers)
        seq = tl.where(first, pid, _find_seq(cu_ptr, later, num_seqs, BLOCK_Q, 0))
        q_start = tl.load(cu_ptr + seq)
        local = tl.where(first, 0, later - q_start // BLOCK_Q + 1)
    else:
        seq = _find_seq(cu_ptr, pid, num_seqs, BLOCK_Q)
        q_start = tl.load(cu_ptr + seq)
        local = pid - (q_start // BLOCK_Q + seq)  # query block index inside the sequence
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    kv_len = tl.load(seq_lens_ptr + seq)
    return seq, q_start, q_len, local, kv_len


@triton.jit
def _load_query_rows(
    q_ptr, q_start, q_len, local, context, head, offs_m, offs_d, d_mask, stride_qt, stride_qh,
    stride_qd, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
):  # fmt: skip
    """The block's rows (query token x GQA head): ``q [BLOCK_M, D_PAD]``, each row's absolute
    position, packed token index and validity."""
    q_idx = local * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] query index inside the sequence
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context + q_idx  # [BLOCK_M] absolute position (< 0: a padding query)
    q_tok = (q_start + q_idx).to(tl.int64)  # [BLOCK_M] row in the packed query
    q = tl.load(
        q_ptr
        + q_tok[:, None] * stride_qt
        + head[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, D_PAD]
    return q, q_pos, q_tok, row_valid


@triton.jit
def _rope_partner(cols, HEAD_DIM: tl.constexpr):
    """Rotate-half RoPE: each column's partner (``c + D/2`` in the first half, ``c - D/2`` in the
    second) and the partner's sign (-1, +1)."""
    first = cols < HEAD_DIM // 2
    partner = tl.where(first, cols + HEAD_DIM // 2, cols - HEAD_DIM // 2)
    return partner, tl.where(first, -1.0, 1.0)


@triton.jit
def _rotate(x, x_partner, sign, cos_ptr, sin_ptr, tok, stride_cos, stride_sin, cols, mask):
    """``x * cos + sign * x_partner * sin`` in float32 (cos/sin of token ``tok``, column ``cols``:
    broadcast like ``x``), rounded once to ``x``'s dtype: transformers' ``apply_rotary_pos_emb``
    as Inductor computes it (paged_ops/rope.py)."""
    c = tl.load(cos_ptr + tok * stride_cos + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tok * stride_sin + cols, mask=mask, other=0.0).to(tl.float32)
    y = x.to(tl.float32) * c + (sign * x_partner.to(tl.float32)) * s
    return y.to(x.dtype)


@triton.jit
def _tanh(x):
    # tanh from exp2 of a non-positive argument (no overflow); the interpreter has no libdevice.
    t = tl.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2|x|), -2 * log2(e)
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # float32 inputs: exact IEEE products (Triton's default would round them to TF32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit(do_not_specialize=PER_STEP_INTS)
def paged_attention_kernel(
    out_ptr,  # [T, Hq, D] (NUM_SEGMENTS == 1) or partial acc [T, Hq, NUM_SEGMENTS, D_PAD] fp32
    part_m_ptr,  # [T, Hq, NUM_SEGMENTS] fp32 running max (log2 units); unused if NUM_SEGMENTS == 1
    part_l_ptr,  # [T, Hq, NUM_SEGMENTS] fp32 running sum
    q_ptr,  # [T, Hq, D]
    cache_ptr,  # [N, 2, B, Hkv, D]
    cache_pairs_ptr,  # [N, 2, B, Hkv, D / 2] int16 view of an FP8 cache (V_PAIRS; else unused)
    cu_ptr,  # [S+1] int32
    seq_lens_ptr,  # [S] int32
    block_table_ptr,  # [S, W] int32
    sinks_ptr,  # [Hq] fp32
    alibi_ptr,  # [Hq] fp32
    k_scale_ptr,  # [] or [Hkv] fp32 (FP8 cache)
    v_scale_ptr,
    stride_ks,  # 0: one scale per layer, 1: one per KV head
    stride_vs,
    new_k_ptr,  # [T, Hkv, D] this step's keys (WRITE_KV; else unused)
    new_v_ptr,  # [T, Hkv, D]
    slot_ptr,  # [T] int64 cache slot of each token, -1 = none
    stride_nkt,
    stride_nkh,
    stride_nkd,
    stride_nvt,
    stride_nvh,
    stride_nvd,
    cos_ptr,  # [T, D] rotary cos of each token, unit stride along D (ROPE; else unused)
    sin_ptr,  # [T, D]
    stride_cos,
    stride_sin,
    scale,
    softcap,
    window,
    num_seqs,
    num_tokens,
    num_q_heads,
    stride_ot,
    stride_oh,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_cn,
    stride_ckv,
    stride_cb,
    stride_ch,
    stride_cd,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,  # KV block size (a constant: runtime // and % cost prefill ~10%)
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    D_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # (a constant: when it equals D_PAD the column masks fold away)
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    USE_K_SCALE: tl.constexpr,
    USE_V_SCALE: tl.constexpr,
    FP8_CACHE: tl.constexpr,  # the cache holds FP8 values: convert each K/V tile
    FP8_BITS: tl.constexpr,  # cache given as uint8 FP8 bit patterns (interpreter): decode by hand
    FP8_MAN: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_SUB_ULP: tl.constexpr,
    F16_DOT: tl.constexpr,  # FP8 cache, 16-bit query: scaled float16 dots (see below)
    KV_HEADS: tl.constexpr = 1,  # KV heads per program (GROUP covers all their query heads)
    HEADS_FASTEST: tl.constexpr = False,  # grid (KV heads, query blocks, segments)
    V_PAIRS: tl.constexpr = False,  # F16_DOT, HEAD_DIM == D_PAD, unit stride: V as int16 pairs
    FIRST_BLOCKS: tl.constexpr = False,  # each sequence's first query block first (decode)
    WRITE_KV: tl.constexpr = False,  # decode steps (one query per sequence): write its K/V here
    ROPE: tl.constexpr = False,  # WRITE_KV: rotate the query rows and the written K (rotate-half)
):
    pid, head_prog = _grid_position(HEADS_FASTEST)
    kv_head = head_prog * KV_HEADS  # the program's first KV head
    segment = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    head = head_prog * GROUP + offs_m % GROUP  # [BLOCK_M] query head of each row
    # Columns of the K/V tiles and the accumulator: [KV_HEADS * D_PAD], head-major.
    if KV_HEADS == 1:
        cols = offs_d
        col_mask = d_mask
        col_off = offs_d * stride_cd  # [D_PAD] offsets inside a cache row
    else:
        offs_c = tl.arange(0, KV_HEADS * D_PAD)
        cols = offs_c % D_PAD  # [KV_HEADS * D_PAD] head-dim index of each column
        col_head = offs_c // D_PAD  # which of the program's KV heads
        col_mask = cols < HEAD_DIM
        col_off = col_head * stride_ch + cols * stride_cd
        row_head = (offs_m % GROUP) // (GROUP // KV_HEADS)  # [BLOCK_M] each row's KV head
        own = col_head[None, :] == row_head[:, None]  # [BLOCK_M, KV_HEADS * D_PAD]

    if WRITE_KV and FIRST_BLOCKS:
        # A decode step (one query token per sequence): program s < S holds sequence s's only
        # query block, with no search and no load before its metadata's (the programs >= S
        # zero the padded query rows or have nothing to do). Two to three dependent L2 round
        # trips fewer per program (benchmarks/NOTES.md section 33).
        if pid >= num_seqs:
            _spare_program(
                out_ptr, cu_ptr, pid, num_seqs, num_tokens, head, offs_m, offs_d, d_mask,
                stride_ot, stride_oh, GROUP, BLOCK_Q, BLOCK_M, D_PAD, NUM_SEGMENTS == 1,
            )  # fmt: skip
            return
        seq = pid
        q_start = tl.load(cu_ptr + seq)
        q_len = tl.load(cu_ptr + seq + 1) - q_start
        local = 0
        kv_len = tl.load(seq_lens_ptr + seq)
    else:
        # Spare programs (past every sequence's query blocks) zero the padded query rows.
        if _spare_program(
            out_ptr, cu_ptr, pid, num_seqs, num_tokens, head, offs_m, offs_d, d_mask,
            stride_ot, stride_oh, GROUP, BLOCK_Q, BLOCK_M, D_PAD, NUM_SEGMENTS == 1,
        ):  # fmt: skip
            return

        seq, q_start, q_len, local, kv_len = _locate_query_block(
            cu_ptr, seq_lens_ptr, pid, num_seqs, BLOCK_Q, FIRST_BLOCKS
        )
    if local * BLOCK_Q >= q_len:
        return
    context = kv_len - q_len  # absolute position of the sequence's first query token
    q, q_pos, q_tok, row_valid = _load_query_rows(
        q_ptr, q_start, q_len, local, context, head, offs_m, cols, col_mask, stride_qt,
        stride_qh, stride_qd, GROUP, BLOCK_Q,
    )  # fmt: skip
    if ROPE:
        tl.static_assert(WRITE_KV, "ROPE: the decode step that writes its K/V only")
        partner, sign = _rope_partner(cols, HEAD_DIM)
        q_partner, _, _, _ = _load_query_rows(
            q_ptr, q_start, q_len, local, context, head, offs_m, partner, col_mask, stride_qt,
            stride_qh, stride_qd, GROUP, BLOCK_Q,
        )  # fmt: skip
        q = _rotate(q, q_partner, sign, cos_ptr, sin_ptr, q_tok[:, None], stride_cos, stride_sin,
                    cols[None, :], row_valid[:, None] & col_mask[None, :])  # fmt: skip
    if KV_HEADS > 1:
        q = tl.where(own, q, 0.0)  # [BLOCK_M, KV_HEADS * D_PAD]: zero in the other heads' columns
    if F16_DOT:
        q, scale = _float16_query(q, scale)

    # KV positions any row of this block can see: [kv_lo, kv_hi). Padding queries (q_len > kv_len,
    # left padding) sit at negative positions; a block of them has last_pos < 0, so kv_hi <= 0 and
    # tile_hi <= 0 <= tile_lo (with or without segments): an empty tile range, and its rows keep
    # m = -inf, l = 0 (or the sink alone) and store zeros. (Not clamped with tl.maximum: that
    # made prefill 5-10% slower on the H200, benchmarks/NOTES.md section 11.)
    first_pos = context + local * BLOCK_Q
    last_pos = tl.minimum(first_pos + BLOCK_Q, kv_len) - 1
    kv_hi = last_pos + 1 if CAUSAL else kv_len
    kv_lo = tl.maximum(first_pos - window + 1, 0) if USE_WINDOW else 0
    tile_lo = kv_lo // TILE_N
    tile_hi = tl.cdiv(kv_hi, TILE_N)
    if NUM_SEGMENTS > 1:
        per_segment = tl.cdiv(tile_hi - tile_lo, NUM_SEGMENTS)
        tile_lo = tile_lo + segment * per_segment
        tile_hi = tl.minimum(tile_lo + per_segment, tile_hi)

    if USE_SINKS and NUM_SEGMENTS == 1:
        m_i = tl.load(sinks_ptr + head) * LOG2E  # the sink joins the softmax as one more logit
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head)  # [BLOCK_M]
    if V_PAIRS:
        # V read as int16 pairs of FP8 values (_fp8_pairs_to_float16): the even and the odd
        # columns accumulate apart and are interleaved after the loop.
        offs_p = tl.arange(0, KV_HEADS * D_PAD // 2)  # [C / 2] pair index, head-major
        pair_off = (offs_p // (D_PAD // 2)) * (stride_ch // 2) + offs_p % (D_PAD // 2)
        v_pairs_base = cache_pairs_ptr + (kv_head * stride_ch + stride_ckv) // 2
        acc = tl.zeros([BLOCK_M, KV_HEADS * D_PAD // 2], dtype=tl.float32)  # even columns
        acc_odd = tl.zeros([BLOCK_M, KV_HEADS * D_PAD // 2], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, KV_HEADS * D_PAD], dtype=tl.float32)
    # FP8 cache: read = stored * scale. k_scale joins the softmax scale, v_scale the output.
    if USE_K_SCALE:
        if KV_HEADS == 1:
            scale = scale * tl.load(k_scale_ptr + kv_head * stride_ks)
        else:  # each row its own head's scale, [BLOCK_M, 1]
            scale = scale * tl.load(k_scale_ptr + (kv_head + row_head) * stride_ks)[:, None]
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    kv_base = cache_ptr + kv_head * stride_ch
    if WRITE_KV:
        # A decode step (the caller guarantees one query token per sequence): the program whose
        # KV range holds the token's own position stores its K/V rows (this program's KV heads)
        # before reading that tile; a CTA barrier makes the stores visible to every thread. No
        # other program of the step reads that slot.
        tl.static_assert(not FP8_CACHE, "WRITE_KV: bf16/fp16/fp32 caches only")
        own_tile = (kv_len - 1) // TILE_N
        if (q_len > 0) & (own_tile >= tile_lo) & (own_tile < tile_hi):
            tok = q_start.to(tl.int64)
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            if KV_HEADS == 1:  # noqa: SIM108 (col_head exists only with KV_HEADS > 1)
                src_head = kv_head + cols * 0
            else:
                src_head = kv_head + col_head
            keep = col_mask & (cols * 0 + slot >= 0)
            k_row = tl.load(
                new_k_ptr + tok * stride_nkt + src_head * stride_nkh + cols * stride_nkd,
                mask=keep,
            )  # [KV_HEADS * D_PAD]
            if ROPE:
                k_partner = tl.load(
                    new_k_ptr + tok * stride_nkt + src_head * stride_nkh + partner * stride_nkd,
                    mask=keep,
                )  # [KV_HEADS * D_PAD]
                k_row = _rotate(k_row, k_partner, sign, cos_ptr, sin_ptr, tok, stride_cos,
                                stride_sin, cols, keep)  # fmt: skip
            v_row = tl.load(
                new_v_ptr + tok * stride_nvt + src_head * stride_nvh + cols * stride_nvd,
                mask=keep,
            )
            dst = kv_base + _slot_offset(slot, stride_cn, stride_cb, BLOCK_SIZE)
            tl.store(dst + col_off, k_row.to(cache_ptr.dtype.element_ty), mask=keep)
            tl.store(dst + stride_ckv + col_off, v_row.to(cache_ptr.dtype.element_ty), mask=keep)
            tl.debug_barrier()
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] KV positions
        n_valid = offs_n < kv_len
        blk = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        offs_kv = blk * stride_cn + (offs_n % BLOCK_SIZE) * stride_cb  # [TILE_N]
        kv_mask = n_valid[:, None] & col_mask[None, :]
        if FP8_CACHE:
            kv_ptrs = kv_base + offs_kv[:, None] + col_off[None, :]
            k = _load_kv(
                kv_ptrs, kv_mask, q.dtype, FP8_BITS, FP8_MAN, FP8_BIAS, FP8_SUB_ULP
            )  # [TILE_N, D_PAD]
            if V_PAIRS:
                v_pairs = tl.load(
                    v_pairs_base + offs_kv[:, None] // 2 + pair_off[None, :],
                    mask=n_valid[:, None],
                    other=0,
                )  # [TILE_N, C / 2] int16
                v, v_odd = _fp8_pairs_to_float16(
                    v_pairs, FP8_MAN, FP8_BIAS, FP8_SUB_ULP, FP8_BITS
                )  # [TILE_N, C / 2] float16 each
            else:
                v = _load_kv(
                    kv_ptrs + stride_ckv,
                    kv_mask,
                    q.dtype,
                    FP8_BITS,
                    FP8_MAN,
                    FP8_BIAS,
                    FP8_SUB_ULP,
                )  # [TILE_N, D_PAD]
        else:
            # (written out, not through _load_kv: that form made bf16 prefill 8-10% slower on the
            # H200, benchmarks/NOTES.md section 11)
            k = tl.load(
                kv_base + offs_kv[:, None] + col_off[None, :], mask=kv_mask, other=0.0
            )  # [TILE_N, D_PAD]
            v = tl.load(
                kv_base + stride_ckv + offs_kv[:, None] + col_off[None, :],
                mask=kv_mask,
                other=0.0,
            )  # [TILE_N, D_PAD]
        s = _dot(q, tl.trans(k), IEEE_DOT)
        s = s * scale  # [BLOCK_M, TILE_N] fp32
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        rel = offs_n[None, :] - q_pos[:, None]  # [BLOCK_M, TILE_N], j - p
        if USE_ALIBI:
            s = s + slope[:, None] * rel.to(tl.float32)
        visible = row_valid[:, None] & n_valid[None, :]
        if CAUSAL:
            visible = visible & (rel <= 0)
        if USE_WINDOW:
            visible = visible & (rel > -window)
        s = tl.where(visible, s * LOG2E, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_DOT)
        if V_PAIRS:
            acc_odd = acc_odd * alpha[:, None] + _dot(p.to(v_odd.dtype), v_odd, IEEE_DOT)
        m_i = m_new

    if V_PAIRS:  # columns 2c and 2c + 1 side by side: [BLOCK_M, KV_HEADS * D_PAD]
        acc = tl.reshape(tl.join(acc, acc_odd), [BLOCK_M, KV_HEADS * D_PAD])

    if USE_V_SCALE:
        if KV_HEADS == 1:
            acc = acc * tl.load(v_scale_ptr + kv_head * stride_vs)
        else:
            acc = acc * tl.load(v_scale_ptr + (kv_head + row_head) * stride_vs)[:, None]
    store_mask = row_valid[:, None] & col_mask[None, :]  # [BLOCK_M, KV_HEADS * D_PAD]
    if KV_HEADS > 1:
        store_mask = store_mask & own  # each row keeps its own head's half
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that sees no key reads zeros
        ptrs = out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + cols[None, :]
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        row = (q_tok * num_q_heads + head) * NUM_SEGMENTS + segment  # [BLOCK_M]
        tl.store(part_m_ptr + row, m_i, mask=row_valid)
        tl.store(part_l_ptr + row, l_i, mask=row_valid)
        ptrs = out_ptr + row[:, None] * D_PAD + cols[None, :]
        if KV_HEADS == 1:
            tl.store(ptrs, acc, mask=row_valid[:, None])
        else:
            tl.store(ptrs, acc, mask=store_mask)


@triton.jit(do_not_specialize=PER_STEP_INTS)
def prefill_attention_kernel(
    out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D]
    cache_ptr,  # [N, 2, B, Hkv, D] (16-bit, fp32 or FP8)
    cu_ptr,  # [S+1] int32
    seq_lens_ptr,  # [S] int32
    block_table_ptr,  # [S, W] int32
    k_scale_ptr,  # [] or [Hkv] fp32 (FP8 cache)
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
    stride_cd,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    D_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    USE_K_SCALE: tl.constexpr = False,
    USE_V_SCALE: tl.constexpr = False,
    FP8_CACHE: tl.constexpr = False,
    FP8_BITS: tl.constexpr = False,
    FP8_MAN: tl.constexpr = 3,
    FP8_BIAS: tl.constexpr = 7,
    FP8_SUB_ULP: tl.constexpr = 2.0**-9,
    F16_DOT: tl.constexpr = False,
    HEADS_FASTEST: tl.constexpr = False,  # grid (KV heads, query blocks)
    REVERSE_BLOCKS: tl.constexpr = False,  # query blocks launch last first
):
    """Plain causal attention for prefill and mixed steps (no window, softcap, sinks, ALiBi).

    The grid, the GQA-packed M tile and the sequence search are the unified kernel's. Tiles every
    row of the block sees whole (at or before the first row's position) skip the causal mask; only
    the last ones (the diagonal, the end of the KV) apply it. V is loaded after the softmax. (H200, 4 x 2048 causal, D=128: the unified kernel 596 us, a
    textbook paged kernel of this shape 418 us; benchmarks/NOTES.md section 11.)
    ``REVERSE_BLOCKS``: a sequence's blocks with the most keys (its last) start first and the
    grid's last wave holds short ones (a causal prompt's blocks differ in work up to
    ``q_len / TILE_N``-fold); ``HEADS_FASTEST``: see :func:`_grid_position`.
    """
    pid, kv_head = _grid_position(HEADS_FASTEST, REVERSE_BLOCKS)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head of each row

    if _spare_program(  # spare programs zero the padded query rows
        out_ptr, cu_ptr, pid, num_seqs, num_tokens, head, offs_m, offs_d, d_mask, stride_ot,
        stride_oh, GROUP, BLOCK_Q, BLOCK_M, D_PAD, True,
    ):  # fmt: skip
        return

    seq, q_start, q_len, local, kv_len = _locate_query_block(
        cu_ptr, seq_lens_ptr, pid, num_seqs, BLOCK_Q
    )
    if local * BLOCK_Q >= q_len:
        return
    context = kv_len - q_len
    q, q_pos, q_tok, row_valid = _load_query_rows(
        q_ptr, q_start, q_len, local, context, head, offs_m, offs_d, d_mask, stride_qt,
        stride_qh, stride_qd, GROUP, BLOCK_Q,
    )  # fmt: skip
    if F16_DOT:  # FP8 cache: float16 dots, as in the unified kernel
        q, scale = _float16_query(q, scale)
    if USE_K_SCALE:  # FP8 cache: read = stored * scale
        scale = scale * tl.load(k_scale_ptr + kv_head * stride_ks)
    qk_scale = scale * LOG2E

    first_pos = context + local * BLOCK_Q  # position of the block's first row
    last_pos = tl.minimum(first_pos + BLOCK_Q, kv_len) - 1
    # [0, full_hi): tiles wholly at or before first_pos, seen by every row (and inside the KV);
    # [full_hi, tile_hi): tiles that need the causal mask (first_pos < 0: all of them). A block
    # with kv_len == 0 has last_pos < 0, so no tile at all.
    full_hi = tl.maximum(first_pos + 1, 0) // TILE_N
    tile_hi = tl.maximum(tl.cdiv(last_pos + 1, TILE_N), full_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    kv_base = cache_ptr + kv_head * stride_ch
    # One loop (two loops pipeline worse: each drains its own prologue/epilogue); the branch on the
    # tile index is uniform across the program.
    for tile in range(0, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] KV positions
        # Positions past the KV end read the last key instead (only masked tiles have them, and
        # there the causal mask hides them from every valid row): loads need no row predicate,
        # and never touch memory outside the sequence's blocks.
        offs_ld = tl.minimum(offs_n, kv_len - 1)
        blk = tl.load(table_row + offs_ld // BLOCK_SIZE).to(tl.int64)
        offs_kv = blk * stride_cn + (offs_ld % BLOCK_SIZE) * stride_cb  # [TILE_N]
        kv_ptrs = kv_base + offs_kv[:, None] + offs_d[None, :] * stride_cd
        if FP8_CACHE:
            k = _load_kv(kv_ptrs, d_mask[None, :], q.dtype, FP8_BITS, FP8_MAN, FP8_BIAS,
                         FP8_SUB_ULP)  # fmt: skip
        else:
            k = tl.load(kv_ptrs, mask=d_mask[None, :], other=0.0)  # [TILE_N, D_PAD]
        s = _dot(q, tl.trans(k), IEEE_DOT) * qk_scale  # [BLOCK_M, TILE_N] fp32, log2 units
        if tile >= full_hi:  # the diagonal and the KV end: causal mask
            s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8_CACHE:
            v = _load_kv(kv_ptrs + stride_ckv, d_mask[None, :], q.dtype, FP8_BITS, FP8_MAN,
                         FP8_BIAS, FP8_SUB_ULP)  # fmt: skip
        else:
            v = tl.load(kv_ptrs + stride_ckv, mask=d_mask[None, :], other=0.0)  # [TILE_N, D_PAD]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_DOT)
        m_i = m_new
    if USE_V_SCALE:
        acc = acc * tl.load(v_scale_ptr + kv_head * stride_vs)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that sees no key reads zeros
    ptrs = out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=("num_seqs",))
def reduce_segments_kernel(
    out_ptr,  # [T, Hq, D]
    part_acc_ptr,  # [T, Hq, NUM_SEGMENTS, D_PAD] fp32
    part_m_ptr,  # [T, Hq, NUM_SEGMENTS] fp32
    part_l_ptr,  # [T, Hq, NUM_SEGMENTS] fp32
    cu_ptr,  # [S+1] int32
    sinks_ptr,  # [Hq] fp32
    num_seqs,
    num_q_heads,
    head_dim,
    stride_ot,
    stride_oh,
    NUM_SEGMENTS: tl.constexpr,
    D_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < head_dim
    dst = out_ptr + token * stride_ot + head * stride_oh + offs_d
    if token >= tl.load(cu_ptr + num_seqs):  # padded query token: nothing was computed for it
        tl.store(dst, tl.zeros([D_PAD], dtype=out_ptr.dtype.element_ty), mask=d_mask)
        return
    row = (token * num_q_heads + head) * NUM_SEGMENTS
    offs_s = tl.arange(0, NUM_SEGMENTS)
    m = tl.load(part_m_ptr + row + offs_s)  # [NUM_SEGMENTS]
    sums = tl.load(part_l_ptr + row + offs_s)
    m_max = tl.max(m, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head) * LOG2E
        m_max = tl.maximum(m_max, sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every segment empty: no -inf - -inf
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # empty segments weigh nothing
    denom = tl.sum(w * sums, 0)
    if USE_SINKS:
        denom += tl.exp2(sink - m_max)
    denom = tl.where(denom == 0.0, 1.0, denom)  # a row that sees no key reads zeros
    acc = tl.load(part_acc_ptr + (row + offs_s)[:, None] * D_PAD + offs_d[None, :])
    out = tl.sum(acc * w[:, None], 0) / denom  # [D_PAD]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d_mask)
