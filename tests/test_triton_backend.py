"""The triton backend against float64 dense attention and the reference backend (CPU interpreter).

Without a GPU the kernels run under Triton's interpreter (conftest sets TRITON_INTERPRET=1), which is
slow: shapes here are tiny, yet cover every tile path (decode-like 16-row and prefill 64-row M tiles,
GQA groups that do not divide the tile, head size 256 with 32-wide (prefill) and 64-wide (decode) KV
tiles, split-KV). bfloat16 dots
are wrong under the interpreter, so bfloat16 is tested in test_triton_gpu.py.
"""

import dataclasses
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paged_testing import (
    PADDED_FEATURES,
    assert_matches_dense,
    assert_rows_zero,
    attend_writing_kv,
    count_write_kv_launches,
    dense_batch_f64,
    make_batch,
    make_left_padded_batch,
    rows_without_keys,
    with_leading_padding,
    write_and_attend,
)

import paged_ops
from paged_ops.backends import LayerSpec, resolve_backend
from paged_ops.backends import triton as triton_backend

# On a CUDA machine conftest leaves the interpreter off; there test_triton_gpu.py covers the kernels.
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1 (conftest sets it without a GPU)",
)

MIXED = [(0, 7), (13, 1), (30, 5), (0, 1), (21, 1)]  # (context_len, q_len): prefill, decode, chunk


def run_triton(batch, num_segments=None, **kwargs):
    """write_kv through the public op, then attention (``num_segments`` forces split-KV)."""
    return write_and_attend(batch, "triton", num_segments, **kwargs)


def dense_kwargs(head_dim, kwargs):
    kwargs = dict(kwargs)
    out = {
        "scale": kwargs.pop("scale", head_dim**-0.5),
        "window": kwargs.pop("sliding_window", None),
    }
    out.update(kwargs)
    return out


def assert_padding_rows_zero(out, batch):
    real = int(batch.cu_seqlens_q[-1])
    assert (out[real:] == 0).all(), "padded query rows must be written (zeros), not left as garbage"


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [40, 64])
def test_mixed_batch_matches_dense_f64(block_size, group, head_dim):
    batch = make_batch(
        MIXED,
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        pad_tokens=3,
        pad_seqs=2,
        seed=head_dim + group,
    )
    out = run_triton(batch)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    assert_matches_dense(out, batch, dense_batch_f64(batch, scale=head_dim**-0.5), rtol=1e-5)
    assert_padding_rows_zero(out, batch)


@pytest.mark.parametrize("num_segments", [None, 2], ids=["default", "split_kv"])
@pytest.mark.parametrize(
    ("seqs", "tokens", "num_seqs"),
    [
        ([(0, 9)], 64, 8),  # a batch-1 prompt in the engine's (64, 8) prefill graph
        ([(0, 37), (5, 1), (0, 9)], 64, 8),  # two prompts and a decode row (a mixed step)
        ([(12, 100)], 128, 8),  # a prompt chunk on a cached prefix
    ],
)
def test_a_step_padded_to_a_prefill_graph_matches_dense_f64(seqs, tokens, num_seqs, num_segments):
    """A prefill CUDA graph replays its ``(T, S)`` launch for every smaller step, padded: most of
    the query rows and sequences can be padding. The real rows match dense float64, the padded
    rows are zeros, and the padding tokens (slot -1) write nothing."""
    real = sum(q for _, q in seqs)
    batch = make_batch(seqs, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
                       pad_tokens=tokens - real, pad_seqs=num_seqs - len(seqs), seed=real)  # fmt: skip
    assert batch.query.shape[0] == tokens and batch.seq_lens.shape[0] == num_seqs
    if num_segments is None:  # the launch the graph's size picks: the prefill kernel here
        picked = triton_backend.launch_config(
            num_tokens=tokens, num_seqs=num_seqs, num_q_heads=8, num_kv_heads=2, head_dim=32,
            max_kv_len=batch.block_table.shape[1] * 16, num_sms=1, plain_causal=True,
        )  # fmt: skip
        assert picked.kernel == "prefill"
    out = run_triton(batch, num_segments)
    assert_matches_dense(out, batch, dense_batch_f64(batch, scale=32**-0.5), rtol=1e-5)
    assert_padding_rows_zero(out, batch)


FEATURES = {
    "plain": {},
    "sliding_window": dict(sliding_window=6),
    "softcap": dict(softcap=5.0, scale=0.3),
    "sinks": dict(sinks=torch.linspace(-1.0, 2.0, 8)),
    "alibi": dict(alibi_slopes=torch.tensor([2.0 ** -(i + 1) for i in range(8)])),
    "non_causal": dict(causal=False),
    "non_causal_window": dict(causal=False, sliding_window=4),
    "everything": dict(
        sliding_window=9, softcap=3.0, sinks=torch.linspace(0.5, -1.0, 8), scale=0.2
    ),
}


@pytest.mark.parametrize("num_segments", [None, 4], ids=["one_pass", "split_kv"])
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_features_match_dense_f64(feature, num_segments):
    batch = make_batch(
        MIXED, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=4, pad_tokens=2, seed=7
    )
    out = run_triton(batch, num_segments=num_segments, **FEATURES[feature])
    expected = dense_batch_f64(batch, **dense_kwargs(32, FEATURES[feature]))
    assert_matches_dense(out, batch, expected, rtol=1e-5)
    assert_padding_rows_zero(out, batch)


