"""The core on a CUDA device: reference backend, opcheck, metadata copies (run with -m gpu)."""

import pytest
import torch
from paged_testing import assert_matches_dense, dense_batch_f64, make_batch, write_and_attend

from paged_ops import MetadataBuilder, SequenceSlice

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_backend_on_cuda_matches_dense(dtype):
    batch = make_batch(
        [(0, 9), (40, 1), (17, 4)],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        block_size=16,
        dtype=dtype,
        device="cuda",
        pad_tokens=3,
        pad_seqs=1,
    )
    out = write_and_attend(batch, "reference", sliding_window=12)
    expected = dense_batch_f64(batch, scale=128**-0.5, window=12)
    assert_matches_dense(out, batch, expected, rtol=1e-5 if dtype == torch.float32 else 1e-2)


def test_opcheck_on_cuda():
    batch = make_batch(
        [(3, 4), (0, 2)],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=4,
        dtype=torch.bfloat16,
        device="cuda",
        pad_tokens=2,
    )
    torch.library.opcheck(
        torch.ops.paged_ops.write_kv.default,
        (
            batch.new_key,
            batch.new_value,
            batch.kv_cache,
            batch.slot_mapping,
            None,
            None,
            "reference",
        ),
    )
    torch.library.opcheck(
        torch.ops.paged_ops.paged_attention.default,
        (
            batch.query,
            batch.kv_cache,
            batch.cu_seqlens_q,
            batch.seq_lens,
            batch.block_table,
            0.125,
            True,
            0,
            0.0,
            None,
            None,
            None,
            None,
            "reference",
            -1,
        ),
    )


def test_metadata_builder_copies_each_step_into_fixed_device_buffers():
    b = MetadataBuilder(
        max_num_tokens=64,
        max_num_seqs=8,
        max_blocks_per_seq=4,
        block_size=16,
        num_blocks=32,
        device="cuda",
    )
    ptr = None
    for step in range(20):
        n = 1 + step % 5
        context = 16 + step % 10  # 17..30 tokens after the step: both blocks in use
        md = b.build([SequenceSlice([step % 32, 5], context, n)], num_tokens=8, num_seqs=2)
        assert md.slot_mapping.is_cuda and md.block_table.is_cuda
        if ptr is None:
            ptr = md.seq_lens.data_ptr()
        assert md.seq_lens.data_ptr() == ptr
        assert md.seq_lens.tolist() == [context + n, 0]
        assert md.block_table[0, :2].tolist() == [step % 32, 5]
        assert md.slot_mapping[n:].tolist() == [-1] * (8 - n)
