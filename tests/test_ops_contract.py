"""Op registration: opcheck (schema, fake kernel, mutation contract) and torch.compile behaviour."""

import pytest
import torch
from paged_testing import make_batch

import paged_ops


def op_args(batch, **overrides):
    args = dict(
        scale=0.125, causal=True, window=0, softcap=0.0, sinks=None, alibi_slopes=None,
        k_scale=None, v_scale=None, backend="reference",
    )  # fmt: skip
    args.update(overrides)
    return (
        batch.query,
        batch.kv_cache,
        batch.cu_seqlens_q,
        batch.seq_lens,
        batch.block_table,
        args["scale"],
        args["causal"],
        args["window"],
        args["softcap"],
        args["sinks"],
        args["alibi_slopes"],
        args["k_scale"],
        args["v_scale"],
        args["backend"],
        -1,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_write_kv(dtype):
    batch = make_batch(
        [(3, 4), (0, 2)],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=4,
        dtype=dtype,
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "features",
    [{}, {"window": 3, "softcap": 4.0}, {"sinks": torch.zeros(4), "causal": False}],
    ids=["plain", "window_softcap", "sinks_noncausal"],
)
def test_opcheck_paged_attention(dtype, features):
    batch = make_batch(
        [(3, 4), (5, 1), (0, 2)],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=4,
        dtype=dtype,
        pad_tokens=1,
        pad_seqs=1,
    )
    alibi = {"alibi_slopes": torch.ones(4)} if "sinks" in features else {}
    torch.library.opcheck(
        torch.ops.paged_ops.paged_attention.default, op_args(batch, **features, **alibi)
    )


def attention_step(query, key, value, kv_cache, slot_mapping, cu_seqlens_q, seq_lens, block_table):
    paged_ops.write_kv(key, value, kv_cache, slot_mapping)
    return paged_ops.paged_attention(
        query, kv_cache, cu_seqlens_q, seq_lens, block_table, sliding_window=8
    )


def test_compiled_step_runs_three_batch_compositions_without_recompiling():
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(attention_step, fullgraph=True, dynamic=False)
    # Same buffer sizes (T=12 tokens, S=4 sequences), different compositions each step.
    compositions = [
        [(0, 5), (0, 4), (0, 3)],  # three prefills, one padded sequence
        [(5, 1), (4, 1), (3, 1), (0, 9)],  # three decodes and a new prefill
        [(6, 6), (10, 2), (0, 1)],  # chunked prefill and a short prompt
    ]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step, seqs in enumerate(compositions):
            real = sum(q for _, q in seqs)
            batch = make_batch(
                seqs,
                num_q_heads=4,
                num_kv_heads=2,
                head_dim=32,
                block_size=4,
                pad_tokens=12 - real,
                pad_seqs=4 - len(seqs),
                seed=step,
            )
            # equal buffer shapes across steps: fixed cache and block-table width
            batch.kv_cache = torch.nn.functional.pad(
                batch.kv_cache, (0, 0, 0, 0, 0, 0, 0, 0, 0, 16 - batch.kv_cache.shape[0])
            )
            batch.block_table = torch.nn.functional.pad(
                batch.block_table, (0, 6 - batch.block_table.shape[1])
            )
            args = (
                batch.query,
                batch.new_key,
                batch.new_value,
                batch.kv_cache,
                batch.slot_mapping,
                batch.cu_seqlens_q,
                batch.seq_lens,
                batch.block_table,
            )
            eager_cache = batch.kv_cache.clone()
            expected = attention_step(
                batch.query, batch.new_key, batch.new_value, eager_cache, *args[4:]
            )
            got = compiled(*args)
            torch.testing.assert_close(got, expected)
            torch.testing.assert_close(batch.kv_cache, eager_cache)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
