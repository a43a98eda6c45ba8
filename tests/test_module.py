"""MetadataBuilder padding and static buffers; PagedAttention end to end on the reference backend."""

import gc
import random
import types
import weakref

import pytest
import torch
from paged_testing import dense_attention_f64

from paged_ops import LayerConfig, MetadataBuilder, OutOfBlocksError, PagedAttention, SequenceSlice
from paged_ops.metadata import attention_pairs, classify_step


def test_builder_fills_contract_tensors_with_padding():
    b = MetadataBuilder(
        max_num_tokens=16, max_num_seqs=4, max_blocks_per_seq=3, block_size=4, num_blocks=10
    )
    md = b.build([SequenceSlice([7, 2], 3, 2), SequenceSlice([5], 0, 3)], num_tokens=8, num_seqs=3)
    assert md.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 20, 21, 22, -1, -1, -1]
    assert md.positions.tolist() == [3, 4, 0, 1, 2, 0, 0, 0]
    assert md.cu_seqlens_q.tolist() == [0, 2, 5, 5]
    assert md.seq_lens.tolist() == [5, 3, 0]
    assert md.block_table.tolist() == [[7, 2, 0], [5, 0, 0], [0, 0, 0]]
    assert md.logits_indices.tolist()[:2] == [1, 4]
    assert (md.num_tokens, md.num_seqs, md.max_query_len, md.max_seq_len) == (5, 2, 3, 5)


def test_builder_views_keep_their_addresses_across_steps():
    b = MetadataBuilder(
        max_num_tokens=16, max_num_seqs=4, max_blocks_per_seq=3, block_size=4, num_blocks=10
    )
    first = b.build([SequenceSlice([1], 0, 4)], num_tokens=8, num_seqs=2)
    ptrs = [t.data_ptr() for t in (first.slot_mapping, first.cu_seqlens_q, first.block_table)]
    second = b.build(
        [SequenceSlice([1, 3], 4, 1), SequenceSlice([2], 0, 2)], num_tokens=8, num_seqs=2
    )
    assert ptrs == [
        t.data_ptr() for t in (second.slot_mapping, second.cu_seqlens_q, second.block_table)
    ]
    assert first.seq_lens.tolist() == [5, 2]  # the same memory, updated in place


def test_builder_rejects_steps_that_do_not_fit():
    b = MetadataBuilder(
        max_num_tokens=4, max_num_seqs=2, max_blocks_per_seq=2, block_size=4, num_blocks=10
    )
    with pytest.raises(ValueError, match="max_num_tokens=4"):
        b.build([SequenceSlice([1, 2], 0, 5)])
    with pytest.raises(ValueError, match="needs 2 blocks, has 1"):
        b.build([SequenceSlice([1], 3, 2)])
    with pytest.raises(ValueError, match=r"out of range \[0, 10\)"):
        b.build([SequenceSlice([11], 0, 2)])


def test_paged_attention_module_prefill_then_decode_matches_dense():
    torch.manual_seed(0)
    hq, hkv, d, layers = 4, 2, 32, 2
    pa = PagedAttention(
        num_layers=layers,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        layers=[LayerConfig(), LayerConfig(sliding_window=3)],
        block_size=4,
        num_blocks=16,
        max_model_len=32,
        max_num_seqs=4,
    )
    history = {sid: ([], [], []) for sid in "ab"}  # per sequence: q, k, v rows of layer 1
    for batch in [{"a": 5, "b": 2}, {"a": 1, "b": 1}, {"b": 1, "a": 1}]:
        md = pa.prepare(batch, num_tokens=8, num_seqs=3)
        t = md.padded_num_tokens
        q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
        pa(0, q, k, v)
        out = pa(1, q, k, v)
        start = 0
        for sid, n in batch.items():
            hq_, hk_, hv_ = history[sid]
            hq_.append(q[start : start + n])
            hk_.append(k[start : start + n])
            hv_.append(v[start : start + n])
            ref = dense_attention_f64(
                q[start : start + n], torch.cat(hk_), torch.cat(hv_), scale=d**-0.5, window=3
            )
            torch.testing.assert_close(out[start : start + n].double(), ref, atol=1e-5, rtol=1e-5)
            start += n
    pa.release("a")
    pa.release("b")
    assert pa.allocator.num_free == 16


