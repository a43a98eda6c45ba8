"""Bad input gets a clear TypeError/ValueError before any kernel runs."""

import pytest
import torch
from paged_testing import make_batch

import paged_ops
from paged_ops import PagedAttention


@pytest.fixture
def batch():
    return make_batch([(3, 2), (0, 3)], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=4)


def call(batch, **overrides):
    args = dict(
        query=batch.query,
        kv_cache=batch.kv_cache,
        cu_seqlens_q=batch.cu_seqlens_q,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
    )
    args.update(overrides)
    return paged_ops.paged_attention(**args)


def test_query_and_cache_dtypes_must_match(batch):
    with pytest.raises(
        TypeError, match="query dtype torch.float16 != kv_cache dtype torch.float32"
    ):
        call(batch, query=batch.query.half())


def test_query_heads_must_be_a_multiple_of_kv_heads(batch):
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of kv_cache heads"):
        call(batch, query=batch.query[:, :3])


def test_head_sizes_must_match(batch):
    with pytest.raises(ValueError, match="query head size 16 != kv_cache head size 32"):
        call(batch, query=batch.query[..., :16])


@pytest.mark.parametrize("name", ["cu_seqlens_q", "seq_lens", "block_table"])
def test_index_tensors_must_be_int32(batch, name):
    with pytest.raises(TypeError, match=f"{name} must be torch.int32, got torch.int64"):
        call(batch, **{name: getattr(batch, name).long()})


def test_index_shapes_must_agree(batch):
    with pytest.raises(ValueError, match="inconsistent batch sizes"):
        call(batch, seq_lens=batch.seq_lens[:1])
    with pytest.raises(ValueError, match="block_table must be 2-D"):
        call(batch, block_table=batch.block_table.flatten())


def test_block_id_out_of_range(batch):
    table = batch.block_table.clone()
    table[0, 0] = batch.kv_cache.shape[0]
    with pytest.raises(ValueError, match="block ids out of range"):
        call(batch, block_table=table)


def test_seq_len_shorter_than_query_makes_leading_queries_padding(batch):
    # Left padding: the first q_len - seq_len queries of a sequence see no key and read zeros.
    seq_lens = batch.seq_lens.clone()
    seq_lens[0] = 0
    out = call(batch, seq_lens=seq_lens)
    q_end = int(batch.cu_seqlens_q[1])
    assert q_end > 0 and torch.equal(out[:q_end], torch.zeros_like(out[:q_end]))


def test_bad_feature_arguments(batch):
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        call(batch, sliding_window=0)
    with pytest.raises(ValueError, match=r"sinks must be \[Hq\] = \[4\]"):
        call(batch, sinks=torch.zeros(2))
    with pytest.raises(TypeError, match="alibi_slopes must be torch.float32"):
        call(batch, alibi_slopes=torch.zeros(4, dtype=torch.float64))


def test_write_kv_checks_slots_and_shapes(batch):
    with pytest.raises(ValueError, match="slot_mapping values must be -1"):
        paged_ops.write_kv(
            batch.new_key,
            batch.new_value,
            batch.kv_cache,
            torch.full_like(batch.slot_mapping, 10_000),
        )
    with pytest.raises(TypeError, match="slot_mapping must be torch.int64"):
        paged_ops.write_kv(batch.new_key, batch.new_value, batch.kv_cache, batch.slot_mapping.int())
    with pytest.raises(ValueError, match="does not match kv_cache"):
        paged_ops.write_kv(
            batch.new_key[:, :1], batch.new_value[:, :1], batch.kv_cache, batch.slot_mapping
        )


def test_unknown_backend_name(batch):
    with pytest.raises(ValueError, match="unknown backend 'cudnn'; expected 'auto' or one of"):
        call(batch, backend="cudnn")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_flashinfer_cannot_serve_a_cpu_request(batch):
    with pytest.raises(ValueError, match="backend 'flashinfer'"):
        call(batch, backend="flashinfer")


def test_available_backends_on_this_machine():
    names = paged_ops.available_backends()
    assert "reference" in names
    if not torch.cuda.is_available():
        assert "flashinfer" not in names


def test_module_rejects_bad_geometry():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        PagedAttention(num_layers=1, num_q_heads=3, num_kv_heads=2, head_dim=8, num_blocks=4)
    with pytest.raises(ValueError, match="exactly one of num_blocks and memory_budget_bytes"):
        PagedAttention(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=8)
