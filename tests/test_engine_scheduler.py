"""Scheduler and sampler unit tests: block bookkeeping, preemption, prefix sharing, noise (no model).

A fake runner stands in for the model: the "next token" of a sequence is a pure function of its
tokens so far, so a request's output is known in advance whatever the batching did to it.
"""

from __future__ import annotations

import torch

from paged_ops.cache import BlockAllocator
from paged_ops.engine.params import SamplingParams
from paged_ops.engine.sampler import SamplingBatch, counter_uniform, sample
from paged_ops.engine.scheduler import Scheduler, SeqStatus, Sequence

BLOCK = 4


def next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 1000 + 1


def expected(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def run(sched: Scheduler, seqs: list[Sequence]) -> int:
    """Step the scheduler to the end with the fake runner; returns the number of steps."""
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_work():
        batch = sched.schedule()
        assert batch.seqs, "no progress"
        for sl, n in zip(batch.slices, batch.num_new, strict=True):
            assert len(sl.block_ids) * BLOCK >= sl.context_len + n  # blocks cover the tokens
        assert batch.num_tokens <= sched.max_num_tokens and len(batch.seqs) <= sched.max_num_seqs
        pairs = zip(batch.seqs, batch.num_new, strict=True)
        sampled = [next_token(s.tokens[: s.num_computed + n]) for s, n in pairs]
        sched.postprocess(batch, sampled)
        steps += 1
    return steps


def make(prompts: list[list[int]], max_new: int) -> list[Sequence]:
    p = SamplingParams(max_new_tokens=max_new)
    return [Sequence(i, len(t), list(t), p, 0, frozenset()) for i, t in enumerate(prompts)]


def test_all_requests_finish_whole_under_block_pressure_with_newest_preempted_first():
    alloc = BlockAllocator(num_blocks=10, block_size=BLOCK)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_tokens=16, max_model_len=64)
    prompts = [[i + 1] * n for i, n in enumerate((9, 14, 5, 11, 7, 2))]
    seqs = make(prompts, 12)
    victims: list[int] = []
    original = sched._preempt

    def spy(seq: Sequence) -> None:
        assert seq.seq_id == max(s.seq_id for s in sched.running)  # always the newest
        victims.append(seq.seq_id)
        original(seq)

    sched._preempt = spy
    run(sched, seqs)
    assert victims and sched.num_preemptions == len(victims)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.status is SeqStatus.FINISHED and seq.finish_reason == "length"
        assert seq.output_ids == expected(prompt, 12)
    assert alloc.num_free == 10 and sched.num_prefill_chunks > 0


def test_common_prefix_blocks_are_shared_not_recomputed():
    alloc = BlockAllocator(num_blocks=32, block_size=BLOCK)
    sched = Scheduler(alloc, max_num_seqs=1, max_num_tokens=32, max_model_len=64)
    prefix = list(range(1, 11))  # two full blocks + 2 tokens
    prompts = [prefix + [50 + i] for i in range(3)]
    seqs = make(prompts, 3)
    run(sched, seqs)
    assert [s.num_cached_tokens for s in seqs] == [0, 8, 8]
    assert sched.num_cached_blocks == 4
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output_ids == expected(prompt, 3)


def test_prefix_hash_depends_on_every_earlier_block():
    alloc = BlockAllocator(num_blocks=32, block_size=BLOCK)
    sched = Scheduler(alloc, max_num_seqs=1, max_num_tokens=32, max_model_len=64)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    b = [9, 9, 9, 9, 5, 6, 7, 8, 9]  # second block equal, first differs
    seqs = make([a, b], 2)
    run(sched, seqs)
    assert seqs[1].num_cached_tokens == 0


def test_requests_that_can_never_fit_are_refused_up_front():
    alloc = BlockAllocator(num_blocks=3, block_size=BLOCK)
    sched = Scheduler(alloc, max_num_seqs=2, max_num_tokens=8, max_model_len=64)
    for prompt_len, max_new, match in ((64, 1, "max_model_len"), (10, 8, "KV blocks")):
        try:
            sched.check_fits(prompt_len, SamplingParams(max_new_tokens=max_new))
        except ValueError as err:
            assert match in str(err)
        else:
            raise AssertionError("no error")


def test_counter_noise_depends_only_on_seed_step_and_token():
    seeds = torch.tensor([5, 7, 5], dtype=torch.int64)
    steps = torch.tensor([0, 0, 1], dtype=torch.int64)
    u = counter_uniform(seeds, steps, 4096)  # [3, 4096]
    alone = counter_uniform(seeds[2:], steps[2:], 4096)
    assert torch.equal(u[2], alone[0])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert u.min() > 0 and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02


def test_sampler_respects_greedy_top_k_and_top_p():
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0, -1.0]] * 4)
    batch = SamplingBatch(
        temperatures=[0.0, 5.0, 5.0, 5.0], top_ks=[0, 1, 2, 0], top_ps=[1.0, 1.0, 1.0, 0.5],
        seeds=[1, 2, 3, 4], steps=[0, 0, 0, 0],
    )  # fmt: skip
    for step in range(50):
        batch.steps = [step] * 4
        out = sample(logits, batch).tolist()
        assert out[0] == 1 and out[1] == 1 and out[2] in (1, 2)
        assert out[3] in (1, 2)  # p(token 1) < 0.5 at temperature 5, so token 2 joins the set
    hot = SamplingBatch([1.0] * 256, [0] * 256, [1.0] * 256, list(range(256)), [0] * 256)
    counts = torch.bincount(sample(torch.zeros(256, 5), hot), minlength=5)
    assert (counts > 20).all()  # uniform logits: every token gets drawn