def test_prepare_is_atomic_when_blocks_run_out():
    pa = PagedAttention(
        num_layers=1,
        num_q_heads=2,
        num_kv_heads=2,
        head_dim=32,
        block_size=4,
        num_blocks=3,
        max_model_len=64,
    )
    pa.prepare({"a": 8})
    with pytest.raises(OutOfBlocksError, match="needs 2 more KV blocks, 1 free"):
        pa.prepare({"a": 1, "b": 4})
    assert pa.allocator.num_free == 1
    with pytest.raises(ValueError, match="max_model_len=64"):
        pa.prepare({"a": 60})


@pytest.mark.parametrize("seed", range(3))
def test_builder_block_table_equals_a_fresh_build_under_random_steps(seed):
    # The builder rewrites only the changed part of each row; whatever the history, the table must
    # hold each sequence's used blocks followed by zeros, as a fresh builder would write it.
    rng = random.Random(seed)
    kwargs = dict(max_num_tokens=64, max_num_seqs=6, max_blocks_per_seq=8, block_size=4,
                  num_blocks=40)  # fmt: skip
    b = MetadataBuilder(**kwargs)
    for _ in range(60):
        seqs = []
        for _ in range(rng.randint(1, 5)):
            total = rng.randint(1, 32)
            blocks = rng.sample(range(40), 8) if rng.random() < 0.5 else list(range(8))
            n = rng.randint(1, min(total, 4))
            seqs.append(SequenceSlice(blocks, total - n, n))
        num_seqs = rng.randint(len(seqs), 6)
        if rng.random() < 0.1:  # a rejected step must leave the builder's state intact
            bad = SequenceSlice([99] * 8, 0, 1)
            with pytest.raises(ValueError, match="out of range"):
                b.build([*seqs, bad][:6])
        md = b.build(seqs, num_seqs=num_seqs)
        fresh = MetadataBuilder(**kwargs).build(seqs, num_seqs=num_seqs)
        assert md.block_table.tolist() == fresh.block_table.tolist()
        assert md.host_block_table.tolist() == fresh.block_table.tolist()


def test_steps_with_padding_queries_skip_planned_backends():
    # FlashInfer's plans assume every query sees keys: a step with padding queries is not planned
    # and its layers run on the unplanned backend (triton, else reference).
    pa = PagedAttention(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, num_blocks=8,
                        block_size=4, max_model_len=16)  # fmt: skip
    plans = []
    spy = type("Spy", (), {"plan": lambda self, md: plans.append(md), "handle": -1})()
    pa.routing.groups[0].planners["reference"] = spy  # as if the layer's backend planned
    padded = pa.builder.build([SequenceSlice([0], 0, 2, num_pad_before=3)])
    assert padded.has_padding_queries and padded.cu_seqlens_q.tolist() == [0, 5]
    assert padded.slot_mapping.tolist() == [-1, -1, -1, 0, 1]
    pa.use_step(padded, key="hf")
    assert plans == []
    pa.layer_backends = ["flashinfer"]  # what "auto" picks on a CUDA machine with FlashInfer
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    out = pa(0, q, k, k)  # ran on padding_backends[0] (reference here), not the planned one
    assert pa.padding_backends == ["reference"] and torch.equal(out[:3], torch.zeros(3, 4, 16))
    pa.use_step(pa.builder.build([SequenceSlice([0], 0, 2)]), key="hf")
    assert len(plans) == 1


def test_planner_states_go_with_their_paged_attention(monkeypatch):
    """The plan-state registry holds each host-planned backend's planner (FlashInfer's, with its
    workspaces); a PagedAttention dropped without being unbound (an LLM or model deleted without
    close()) takes its planners with it."""
    from paged_ops import backends
    from paged_ops.backends import by_step

    def make_planner(owner, cfg):  # FlashInfer's make_planner, minus the CUDA buffers
        planner = types.SimpleNamespace(handle=-1)
        planner.handle = backends.register_plan_state(planner)
        return planner

    real = by_step.get_backend
    fake = types.SimpleNamespace(make_planner=make_planner)
    monkeypatch.setattr(by_step, "get_backend", lambda n: fake if n == "reference" else real(n))
    layers = [LayerConfig(), LayerConfig(sliding_window=8)]  # two groups: two planners
    pa = PagedAttention(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, num_blocks=8,
                        block_size=4, max_model_len=16, layers=layers, backend="reference")  # fmt: skip
    handles = [planner.handle for planner in pa.planners]
    assert len(handles) == 2
    assert all(backends.get_plan_state(h) is p for h, p in zip(handles, pa.planners, strict=True))
    alive = weakref.ref(pa)
    del pa
    gc.collect()
    assert alive() is None
    assert not any(h in backends._PLAN_STATES for h in handles), "a dropped PA left its planners"