def test_long_prompts_use_prefill_tiles_and_match_dense():
    # T=95 > 2*S: 64-row M tiles (32 tokens x group 2), several query blocks per sequence.
    batch = make_batch(
        [(0, 70), (9, 25)], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, seed=2
    )
    cfg = triton_backend.launch_config(
        num_tokens=95, num_seqs=2, num_q_heads=4, num_kv_heads=2, head_dim=32, max_kv_len=160,
        num_sms=1,
    )  # fmt: skip
    assert (cfg.block_m, cfg.block_q, cfg.num_segments) == (64, 32, 1)
    out = run_triton(batch, sliding_window=40)
    expected = dense_batch_f64(batch, scale=32**-0.5, window=40)
    assert_matches_dense(out, batch, expected, rtol=1e-5)


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim",
    [(32, 1, 16), (2, 2, 256), (6, 1, 24)],
    ids=["group32_one_token_per_block", "head256_narrow_kv_tiles", "group6_padded_rows"],
)
def test_unusual_geometries_match_dense_f64(num_q_heads, num_kv_heads, head_dim):
    batch = make_batch(
        [(5, 3), (40, 1), (0, 2)],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=8,
        pad_tokens=1,
        seed=head_dim,
    )
    out = run_triton(batch)
    assert_matches_dense(out, batch, dense_batch_f64(batch, scale=head_dim**-0.5), rtol=1e-5)


def test_head256_decode_uses_64_wide_kv_tiles_and_matches_dense_f64():
    # decode-like steps of head size 256 take 64-wide KV tiles (prefill keeps 32)
    batch = make_batch([(70, 1), (130, 1), (9, 1)], num_q_heads=4, num_kv_heads=2, head_dim=256,
                       block_size=16, seed=7)  # fmt: skip
    shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=256, num_sms=1, max_kv_len=160)
    assert triton_backend.launch_config(num_tokens=3, num_seqs=3, **shape).tile_n == 64
    assert triton_backend.launch_config(num_tokens=64, num_seqs=3, **shape).tile_n == 32
    out = run_triton(batch)
    assert_matches_dense(out, batch, dense_batch_f64(batch, scale=256**-0.5), rtol=1e-5)


def test_float16_matches_dense():
    batch = make_batch(
        MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16
    )
    out = run_triton(batch, softcap=20.0)
    assert out.dtype == torch.float16
    assert_matches_dense(out, batch, dense_batch_f64(batch, scale=0.125, softcap=20.0), rtol=2e-3)


def test_split_kv_over_a_long_context_matches_reference():
    batch = make_batch(
        [(300, 1), (150, 2), (0, 1)], num_q_heads=4, num_kv_heads=1, head_dim=32, block_size=16
    )
    sinks = torch.tensor([0.0, 3.0, -2.0, 1.0])
    out = run_triton(batch, num_segments=8, sinks=sinks, sliding_window=200)
    expected = paged_ops.paged_attention(
        batch.query,
        batch.kv_cache,
        batch.cu_seqlens_q,
        batch.seq_lens,
        batch.block_table,
        sinks=sinks,
        sliding_window=200,
        backend="reference",
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=4),
    block_size=st.sampled_from([1, 2, 16]),
    group=st.sampled_from([1, 2, 4]),
    pad_tokens=st.integers(0, 3),
    pad_seqs=st.integers(0, 2),
    window=st.one_of(st.none(), st.integers(1, 20)),
    num_segments=st.sampled_from([None, 2]),
    seed=st.integers(0, 2**16),
)
def test_any_batch_composition_matches_dense_f64(
    seqs, block_size, group, pad_tokens, pad_seqs, window, num_segments, seed
):
    batch = make_batch(
        seqs,
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=16,
        block_size=block_size,
        pad_tokens=pad_tokens,
        pad_seqs=pad_seqs,
        seed=seed,
    )
    out = run_triton(batch, num_segments=num_segments, sliding_window=window)
    expected = dense_batch_f64(batch, scale=16**-0.5, window=window)
    assert_matches_dense(out, batch, expected, rtol=1e-5)
    assert_padding_rows_zero(out, batch)


@pytest.mark.parametrize("num_segments", [None, 2], ids=["one_pass", "split_kv"])
def test_steps_of_more_sequences_than_one_scan_find_every_sequence(num_segments):
    # _find_seq narrows > 128 sequences by binary search, then counts the rest in one vector load:
    # 300 sequences (decode rows, prefill and chunk rows among them, padded sequences at the end).
    seqs = [(i % 7, 1) for i in range(300)]
    seqs[5], seqs[130], seqs[257] = (0, 9), (3, 6), (11, 17)
    batch = make_batch(
        seqs, num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=4, pad_tokens=5, pad_seqs=3
    )
    out = run_triton(batch, num_segments=num_segments)
    assert_matches_dense(out, batch, dense_batch_f64(batch, scale=16**-0.5), rtol=1e-5)
    assert_padding_rows_zero(out, batch)


