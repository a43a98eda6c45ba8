"""The ops under grad mode: values like under no_grad, no history through the cache, and a clear
error on backward (paged attention is inference-only)."""

from __future__ import annotations

import pytest
import torch
from paged_testing import make_batch, write_and_attend

import paged_ops
from paged_ops import KVCache


def _batch():
    return make_batch([(3, 4), (0, 5)], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=4)


def _requiring_grad(batch):
    for name in ("query", "new_key", "new_value"):
        setattr(batch, name, getattr(batch, name).clone().requires_grad_(True))
    return batch


def test_forward_with_grad_enabled_matches_no_grad_and_records_no_history_in_the_cache() -> None:
    with torch.no_grad():
        expected = write_and_attend(_batch(), "reference")
    batch = _requiring_grad(_batch())
    out = write_and_attend(batch, "reference")
    torch.testing.assert_close(out.detach(), expected, rtol=0, atol=0)
    assert not batch.kv_cache.requires_grad and batch.kv_cache.grad_fn is None
    assert out.requires_grad  # so that backward reaches the op and says why it cannot run


def test_backward_through_paged_attention_raises_a_clear_error() -> None:
    out = write_and_attend(_requiring_grad(_batch()), "reference")
    with pytest.raises(RuntimeError, match="inference-only"):
        out.sum().backward()


def test_no_grad_output_has_no_graph() -> None:
    with torch.no_grad():
        assert write_and_attend(_requiring_grad(_batch()), "reference").grad_fn is None


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_cache_made_under_no_grad_or_inference_mode_is_written_with_grad_on(mode) -> None:
    with mode():
        kv = KVCache(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=16)
    key = torch.randn(3, 2, 16, requires_grad=True)
    paged_ops.write_kv(key, key * 2, kv.layer(1), torch.tensor([0, 5, -1]))
    torch.testing.assert_close(kv.layer(1)[1, 0, 1], key[1].detach())


def test_compiled_ops_under_grad_mode() -> None:
    batch = _requiring_grad(_batch())

    def step(q, k, v):
        paged_ops.write_kv(k, v, batch.kv_cache, batch.slot_mapping, backend="reference")
        return paged_ops.paged_attention(
            q, batch.kv_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_table,
            backend="reference",
        )  # fmt: skip

    out = torch.compile(step, fullgraph=True, backend="aot_eager")(
        batch.query, batch.new_key, batch.new_value
    )
    with torch.no_grad():
        expected = write_and_attend(_batch(), "reference")
    torch.testing.assert_close(out.detach(), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="inference-only"):
        out.sum().backward()


def test_opcheck_with_inputs_that_require_grad() -> None:
    batch = _requiring_grad(_batch())
    paged_ops.write_kv(batch.new_key, batch.new_value, batch.kv_cache, batch.slot_mapping)
    args = (batch.query, batch.kv_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_table,
            0.2, True, 0, 0.0, None, None, None, None, "reference", -1)  # fmt: skip
    torch.library.opcheck(
        torch.ops.paged_ops.paged_attention.default,
        args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