def _expected_step(seqs, bs, num_tokens, num_seqs, width):
    """The contract tensors of a step, written out token by token (independent of the builder)."""
    slots, positions, cu, lens, last = [], [], [0], [], []
    table = [[0] * width for _ in range(num_seqs)]
    for r, s in enumerate(seqs):
        for p in range(s.context_len, s.context_len + s.num_new_tokens):
            slots.append(s.block_ids[p // bs] * bs + p % bs)
            positions.append(p)
        cu.append(cu[-1] + s.num_new_tokens)
        lens.append(s.context_len + s.num_new_tokens)
        last.append(max(cu[-1] - 1, 0))
        table[r][: min(len(s.block_ids), width)] = list(s.block_ids[:width])
    pad_t, pad_s = num_tokens - len(slots), num_seqs - len(seqs)
    return dict(
        slot_mapping=slots + [-1] * pad_t,
        positions=positions + [0] * pad_t,
        cu_seqlens_q=cu + [cu[-1]] * pad_s,
        seq_lens=lens + [0] * pad_s,
        logits_indices=last + [0] * pad_s,
        block_table=table,
    )


@pytest.mark.parametrize("seed", range(3))
def test_builder_matches_a_token_by_token_build_under_decode_heavy_steps(seed):
    # Engine-like history: sequences decode one token a step (the builder's fast path), their block
    # lists grow in place, sequences leave (rows shift) and join with prompt chunks (general path).
    rng = random.Random(seed)
    bs, width, num_blocks = 4, 6, 200
    b = MetadataBuilder(max_num_tokens=64, max_num_seqs=8, max_blocks_per_seq=width,
                        block_size=bs, num_blocks=num_blocks)  # fmt: skip
    free = list(range(num_blocks))
    rng.shuffle(free)
    live: list[dict] = []  # {"blocks": list (mutated in place), "len": tokens cached}
    for _ in range(120):
        if len(live) < 8 and rng.random() < 0.2:
            live.insert(
                rng.randint(0, len(live)), {"blocks": [], "len": 0, "prompt": rng.randint(2, 9)}
            )
        if live and rng.random() < 0.1:
            gone = live.pop(rng.randrange(len(live)))
            free.extend(gone["blocks"])
        live = [s for s in live if s["len"] < width * bs - 1]
        if not live:
            continue
        seqs = []
        for s in live:
            n = max(1, s["prompt"] - s["len"]) if s["len"] < s["prompt"] else 1
            n = min(n, width * bs - s["len"])
            while len(s["blocks"]) * bs < s["len"] + n:
                s["blocks"] += [free.pop()]  # in place, as the scheduler does
            seqs.append(SequenceSlice(s["blocks"], s["len"], n))
            s["len"] += n
        num_tokens = sum(x.num_new_tokens for x in seqs) + rng.randint(0, 3)
        num_seqs = rng.randint(len(seqs), 8)
        md = b.build(seqs, num_tokens=num_tokens, num_seqs=num_seqs)
        want = _expected_step(seqs, bs, num_tokens, num_seqs, width)
        for name, values in want.items():
            assert getattr(md, name).tolist() == values, name
        assert md.step_kind == classify_step(seqs)
        assert md.attention_pairs == attention_pairs(seqs)
        assert md.max_seq_len == max(x.context_len + x.num_new_tokens for x in seqs)


def test_builder_steps_whose_sequences_add_zero_or_two_tokens_are_not_decode_steps():
    # as many new tokens as sequences, but not one each: the general path, not the decode one
    b = MetadataBuilder(max_num_tokens=16, max_num_seqs=4, max_blocks_per_seq=4, block_size=4,
                        num_blocks=16)  # fmt: skip
    for seqs in (
        [SequenceSlice([3, 5], 5, 0), SequenceSlice([7, 2], 5, 2)],
        [SequenceSlice([1], 2, 2), SequenceSlice([6, 9], 4, 0)],
    ):
        md = b.build(seqs, num_tokens=4, num_seqs=3)
        for name, values in _expected_step(seqs, 4, 4, 3, 4).items():
            assert getattr(md, name).tolist() == values, name
        assert md.attention_pairs == attention_pairs(seqs) and md.step_kind == classify_step(seqs)
