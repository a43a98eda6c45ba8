"""The reference backend against an independent float64 dense computation."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paged_testing import (
    PADDED_FEATURES,
    assert_matches_dense,
    assert_rows_zero,
    dense_batch_f64,
    make_batch,
    make_left_padded_batch,
    rows_without_keys,
    write_and_attend,
)

import paged_ops

MIXED = [(0, 7), (13, 1), (30, 5), (0, 1), (21, 1)]  # (context_len, q_len): prefill, decode, chunk


def run_reference(batch, **kwargs):
    return write_and_attend(batch, "reference", **kwargs)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
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
    out = run_reference(batch)
    assert out.shape == batch.query.shape
    expected = dense_batch_f64(batch, scale=head_dim**-0.5)
    assert_matches_dense(out, batch, expected, rtol=1e-5)


FEATURES = {
    "sliding_window": dict(sliding_window=6),
    "softcap": dict(softcap=5.0, scale=0.3),
    "sinks": dict(sinks=torch.linspace(-1.0, 2.0, 8)),
    "alibi": dict(alibi_slopes=torch.tensor([2.0 ** -(i + 1) for i in range(8)])),
    "non_causal": dict(causal=False),
    "non_causal_window": dict(causal=False, sliding_window=4),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("block_size", [1, 16])
def test_features_match_dense_f64(feature, block_size):
    kwargs = dict(FEATURES[feature])
    batch = make_batch(
        MIXED,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=block_size,
        pad_tokens=2,
        seed=7,
    )
    out = run_reference(batch, **kwargs)
    dense_kwargs = {"scale": kwargs.pop("scale", 64**-0.5)}
    dense_kwargs["window"] = kwargs.pop("sliding_window", None)
    dense_kwargs.update(kwargs)
    assert_matches_dense(out, batch, dense_batch_f64(batch, **dense_kwargs), rtol=1e-5)


def test_sliding_window_changes_the_output():
    # Guards the test above against windows that never bite.
    batch = make_batch(MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4, seed=3)
    full = run_reference(batch)
    windowed = paged_ops.paged_attention(
        batch.query,
        batch.kv_cache,
        batch.cu_seqlens_q,
        batch.seq_lens,
        batch.block_table,
        sliding_window=6,
        backend="reference",
    )
    assert not torch.allclose(full, windowed)


def test_bfloat16_cache_accumulates_in_float32():
    batch = make_batch(
        MIXED, num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16, dtype=torch.bfloat16
    )
    out = run_reference(batch)
    assert out.dtype == torch.bfloat16
    assert_matches_dense(out, batch, dense_batch_f64(batch, scale=128**-0.5), rtol=1e-2)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 2, 16]),
    group=st.sampled_from([1, 2, 4]),
    pad_tokens=st.integers(0, 3),
    pad_seqs=st.integers(0, 2),
    window=st.one_of(st.none(), st.integers(1, 20)),
    seed=st.integers(0, 2**16),
)
def test_any_batch_composition_matches_dense_f64(
    seqs, block_size, group, pad_tokens, pad_seqs, window, seed
):
    batch = make_batch(
        seqs,
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=32,
        block_size=block_size,
        pad_tokens=pad_tokens,
        pad_seqs=pad_seqs,
        seed=seed,
    )
    out = run_reference(batch, sliding_window=window)
    expected = dense_batch_f64(batch, scale=32**-0.5, window=window)
    assert_matches_dense(out, batch, expected, rtol=1e-5)


def test_write_kv_skips_padding_slots():
    batch = make_batch(
        [(3, 4)], num_q_heads=2, num_kv_heads=2, head_dim=32, block_size=4, pad_tokens=5
    )
    before = batch.kv_cache.clone()
    paged_ops.write_kv(batch.new_key, batch.new_value, batch.kv_cache, batch.slot_mapping)
    changed = (batch.kv_cache != before).flatten(3).any(-1)  # [N, 2, B] rows that changed
    written = batch.slot_mapping[batch.slot_mapping >= 0]
    assert int(changed.sum()) == 2 * written.numel()
    for t, slot in enumerate(written.tolist()):
        block, off = divmod(slot, 4)
        torch.testing.assert_close(batch.kv_cache[block, 0, off], batch.new_key[t])
        torch.testing.assert_close(batch.kv_cache[block, 1, off], batch.new_value[t])


def _dense_kwargs(kwargs, head_dim):
    kwargs = dict(kwargs)
    dense = {
        "scale": kwargs.pop("scale", head_dim**-0.5),
        "window": kwargs.pop("sliding_window", None),
    }
    return dict(dense, **kwargs)


@pytest.mark.parametrize("feature", sorted(PADDED_FEATURES))
@pytest.mark.parametrize("block_size", [1, 4])
def test_left_padded_batch_rows_without_keys_read_zeros_and_the_rest_match_dense_f64(
    feature, block_size
):
    kwargs = PADDED_FEATURES[feature]
    batch = make_left_padded_batch(
        num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=block_size, seed=block_size
    )
    out = run_reference(batch, **kwargs)
    assert_matches_dense(out, batch, dense_batch_f64(batch, **_dense_kwargs(kwargs, 32)), rtol=1e-5)
    causal = kwargs.get("causal", True)
    empty = rows_without_keys(batch, causal=causal)
    assert len(empty) == (3 + 3 + 40 if causal else 3)  # guards the batch: p < 0 rows, seq_len 0
    assert_rows_zero(out, empty)
    assert_rows_zero(out, list(range(int(batch.cu_seqlens_q[-1]), out.shape[0])))  # padding tokens
    seen = sorted(set(range(int(batch.cu_seqlens_q[-1]))) - set(empty))
    assert (out[seen] != 0).flatten(1).any(-1).all()  # every row that sees a key reads something


@pytest.mark.parametrize("feature", ["plain", "everything"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rows_without_keys_read_zeros_in_every_dtype(dtype, feature):
    kwargs = PADDED_FEATURES[feature]
    batch = make_left_padded_batch(
        num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=5
    )
    out = run_reference(batch, **kwargs)
    assert out.dtype == dtype
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert_matches_dense(out, batch, dense_batch_f64(batch, **_dense_kwargs(kwargs, 64)), rtol=rtol)
    assert_rows_zero(out, rows_without_keys(batch))