@pytest.mark.parametrize("prompt", [70, 129], ids=["70_tokens", "129_tokens"])
def test_cache_slots_past_each_sequence_are_never_read_even_if_they_hold_nan(prompt):
    # The prefill kernel loads without row predicates (positions past the KV end re-read the last
    # key); the unified kernel masks. Either way NaN bits in unused slots and blocks must not
    # reach the output.
    seqs = [(0, prompt), (40, 30), (5, 1), (0, 3)]
    batch = make_batch(seqs, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    used = torch.zeros(batch.kv_cache.shape[0], batch.kv_cache.shape[2], dtype=torch.bool)
    for s, kv_len in enumerate(batch.seq_lens.tolist()):
        for pos in range(kv_len):
            used[batch.block_table[s, pos // 16], pos % 16] = True
    batch.kv_cache.permute(0, 2, 1, 3, 4)[~used] = float("nan")  # slots: both K and V, all heads
    for num_segments in (None, 2):
        out = run_triton(batch, num_segments=num_segments)
        assert torch.isfinite(out).all()
        assert_matches_dense(out, batch, dense_batch_f64(batch, scale=16**-0.5), rtol=1e-5)


def test_write_kv_matches_reference_and_skips_padding():
    batch = make_batch(
        [(3, 4), (0, 5)], num_q_heads=2, num_kv_heads=2, head_dim=24, block_size=4, pad_tokens=3
    )
    expected = batch.kv_cache.clone()
    paged_ops.write_kv(
        batch.new_key, batch.new_value, expected, batch.slot_mapping, backend="reference"
    )
    before = batch.kv_cache.clone()
    paged_ops.write_kv(
        batch.new_key, batch.new_value, batch.kv_cache, batch.slot_mapping, backend="triton"
    )
    assert not torch.equal(batch.kv_cache, before)
    torch.testing.assert_close(batch.kv_cache, expected, rtol=0, atol=0)


def test_write_kv_into_a_strided_layer_view():
    # PagedAttention hands each layer a view of one [L, N, 2, B, Hkv, D] allocation.
    kv = paged_ops.KVCache(num_layers=3, num_blocks=4, block_size=2, num_kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    slots = torch.tensor([5, -1, 0])
    paged_ops.write_kv(key, value, kv.layers[1], slots, backend="triton")
    assert kv.data[[0, 2]].abs().sum() == 0  # other layers untouched
    torch.testing.assert_close(kv.layers[1][2, 0, 1], key[0])
    torch.testing.assert_close(kv.layers[1][0, 1, 0], value[2])
    assert int((kv.layers[1] != 0).sum()) == 2 * (2 * 2 * 16)  # 2 tokens x (K, V) x [Hkv, D]


@pytest.mark.parametrize("head_dim", [32, 64])
def test_small_head_decode_uses_128_wide_kv_tiles_and_matches_dense_f64(head_dim):
    # decode-like steps with D <= 64 read 128 keys per tile (prefill keeps 64); contexts that end
    # mid-tile and a split into segments (num_sms=1 leaves most of the grid idle: no split; a
    # forced split covers the segment path)
    batch = make_batch([(300, 1), (130, 1), (9, 1), (0, 1)], num_q_heads=8, num_kv_heads=2,
                       head_dim=head_dim, block_size=16, seed=head_dim)  # fmt: skip
    shape = dict(num_q_heads=8, num_kv_heads=2, head_dim=head_dim, num_sms=132, max_kv_len=320)
    cfg = triton_backend.launch_config(num_tokens=4, num_seqs=4, **shape)
    assert cfg.tile_n == 128 and cfg.num_segments == 1  # 3 KV tiles: too few to split
    assert triton_backend.launch_config(num_tokens=64, num_seqs=3, **shape).tile_n == 64
    expected = dense_batch_f64(batch, scale=head_dim**-0.5)
    for num_segments in (1, 2):
        out = run_triton(batch, num_segments=num_segments)
        assert_matches_dense(out, batch, expected, rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grid_with_kv_heads_fastest_gives_the_same_output(kv_heads):
    """Decode launches put the KV heads on the grid's first axis (``heads_fastest``): the same
    programs in another order, so the output is bit-identical; spare programs still zero rows."""
    batch = make_batch(
        MIXED, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=4, pad_tokens=2,
        pad_seqs=1, seed=11,
    )  # fmt: skip
    cfg = triton_backend.LaunchConfig(16, 16 // (4 * kv_heads), 16, 2, 4, 2, kv_heads=kv_heads)
    assert_program_order_is_invisible(batch, cfg, "heads_fastest")
    assert small_launch(num_tokens=8, num_seqs=8).heads_fastest == 1


@pytest.mark.parametrize("field", ["heads_fastest", "reverse_blocks"])
def test_prefill_kernel_grid_orders_give_the_same_output(field):
    """The prefill kernel's program orders (KV heads on the grid's first axis; query blocks last
    first): the same programs, so bit-identical outputs; spare programs still zero the padding.
    Prompts of several 8-token blocks, a chunk after a context, decodes."""
    seqs = [(0, 37), (13, 1), (30, 21), (0, 1), (5, 16)]
    batch = make_batch(seqs, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=4,
                       pad_tokens=3, pad_seqs=1, seed=12)  # fmt: skip
    cfg = triton_backend.LaunchConfig(32, 8, 16, 1, 4, 2, kernel="prefill")
    assert_program_order_is_invisible(batch, cfg, field)
    both = run_triton(batch, config=dataclasses.replace(cfg, heads_fastest=1, reverse_blocks=1))
    assert torch.equal(both, run_triton(batch, config=cfg))
    hopper = 227 * 1024  # bytes of shared memory a program may use on an H100/H200
    for tokens in (1024, 8192):  # both of the rule's prefill launches take both orders
        chosen = triton_backend.launch_config(
            num_tokens=tokens, num_seqs=4, num_q_heads=32, num_kv_heads=8, head_dim=128,
            max_kv_len=2048, num_sms=132, plain_causal=True, shared_memory=hopper,
        )  # fmt: skip
        assert (chosen.kernel, chosen.heads_fastest, chosen.reverse_blocks) == ("prefill", 1, 1)
        assert chosen.num_stages == (3 if tokens == 8192 else 2)  # long prompts: 3
    long_prompts = dict(num_tokens=8192, num_seqs=4, num_q_heads=32, num_kv_heads=8,
                        head_dim=128, max_kv_len=2048, num_sms=132, plain_causal=True)  # fmt: skip
    # fp32 queries, an FP8 cache (not measured), an A100's 163 KiB, no GPU: 2 stages
    for other in (dict(query_bytes=4, shared_memory=hopper), dict(fp8_cache=True, shared_memory=hopper),
                  dict(shared_memory=163 * 1024), {}):  # fmt: skip
        assert triton_backend.launch_config(**long_prompts, **other).num_stages == 2, other
    at_d64 = dict(long_prompts, head_dim=64, shared_memory=163 * 1024)  # 112 KiB: fits
    assert triton_backend.launch_config(**at_d64).num_stages == 3
    unified = dataclasses.replace(cfg, kernel="unified", reverse_blocks=1)
    with pytest.raises(ValueError, match="reverse_blocks=1 orders the prefill kernel's grid only"):
        run_triton(batch, config=unified)


def assert_program_order_is_invisible(batch, cfg, field: str) -> None:
    """``cfg`` with LaunchConfig ``field`` 0 and 1 (the same programs in another order): the
    outputs are bit-identical, match dense float64 and zero the padded rows."""
    outs = [run_triton(batch, config=dataclasses.replace(cfg, **{field: v})) for v in (0, 1)]
    assert torch.equal(outs[0], outs[1])
    assert_matches_dense(outs[1], batch, dense_batch_f64(batch, scale=32**-0.5), rtol=1e-5)
    assert_padding_rows_zero(outs[1], batch)


def small_launch(num_tokens: int, num_seqs: int):
    """The default launch of a step of the Hq=8, Hkv=2, D=32 layers these grid tests use."""
    return triton_backend.launch_config(
        num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=8, num_kv_heads=2, head_dim=32,
        max_kv_len=64, num_sms=132,
    )  # fmt: skip


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("num_segments", [1, 2])
@pytest.mark.parametrize(
    "seqs",
    [
        MIXED,
        # decode-like: one token, none (a finished sequence), two (a draft), nine (3 blocks of 4)
        [(40, 1), (7, 0), (19, 2), (0, 1), (25, 9), (3, 1), (64, 1)],
    ],
)
def test_first_blocks_layout_gives_the_same_output(seqs, num_segments, kv_heads):
    """``first_blocks`` (decode launches) maps programs to query blocks in another order: each
    sequence's first block, then the later blocks of long sequences. Every block is computed
    once (bit-identical to the default layout, dense float64 agrees) and padded rows are zeroed."""
    batch = make_batch(
        seqs, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=4, pad_tokens=3,
        pad_seqs=2, seed=len(seqs),
    )  # fmt: skip
    block_q = 16 // (4 * kv_heads)
    cfg = triton_backend.LaunchConfig(
        16, block_q, 16, num_segments, 4, 2, kv_heads=kv_heads, heads_fastest=1
    )
    assert_program_order_is_invisible(batch, cfg, "first_blocks")
    decode, prefill = (
        small_launch(num_tokens=8, num_seqs=8),
        small_launch(num_tokens=64, num_seqs=2),
    )
    assert (decode.first_blocks, prefill.first_blocks) == (1, 0)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("num_segments", [1, 2, 4])
def test_a_decode_step_written_by_the_attention_kernel_equals_write_kv_then_attention(
    num_segments, kv_heads
):
    """``new_key``/``new_value``/``slot_mapping`` (benchmarks/NOTES.md sections 23-24) make the
    decode program that owns each token's own KV tile store the token's K/V (then a CTA barrier)
    instead of a ``write_kv`` launch before the attention. The cache and
    the output equal write_kv then attention, for one and several segments (the owner is the
    segment whose tiles hold the position), one and two KV heads per program, a finished
    sequence (no query), padded tokens (slot -1: nothing written) and padded sequences."""
    seqs = [(40, 1), (7, 0), (19, 1), (0, 1), (15, 1), (3, 1), (63, 1)]
    kwargs = dict(num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=4, pad_tokens=3,
                  pad_seqs=2, seed=11)  # fmt: skip
    cfg = triton_backend.LaunchConfig(
        16, 16 // (4 * kv_heads), 16, num_segments, 4, 2, kv_heads=kv_heads, heads_fastest=1,
        first_blocks=1,
    )  # fmt: skip
    two_launches = make_batch(seqs, **kwargs)
    expected = run_triton(two_launches, config=cfg)
    one_launch = make_batch(seqs, **kwargs)
    untouched = one_launch.kv_cache.clone()
    got = attend_writing_kv(one_launch, config=cfg)
    assert torch.equal(one_launch.kv_cache, two_launches.kv_cache)
    assert not torch.equal(one_launch.kv_cache, untouched)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert_matches_dense(got, one_launch, dense_batch_f64(one_launch, scale=32**-0.5), rtol=1e-5)
    assert_padding_rows_zero(got, one_launch)
    with pytest.raises(ValueError, match="new_key, new_value and slot_mapping go together"):
        triton_backend.paged_attention(
            one_launch.query, one_launch.kv_cache, one_launch.cu_seqlens_q, one_launch.seq_lens,
            one_launch.block_table, scale=1.0, causal=True, window=0, softcap=0.0, sinks=None,
            alibi_slopes=None, config=cfg, new_key=one_launch.new_key,
        )  # fmt: skip


def test_the_default_decode_launch_with_kv_head_pairs_writes_and_attends_like_two_launches():
    """D=64 on a 16-bit cache with >= 4 (sequence, KV head) programs per SM (every step on a CPU,
    which counts one SM): the default launch pairs the KV heads with 64-wide tiles (NOTES.md
    section 33). Through the real default, with the kernel writing the step's K/V, the cache and
    output equal write_kv then attention at one head per program, and dense float64 agrees."""
    seqs = [(70, 1), (7, 0), (129, 1), (0, 1), (63, 1)]  # contexts over 1-3 tiles of 64
    kwargs = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, pad_tokens=2,
                  pad_seqs=1, seed=3)  # fmt: skip
    one_launch = make_batch(seqs, **kwargs)
    default = small_launch_of(one_launch)
    assert (default.kv_heads, default.block_q, default.tile_n) == (2, 2, 64)
    got = attend_writing_kv(one_launch)
    two_launches = make_batch(seqs, **kwargs)
    one_head = dataclasses.replace(default, kv_heads=1, block_q=4, tile_n=128)
    expected = run_triton(two_launches, config=one_head)
    assert torch.equal(one_launch.kv_cache, two_launches.kv_cache)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert_matches_dense(got, one_launch, dense_batch_f64(one_launch, scale=64**-0.5), rtol=1e-5)
    assert_padding_rows_zero(got, one_launch)


def small_launch_of(batch):
    """The default launch ``paged_attention`` picks for ``batch`` on this device."""
    return triton_backend.launch_config(
        num_tokens=batch.query.shape[0], num_seqs=batch.seq_lens.shape[0],
        num_q_heads=batch.query.shape[1], num_kv_heads=batch.kv_cache.shape[3],
        head_dim=batch.query.shape[2],
        max_kv_len=batch.block_table.shape[1] * batch.kv_cache.shape[2],
        num_sms=triton_backend._num_sms(batch.query.device),
    )  # fmt: skip


@pytest.mark.parametrize("first_blocks", [0, 1])
@pytest.mark.parametrize("num_segments", [1, 2])
def test_a_decode_row_whose_query_is_padding_writes_nothing_and_reads_the_cache(
    num_segments, first_blocks
):
    """A left-padded Hugging Face batch's decode step: a row whose one query is padding (slot -1,
    its KV length unchanged) must read the cache's row at its last position, not the step's
    (random) key, and write nothing: as write_kv then attention."""
    seqs = [(9, 1), (7, 0), (21, 1)]
    kwargs = dict(num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=4, pad_tokens=1,
                  seed=5)  # fmt: skip
    cfg = triton_backend.LaunchConfig(
        16, 4, 16, num_segments, 4, 2, heads_fastest=1, first_blocks=first_blocks
    )

    def batch():
        return with_leading_padding(make_batch(seqs, **kwargs), [0, 1, 0])

    two_launches, one_launch = batch(), batch()
    assert one_launch.slot_mapping.tolist()[:3] == [two_launches.slot_mapping[0].item(), -1,
                                                    two_launches.slot_mapping[2].item()]  # fmt: skip
    expected = run_triton(two_launches, config=cfg)
    got = attend_writing_kv(one_launch, config=cfg)
    assert torch.equal(one_launch.kv_cache, two_launches.kv_cache)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["prefill_kernel", "fp8_cache"])
def test_a_decode_write_the_kernel_cannot_do_runs_the_write_kernel_first(case, monkeypatch):
    """Where the attention kernel cannot store the K/V (the prefill kernel; an FP8 cache, which
    needs quantizing), ``new_key`` runs ``write_kv`` before the attention: same cache, same
    output as the two calls."""
    seqs = [(9, 1), (0, 1), (21, 1)]
    kwargs = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=4, pad_tokens=1,
                  pad_seqs=1, seed=3)  # fmt: skip
    extra: dict = {}
    if case == "prefill_kernel":
        extra["config"] = triton_backend.LaunchConfig(64, 32, 64, 1, 4, 2, kernel="prefill")

    def batch():
        b = make_batch(seqs, **kwargs)
        if case == "fp8_cache":
            b.kv_cache = b.kv_cache.to(torch.float8_e4m3fn)
        return b

    two_launches, one_call = batch(), batch()
    expected = run_triton(two_launches, **extra)
    writes = count_write_kv_launches(monkeypatch)
    got = attend_writing_kv(one_call, **extra)
    assert writes == [1]
    assert torch.equal(one_call.kv_cache.view(torch.uint8), two_launches.kv_cache.view(torch.uint8))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_launch_config_splits_small_decode_batches_only():
    common = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, num_sms=132)
    small = triton_backend.launch_config(num_tokens=1, num_seqs=1, max_kv_len=16384, **common)
    assert small.block_m == 16 and small.num_segments == triton_backend.MAX_SEGMENTS
    large = triton_backend.launch_config(num_tokens=256, num_seqs=256, max_kv_len=1024, **common)
    assert large.num_segments == 1
    short = triton_backend.launch_config(num_tokens=1, num_seqs=1, max_kv_len=64, **common)
    assert short.num_segments == 1  # one KV tile: nothing to split
    prefill = triton_backend.launch_config(num_tokens=4096, num_seqs=2, max_kv_len=4096, **common)
    assert (prefill.block_m, prefill.num_segments) == (64, 1)
    with pytest.raises(ValueError, match="num_segments must be a power of two >= 1, got 3"):
        triton_backend.launch_config(
            num_tokens=1, num_seqs=1, max_kv_len=64, num_segments=3, **common
        )


def test_fp8_decode_at_head_size_128_caps_registers_and_splits_to_fill_the_waves():
    # Capped at 128 registers, 4 programs share an SM (528 slots on 132 SMs): 64 x 8 = 512 working
    # programs fill one wave, so one pass; 32 x 8 = 256 fill half of it, so two segments.
    common = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, num_sms=132, max_kv_len=4096)
    fp8 = dict(common, fp8_cache=True)
    for batch, segments in ((32, 2), (64, 1), (256, 1)):
        cfg = triton_backend.launch_config(num_tokens=batch, num_seqs=batch, **fp8)
        assert (cfg.num_segments, cfg.maxnreg, cfg.tile_n) == (segments, 128, 128), batch
    assert triton_backend.launch_config(num_tokens=64, num_seqs=64, **common).maxnreg is None
    # D=64: KV heads in pairs make the D=128 program (4 x 2 pairs x 64 = 256 programs: 2 segments)
    small_head = dict(fp8, head_dim=64)
    cfg = triton_backend.launch_config(num_tokens=64, num_seqs=64, **small_head)
    assert (cfg.kv_heads, cfg.block_q, cfg.num_segments, cfg.maxnreg) == (2, 2, 2, 128)
    odd = dict(small_head, num_q_heads=28, num_kv_heads=7)  # no pairs with an odd Hkv
    assert triton_backend.launch_config(num_tokens=64, num_seqs=64, **odd).kv_heads == 1
    # fewer than 8 pair programs (one sequence x 4 pairs): one head per program
    assert triton_backend.launch_config(num_tokens=1, num_seqs=1, **small_head).kv_heads == 1
    assert triton_backend.launch_config(num_tokens=2, num_seqs=2, **small_head).kv_heads == 2
    small_head_bf16 = dict(common, head_dim=64)
    cfg = triton_backend.launch_config(num_tokens=64, num_seqs=64, **small_head_bf16)
    assert (cfg.kv_heads, cfg.maxnreg) == (1, None)
    # a prefill step on an FP8 cache keeps the uncapped launch
    assert triton_backend.launch_config(num_tokens=4096, num_seqs=2, **fp8).maxnreg is None


def test_bf16_decode_at_head_size_64_pairs_kv_heads_only_with_four_programs_per_sm():
    """A 16-bit cache at D=64: decode steps of >= 4 (sequence, KV head) programs per SM read two
    KV heads per program with 64-wide tiles (NOTES.md section 33); fewer programs, other head
    sizes, FP8 caches, odd KV head counts and prefill steps keep their launches."""
    common = dict(num_q_heads=32, num_kv_heads=8, head_dim=64, num_sms=132, max_kv_len=512)
    choose = triton_backend.launch_config

    def decode(batch: int, **kwargs):
        return choose(**{**common, "num_tokens": batch, "num_seqs": batch, **kwargs})

    for batch in (66, 128, 256):  # 66 x 8 = 528 = 4 x 132 programs: the first that pairs
        cfg = decode(batch)
        assert (cfg.kv_heads, cfg.block_q, cfg.tile_n, cfg.num_warps) == (2, 2, 64, 4), batch
        assert (cfg.first_blocks, cfg.heads_fastest, cfg.num_segments) == (1, 1, 1), batch
    assert (decode(65).kv_heads, decode(65).tile_n) == (1, 128)
    assert decode(256, num_sms=600).kv_heads == 1  # 2,048 programs < 4 x 600
    assert decode(256, head_dim=128).kv_heads == 1
    assert decode(256, num_q_heads=28, num_kv_heads=7).kv_heads == 1
    fp8 = decode(256, fp8_cache=True)
    assert (fp8.kv_heads, fp8.tile_n) == (2, 128)  # FP8's own pairs, 128-wide tiles
    prefill = choose(**{**common, "num_tokens": 4096, "num_seqs": 256})
    assert prefill.kv_heads == 1


def test_plain_causal_prefill_steps_take_the_prefill_kernel_and_others_the_unified_one():
    common = dict(num_q_heads=32, num_kv_heads=8, max_kv_len=4096, num_sms=132)
    choose = triton_backend.launch_config
    for fp8_cache in (False, True):
        assert choose(
            num_tokens=4096, num_seqs=2, head_dim=128, plain_causal=True, fp8_cache=fp8_cache,
            **common,
        ).kernel == ("prefill")  # fmt: skip
    for kwargs in (
        dict(num_tokens=4096, num_seqs=2, head_dim=128),  # a window, softcap, sinks or ALiBi
        dict(num_tokens=4096, num_seqs=2, head_dim=256, plain_causal=True),
        dict(num_tokens=512, num_seqs=8, head_dim=128, plain_causal=True, fp8_cache=True),
        dict(num_tokens=8, num_seqs=8, head_dim=128, plain_causal=True),  # decode
    ):
        assert choose(**kwargs, **common).kernel == "unified", kwargs
    # a forced prefill config for a layer it cannot serve is refused before any launch
    batch = make_batch(MIXED, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    cfg = triton_backend.LaunchConfig(64, 32, 64, 1, 4, 3, kernel="prefill")
    with pytest.raises(ValueError, match="plain causal attention only"):
        triton_backend.paged_attention(
            batch.query, batch.kv_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_table,
            scale=0.25, causal=True, window=4, softcap=0.0, sinks=None, alibi_slopes=None,
            config=cfg,
        )  # fmt: skip
    # a kernel name the backend does not have (the warp-split experiment was removed)
    with pytest.raises(ValueError, match="kernel must be one of .*'warp_split'"):
        triton_backend.paged_attention(
            batch.query, batch.kv_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_table,
            scale=0.25, causal=True, window=0, softcap=0.0, sinks=None, alibi_slopes=None,
            config=dataclasses.replace(cfg, kernel="warp_split"),
        )  # fmt: skip


def test_unsupported_layers_are_refused_with_a_reason():
    big = LayerSpec(head_dim=512, num_q_heads=8, num_kv_heads=8, dtype=torch.float16)
    with pytest.raises(ValueError, match="backend 'triton' cannot serve this layer: head size 512"):
        resolve_backend("triton", big, "cpu")
    bf16 = LayerSpec(head_dim=64, num_q_heads=8, num_kv_heads=8, dtype=torch.bfloat16)
    assert "interpreter" in triton_backend.unsupported_reason(bf16, torch.device("cpu"))
    fp16 = LayerSpec(head_dim=64, num_q_heads=8, num_kv_heads=8, dtype=torch.float16)
    assert triton_backend.unsupported_reason(fp16, torch.device("cpu")) is None


def test_opcheck_triton_ops():
    batch = make_batch(
        [(3, 4), (5, 1)], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, pad_tokens=1
    )
    torch.library.opcheck(
        torch.ops.paged_ops.write_kv.default,
        (batch.new_key, batch.new_value, batch.kv_cache, batch.slot_mapping, None, None, "triton"),
    )
    args = (batch.query, batch.kv_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_table)
    torch.library.opcheck(
        torch.ops.paged_ops.paged_attention.default,
        (*args, 0.25, True, 3, 4.0, torch.zeros(4), None, None, None, "triton", -1),
    )
    decode = make_batch(
        [(3, 1), (5, 1)], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, pad_tokens=1
    )
    for decode_step in (True, False):
        torch.library.opcheck(
            torch.ops.paged_ops.write_kv_and_attend.default,
            (decode.query, decode.new_key, decode.new_value, decode.kv_cache,
             torch.empty_like(decode.query), decode.slot_mapping, decode.cu_seqlens_q,
             decode.seq_lens, decode.block_table, torch.tensor(decode_step), 0.25, True, 3, 4.0,
             torch.zeros(4), None, None, None, "triton", -1),
        )  # fmt: skip


def test_module_on_triton_matches_module_on_reference(monkeypatch):
    """Prefill, mixed and decode steps; the decode step's K/V are written by the attention
    kernel (no write_kv launch), the others' by write_kv."""
    writes = count_write_kv_launches(monkeypatch)

    def build(backend):
        return paged_ops.PagedAttention(
            num_layers=2,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=16,
            layers=[paged_ops.LayerConfig(), paged_ops.LayerConfig(sliding_window=3)],
            block_size=4,
            num_blocks=16,
            max_num_seqs=4,
            max_model_len=32,
            backend=backend,
        )

    tri, ref = build("triton"), build("reference")
    assert tri.layer_backends == ["triton", "triton"]
    g = torch.Generator().manual_seed(0)
    # (step, padded tokens, write_kv launches): a decode step padded to 12 tokens for 4
    # sequences is prefill-like, and layer 0 (plain causal) takes the prefill kernel, which
    # writes nothing itself
    steps = [({"a": 6, "b": 3}, 12, 2), ({"a": 1, "b": 1, "c": 5}, 12, 2),
             ({"a": 1, "c": 1}, 4, 0), ({"b": 1, "c": 1}, 12, 1)]  # fmt: skip
    for step, t, launches in steps:
        for pa in (tri, ref):
            pa.prepare(step, num_tokens=t, num_seqs=4)
        assert bool(tri.step_is_decode) == (max(step.values()) == 1)
        writes.clear()
        for layer in range(2):
            q = torch.randn(t, 4, 16, generator=g)
            k, v = torch.randn(t, 2, 16, generator=g), torch.randn(t, 2, 16, generator=g)
            real = sum(step.values())
            torch.testing.assert_close(tri(layer, q, k, v)[:real], ref(layer, q, k, v)[:real])
        assert len(writes) == launches, step
        torch.testing.assert_close(tri.kv_cache.data, ref.kv_cache.data)


def test_compiled_module_writes_decode_kv_in_the_attention_kernel_without_recompiling(
    monkeypatch,
):
    """One compiled forward (Inductor) for prefill, decode and mixed steps: the step's kind
    reaches the op as a CPU tensor (no guard, no recompile); decode steps launch no write_kv, and
    the cache is written in place (Inductor's code copies no cache) and equals the reference's."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    writes = count_write_kv_launches(monkeypatch)
    common = dict(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                  num_blocks=16, max_num_seqs=4, max_model_len=32)  # fmt: skip
    tri = paged_ops.PagedAttention(backend="triton", **common)
    ref = paged_ops.PagedAttention(backend="reference", **common)
    compiled = torch.compile(lambda q, k, v: tri(0, q, k, v) * 2, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(1)
    steps = [({"a": 5, "b": 3}, 2), ({"a": 1, "b": 1}, 0), ({"a": 1, "b": 1, "c": 2}, 2)]
    codes: list[str] = []
    with torch._dynamo.config.patch(error_on_recompile=True), torch.inference_mode():
        for step, launches in steps:
            for pa in (tri, ref):
                pa.prepare(step, num_tokens=8, num_seqs=4)
            q = torch.randn(8, 4, 16, generator=g)
            k, v = torch.randn(8, 2, 16, generator=g), torch.randn(8, 2, 16, generator=g)
            writes.clear()
            got, code = run_and_get_code(compiled, q, k, v)
            codes += code
            real = sum(step.values())
            torch.testing.assert_close(got[:real], 2 * ref(0, q, k, v)[:real])
            assert len(writes) == launches // 2, step
            torch.testing.assert_close(tri.kv_cache.data, ref.kv_cache.data)
    assert codes and all("write_kv_and_attend" in c for c in codes)
    assert not any(".copy_(" in c or "clone" in c for c in codes), codes[0]


def test_with_autograd_recording_the_layer_takes_write_kv_then_attention():
    """A decode step with grad enabled and a query that requires grad: write_kv + attention
    (whose output's backward raises), never write_kv_and_attend, which refuses to record."""
    pa = paged_ops.PagedAttention(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16,
                                  block_size=4, num_blocks=8, max_model_len=16,
                                  backend="triton")  # fmt: skip
    md = pa.prepare({"a": 1, "b": 1})
    q = torch.randn(2, 4, 16, requires_grad=True)
    k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    out = pa(0, q, k, v)
    with pytest.raises(RuntimeError, match="inference-only"):
        out.sum().backward()
    with pytest.raises(RuntimeError, match="write_kv_and_attend is inference-only"):
        torch.ops.paged_ops.write_kv_and_attend.default(
            q, k, v, pa.kv_cache.layers[0], torch.empty(2, 4, 16), md.slot_mapping,
            md.cu_seqlens_q, md.seq_lens, md.block_table, pa.step_is_decode, 0.25, True, 0,
            0.0, None, None, None, None, "triton", -1,
        )  # fmt: skip


# Launch paths for the left-padded batch (T = 70, S = 9: the default launch takes 64-row M tiles of
# 32 tokens x group 2 and 64-wide KV tiles). Small tiles (8 tokens, 16-wide KV tiles) put whole blocks
# of padding queries at negative positions, down to more than two KV tiles below 0; split-KV takes
# 2 segments over 1 or 2 KV tiles, so the rows of short sequences also meet an empty segment.
SMALL_TILES = triton_backend.LaunchConfig(16, 8, 16, 1, num_warps=4, num_stages=2)
PADDED_PATHS = {
    "one_pass": {},
    "one_pass_small_tiles": dict(config=SMALL_TILES),
    "split_kv": dict(config=dataclasses.replace(SMALL_TILES, num_segments=2)),
}
FP32, FP16 = torch.float32, torch.float16
# (path, feature, dtype): every path runs plain (no sinks: the -inf running-max path) and everything
# (window + softcap + sinks + ALiBi) in float32 and plain in float16; one pass also sinks alone,
# small tiles also the windows and non-causal layers, split-KV also non-causal (seq_len 0 rows) and
# everything in float16.
PADDED_CASES = [
    ("one_pass", "plain", FP32),
    ("one_pass", "sinks", FP32),
    ("one_pass", "everything", FP32),
    ("one_pass", "plain", FP16),
    *[("one_pass_small_tiles", f, FP32) for f in PADDED_FEATURES if f not in ("alibi", "softcap")],
    ("one_pass_small_tiles", "plain", FP16),
    ("one_pass_small_tiles", "everything", FP16),
    *[("split_kv", f, FP32) for f in ("plain", "non_causal", "everything")],
    ("split_kv", "plain", FP16),
    ("split_kv", "everything", FP16),
]


@pytest.mark.parametrize(
    "path, feature, dtype", PADDED_CASES, ids=[f"{p}-{f}-{str(d)[6:]}" for p, f, d in PADDED_CASES]
)
def test_left_padded_batch_rows_without_keys_read_zeros_like_the_reference(path, feature, dtype):
    kwargs = PADDED_FEATURES[feature]
    shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=4, dtype=dtype, seed=11)
    batch = make_left_padded_batch(**shape)
    out = run_triton(batch, **PADDED_PATHS[path], **kwargs)
    ref = write_and_attend(make_left_padded_batch(**shape), "reference", **kwargs)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert_rows_zero(out, rows_without_keys(batch, causal=kwargs.get("causal", True)))
    assert_padding_rows_zero(out, batch)


def test_launch_overrides_parse_field_values_and_refuse_unknown_fields():
    spec = "num_stages=3,maxnreg=128,kernel=unified"
    assert triton_backend.parse_launch_overrides(spec) == dict(
        num_stages=3, maxnreg=128, kernel="unified"
    )
    with pytest.raises(ValueError, match="'stages=3' is not field=value"):
        triton_backend.parse_launch_overrides("stages=3")
