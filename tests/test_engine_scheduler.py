"""Scheduler and sampler unit tests: block bookkeeping, preemption, prefix sharing, noise (no model).

A fake runner stands in for the model: the "next token" of a sequence is a pure function of its
tokens so far, so a request's output is known in advance whatever the batching did to it.
"""

from __future__ import annotations

import copy

import torch

from paged_ops.cache import BlockAllocator
from paged_ops.engine.params import SamplingParams
from paged_ops.engine.sampler import SamplingBatch, counter_uniform, greedy_ids, sample
from paged_ops.engine.scheduler import ScheduledBatch, Scheduler, SeqStatus, Sequence

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


def run_overlapped(sched: Scheduler, seqs: list[Sequence]) -> tuple[int, int, int]:
    """Step like ``LLM(overlap=True)``: schedule the next step before this one's tokens are read.

    Returns (steps, steps scheduled ahead, of those the mixed ones: requests admitted in them).
    """
    for s in seqs:
        sched.add(s)
    steps = ahead_steps = mixed_steps = 0
    launched = None  # (batch, its sampled tokens): the "device" result, read after the next launch

    def launch(batch, fed):
        assert batch.seqs, "no progress"
        assert batch.num_tokens <= sched.max_num_tokens and len(batch.seqs) <= sched.max_num_seqs
        sampled, ids = [], list(batch.input_ids)  # ids: the host's, rows after the fed ones
        for i, (s, sl) in enumerate(zip(batch.seqs, batch.slices, strict=True)):
            assert len(sl.block_ids) * BLOCK >= sl.context_len + sl.num_new_tokens
            if i < batch.num_fed:  # its input is the previous step's token, not appended yet
                assert sl.context_len == len(s.tokens) and sl.num_new_tokens == 1
                sampled.append(next_token([*s.tokens, fed[batch.feed_rows[i]]]))
            else:
                end = sl.context_len + sl.num_new_tokens
                assert ids[: sl.num_new_tokens] == s.tokens[sl.context_len : end]
                del ids[: sl.num_new_tokens]
                sampled.append(next_token(s.tokens[:end]))
        assert not ids
        sampled += [sampled[row] for row, _ in batch.forks]  # the fake runner: the same token
        return batch, sampled

    while sched.has_work():
        if launched is None:
            launched = launch(sched.schedule(), None)
        ahead = sched.schedule_ahead(launched[0])
        following = launch(ahead, launched[1]) if ahead is not None else None
        sched.postprocess(*launched)
        steps += 1
        ahead_steps += launched[0].feed_rows is not None
        mixed_steps += launched[0].is_mixed_ahead
        launched = following
    return steps, ahead_steps, mixed_steps


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


def test_steps_scheduled_ahead_give_the_same_tokens_and_free_every_block():
    prompts = [[i + 1] * n for i, n in enumerate((9, 14, 5, 11, 7, 2))]
    stops = {expected(p, 12)[k] for p, k in zip(prompts, (2, 5, 11), strict=False)}
    lengths = (12, 3, 7, 12, 1, 9)
    # plenty of blocks, tight enough to preempt, and fewer seats than requests (a queue)
    for num_blocks, seats in ((64, 4), (12, 4), (64, 2)):
        alloc = BlockAllocator(num_blocks=num_blocks, block_size=BLOCK)
        sched = Scheduler(alloc, max_num_seqs=seats, max_num_tokens=16, max_model_len=64)
        seqs = [
            Sequence(i, len(t), list(t), SamplingParams(max_new_tokens=n), 0, frozenset(stops))
            for i, (t, n) in enumerate(zip(prompts, lengths, strict=True))
        ]
        steps, ahead_steps, _ = run_overlapped(sched, seqs)
        assert ahead_steps > steps // 3
        for seq, prompt, n in zip(seqs, prompts, lengths, strict=True):
            want = expected(prompt, n)
            cut = next((k + 1 for k, t in enumerate(want) if t in stops), n)
            assert seq.output_ids == want[:cut], (num_blocks, seq.seq_id)
            assert seq.finish_reason == ("stop" if cut < n or want[-1] in stops else "length")
        assert alloc.num_free == num_blocks


def test_schedule_ahead_declines_when_it_cannot_run_the_next_decode_step():
    for num_blocks in (3, 4):
        alloc = BlockAllocator(num_blocks=num_blocks, block_size=BLOCK)
        sched = Scheduler(alloc, max_num_seqs=2, max_num_tokens=8, max_model_len=64)
        (long,) = make([[1] * 11], 20)
        sched.add(long)
        batch = sched.schedule()  # 8 of 11 prompt tokens: no token comes out of this step
        assert batch.num_new == [8]
        # queued ahead: the prompt's last 3 tokens, ids from the host, nothing fed
        rest = sched.schedule_ahead(batch)
        assert rest is not None and rest.feed_rows == [] and rest.is_mixed_ahead
        assert rest.num_new == [3] and rest.input_ids == [1, 1, 1]
        assert rest.slices[0].context_len == 8 and rest.sample_steps == [0]
        sched.postprocess(batch, [0])
        batch = rest  # the next step is a decode
        ahead = sched.schedule_ahead(batch)
        assert ahead is not None and ahead.feed_rows == [0] and ahead.slices[0].context_len == 11
        assert ahead.sample_steps == [1] and ahead.input_ids == [] and ahead.num_tokens == 1
        sched.postprocess(batch, [5])
        # the step after ``ahead`` writes token 13, which needs a 4th block
        nxt = sched.schedule_ahead(ahead)
        assert (nxt is None) == (num_blocks == 3)  # never preempts to run ahead
        assert long.status is SeqStatus.RUNNING and len(long.block_ids) == num_blocks


def test_schedule_ahead_never_skips_a_running_sequence_the_budget_left_out():
    # An older request (re-)admitted mid-prompt can take a whole step's budget and end its prompt;
    # the younger running one misses that step, and must not miss the steps queued after it.
    alloc = BlockAllocator(num_blocks=64, block_size=BLOCK)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_tokens=8, max_model_len=64)
    old, young = make([[1] * 15, [2] * 3], 20)
    sched.add(young)
    sched.postprocess(sched.schedule(), [5])  # young decodes from here on
    sched.add(old)  # joins behind young's decode with 7 of its 15 tokens
    batch = sched.schedule()
    assert [s.seq_id for s in batch.seqs] == [1, 0] and batch.num_new == [1, 7]
    sched.postprocess(batch, [6, 0])
    batch = sched.schedule()  # old (first now) takes all 8 tokens and ends its prompt
    assert batch.seqs == [old] and batch.num_new == [8]
    assert sched.schedule_ahead(batch) is None  # young would starve behind steps queued ahead
    sched.postprocess(batch, [7])
    batch = sched.schedule()
    assert batch.seqs == [old, young] and sched.schedule_ahead(batch) is not None


def test_schedule_ahead_with_requests_waiting_only_while_every_seat_stays_taken():
    alloc = BlockAllocator(num_blocks=64, block_size=BLOCK)
    sched = Scheduler(alloc, max_num_seqs=2, max_num_tokens=16, max_model_len=64)
    a, b, c = (
        Sequence(i, 3, [i + 1] * 3, SamplingParams(max_new_tokens=n), 0, frozenset())
        for i, n in enumerate((9, 2, 9))
    )
    for seq in (a, b, c):
        sched.add(seq)
    batch = sched.schedule()  # a and b take both seats; c waits
    assert batch.seqs == [a, b] and list(sched.waiting) == [c]
    ahead = sched.schedule_ahead(batch)  # nobody finishes: c could not join anyway
    assert ahead is not None and ahead.feed_rows == [0, 1]
    sched.postprocess(batch, [4, 4])
    # b's last token comes from ``ahead``: its seat frees, so c joins in a normal step
    assert sched.schedule_ahead(ahead) is None


def probe_ahead(sched: Scheduler, running: ScheduledBatch) -> ScheduledBatch | None:
    """``schedule_ahead(running)`` on copies of the scheduler and its sequences (it may admit)."""
    sched, running = copy.deepcopy((sched, running))
    return sched.schedule_ahead(running)


def test_schedule_ahead_admits_waiting_requests_only_when_their_blocks_are_free():
    # 8 blocks of 4. ``a`` decodes on 3 blocks (12 prompt tokens); a request whose first chunk
    # needs more blocks than the 4 left beside a's next token cannot join a normal step either,
    # so decode steps go on being queued ahead without it; one that fits (also thanks to the
    # prefix cache: a's two full blocks, registered) joins the step queued ahead (a mixed step).
    alloc = BlockAllocator(num_blocks=8, block_size=BLOCK)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_tokens=32, max_model_len=64)
    prompt = list(range(1, 13))
    a, big, shared, small = make([prompt, [50] * 20, prompt[:8] + [60] * 12, [70] * 5], 30)
    sched.add(a)
    batch = sched.schedule()
    sched.postprocess(batch, [5])
    batch = sched.schedule()  # a's first decode step; 4 blocks free beside its 4th block
    assert batch.seqs == [a] and alloc.num_free == 4
    sched.add(big)  # 20 tokens: 5 blocks
    ahead = sched.schedule_ahead(batch)
    assert ahead is not None and ahead.seqs == [a]  # big could not join a normal step either
    assert not ahead.is_mixed_ahead and ahead.input_ids == []
    sched.postprocess(batch, [6])
    assert alloc.num_free == 4 and big.status is SeqStatus.WAITING
    sched.waiting.clear()
    sched.add(shared)  # 20 tokens, the first 8 in a's registered blocks: 3 new blocks
    mixed = probe_ahead(sched, ahead)
    assert [s.seq_id for s in mixed.seqs] == [0, 2] and mixed.num_new == [1, 12]
    assert mixed.feed_rows == [0] and mixed.slices[1].context_len == 8
    assert mixed.input_ids == [60] * 12 and mixed.num_tokens == 13
    sched.waiting.clear()
    sched.add(small)  # 5 tokens: 2 blocks
    mixed = probe_ahead(sched, ahead)
    assert [s.seq_id for s in mixed.seqs] == [0, 3] and mixed.input_ids == [70] * 5
    sched.prefix_caching = False
    sched.waiting.appendleft(shared)  # without the prefix cache it needs 5 blocks again
    nxt = sched.schedule_ahead(ahead)  # and small waits behind it, as in ``schedule``
    assert nxt is not None and nxt.seqs == [a] and not nxt.is_mixed_ahead
    assert alloc.num_free == 4 and list(sched.waiting) == [shared, small]


def test_a_mixed_step_ahead_admits_what_the_normal_step_after_would():
    """With requests that can join, ``schedule_ahead`` returns the decode rows fed from the device
    followed by exactly what ``schedule`` admits once the running step is postprocessed: the same
    sequences, chunks, slices, blocks, prefix hits (on blocks the running step fills too) and
    counters; postprocessed in order, the two give the same sequences."""
    alloc = BlockAllocator(num_blocks=32, block_size=BLOCK)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_tokens=16, max_model_len=64)
    prefix = list(range(1, 9))  # b's prompt: two full blocks
    a, b, c, d, e = make([[1] * 6, prefix, prefix + [70] * 5, [80] * 20, [90] * 3], 20)
    sched.add(a)
    sched.add(b)
    running = sched.schedule()  # both prompts whole
    assert running.num_new == [6, 8]
    for seq in (c, d, e):
        sched.add(seq)
    ref, ref_running = copy.deepcopy((sched, running))
    ref.postprocess(ref_running, [5, 6])
    normal = ref.schedule()
    mixed = sched.schedule_ahead(running)
    # c: 5 tokens after b's two blocks (from the cache); d: a chunk of 9 of 20; e: no seat
    assert [s.seq_id for s in normal.seqs] == [0, 1, 2, 3] and normal.num_new == [1, 1, 5, 9]
    assert mixed.feed_rows == [0, 1] and mixed.num_fed == 2 and mixed.is_mixed_ahead
    assert [s.seq_id for s in mixed.seqs] == [0, 1, 2, 3] and mixed.num_new == normal.num_new
    assert mixed.slices == normal.slices and mixed.slices[2].context_len == 8
    assert mixed.input_ids == normal.input_ids[2:]  # the fed rows' ids are not on the host
    assert mixed.sample_steps == normal.sample_steps == [1, 1, 0, 0]
    assert mixed.forks == normal.forks == [] and not mixed.is_decode
    assert c.num_cached_tokens == 8 and sched.num_cached_blocks == ref.num_cached_blocks == 2
    assert sched.num_prefill_chunks == ref.num_prefill_chunks == 1
    assert alloc.num_free == ref.allocator.num_free
    assert [s.seq_id for s in sched.running] == [s.seq_id for s in ref.running]
    assert [s.seq_id for s in sched.waiting] == [s.seq_id for s in ref.waiting] == [4]
    sched.postprocess(running, [5, 6])
    for mine, theirs in ((mixed, [7, 8, 9, 0]), (normal, [7, 8, 9, 0])):
        assert [s.seq_id for s in sched.postprocess(mine, theirs)] == [0, 1, 2]  # d: mid-prompt
        sched, alloc = ref, ref.allocator
    got = [(s.tokens, s.num_computed, s.block_ids, s.block_hashes) for s in (a, b, c, d)]
    assert got == [(s.tokens, s.num_computed, s.block_ids, s.block_hashes) for s in ref.running]
    assert c.output_ids == [9] and d.num_computed == 9 and d.output_ids == []


def test_a_request_admitted_ahead_outlives_a_stop_in_the_running_step():
    """Steps in the loop's order (schedule ahead of a step, then postprocess it): a stop token
    frees a seat, the next step ahead admits a waiting request into it; a stop in the step that
    runs meanwhile only skips that sequence's fed row, the newcomer goes on (neither lost nor
    admitted twice), and an abort frees the blocks of one admitted in a step never read."""
    alloc = BlockAllocator(num_blocks=32, block_size=BLOCK)
    sched = Scheduler(alloc, max_num_seqs=2, max_num_tokens=16, max_model_len=64)
    a, b, c, d = make([[1] * 5, [2] * 3, [3] * 6, [4] * 7], 8)
    a.stop_ids, b.stop_ids = frozenset({9}), frozenset({5})
    for seq in (a, b, c, d):
        sched.add(seq)
    first = sched.schedule()  # a and b take both seats
    second = sched.schedule_ahead(first)
    assert second.seqs == [a, b] and not second.is_mixed_ahead  # no seat for c
    sched.postprocess(first, [9, 4])  # a stops: its row in ``second`` is wasted, its seat free
    third = sched.schedule_ahead(second)
    assert third.seqs == [b, c] and third.feed_rows == [1] and third.num_new == [1, 6]
    assert third.input_ids == [3] * 6 and third.sample_steps == [2, 0]
    sched.postprocess(second, [7, 5])  # b stops too, with ``third`` already queued
    assert a.output_ids == [9] and b.output_ids == [4, 5] and b.status is SeqStatus.FINISHED
    assert c.status is SeqStatus.RUNNING and sched.running == [c] and list(sched.waiting) == [d]
    fourth = sched.schedule_ahead(third)  # b's seat goes to d
    assert fourth.seqs == [c, d] and fourth.feed_rows == [1] and fourth.num_new == [1, 7]
    sched.postprocess(third, [6, 8])  # b's row skipped; c samples its first token
    assert b.output_ids == [4, 5] and c.output_ids == [8] and c.num_computed == 6
    assert sched.running == [c, d] and not sched.waiting and d.block_ids
    sched.abort_all()  # ``fourth`` is never read
    assert alloc.num_free == 32 and not d.block_ids and not sched.has_work()


def test_schedule_ahead_leaves_admissions_to_the_normal_step_when_it_must():
    """Requests that could join do not join ahead while a sequence of the running step finishes
    on length (its seat frees: the normal step fills it) or samples fork off in it (their first
    steps come first, as in ``schedule``); with nobody waiting, decode steps go on ahead."""
    for case in ("length", "fork"):
        alloc = BlockAllocator(num_blocks=32, block_size=BLOCK)
        sched = Scheduler(alloc, max_num_seqs=4, max_num_tokens=16, max_model_len=64)
        a, b, waiting = make([[1] * 5, [2] * 3, [3] * 4], 6)
        if case == "length":
            a.params = SamplingParams(max_new_tokens=1)
        else:
            b.children = [Sequence(9, 3, [2] * 3, b.params, 1, frozenset())]
        sched.add(a)
        sched.add(b)
        running = sched.schedule()
        assert running.seqs == [a, b] and bool(running.forks) == (case == "fork")
        ahead = probe_ahead(sched, running)
        assert ahead is not None and not ahead.is_mixed_ahead, case
        sched.add(waiting)
        assert sched.schedule_ahead(running) is None, case
        assert list(sched.waiting) == [waiting] and alloc.num_free == 32 - 3


def test_requests_admitted_in_steps_ahead_get_the_same_tokens_and_free_every_block():
    # 12 requests, 4 seats and 12 tokens a step: requests keep joining while others decode,
    # in mixed steps queued ahead; some stop on a stop token, some share a prompt prefix
    prefix = [7, 7, 8, 8, 9, 9, 1, 2]
    prompts = [[i + 1] * n for i, n in enumerate((9, 14, 5, 11, 7, 2))]
    prompts += [prefix + [40 + i] * i for i in range(1, 7)]
    stops = {expected(p, 12)[k] for p, k in zip(prompts, (2, 5, 11, 3, 1), strict=False)}
    lengths = (12, 3, 7, 12, 1, 9, 4, 8, 2, 12, 6, 5)
    for num_blocks in (64, 18):  # 18: preemption too
        results = []
        for overlapped in (False, True):
            alloc = BlockAllocator(num_blocks=num_blocks, block_size=BLOCK)
            sched = Scheduler(alloc, max_num_seqs=4, max_num_tokens=12, max_model_len=64)
            seqs = [
                Sequence(i, len(t), list(t), SamplingParams(max_new_tokens=n), 0, frozenset(stops))
                for i, (t, n) in enumerate(zip(prompts, lengths, strict=True))
            ]
            if overlapped:
                steps, ahead_steps, mixed_steps = run_overlapped(sched, seqs)
                assert mixed_steps >= 2 and ahead_steps > steps // 3, (steps, ahead_steps)
            else:
                run(sched, seqs)
            assert alloc.num_free == num_blocks
            results.append([(s.output_ids, s.finish_reason) for s in seqs])
            for seq, prompt, n in zip(seqs, prompts, lengths, strict=True):
                want = expected(prompt, n)
                cut = next((k + 1 for k, t in enumerate(want) if t in stops), n)
                assert seq.output_ids == want[:cut], (num_blocks, overlapped, seq.seq_id)
        assert results[0] == results[1]


def test_schedule_ahead_leaves_out_sequences_that_finish_on_length():
    alloc = BlockAllocator(num_blocks=16, block_size=BLOCK)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_tokens=16, max_model_len=64)
    seqs = [
        Sequence(i, 3, [i + 1] * 3, SamplingParams(max_new_tokens=n), 0, frozenset())
        for i, n in enumerate((1, 2, 5))
    ]
    for seq in seqs:
        sched.add(seq)
    batch = sched.schedule()  # the three prompts; each samples its first token
    ahead = sched.schedule_ahead(batch)
    assert ahead.feed_rows == [1, 2]  # request 0 is done after its first token
    sched.postprocess(batch, [7, 8, 9])
    following = sched.schedule_ahead(ahead)
    assert following.feed_rows == [1]  # request 1 is done after its second token
    assert following.sample_steps == [2]


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


def test_two_pass_greedy_ids_equal_argmax_including_ties_and_ragged_chunks():
    g = torch.Generator().manual_seed(0)
    for vocab, chunks in ((96, 128), (1000, 7), (1024, 128), (5, 1)):
        logits = torch.randn(7, vocab, generator=g)
        logits[1] = logits[1].round()  # many ties: the first maximum wins
        logits[2, :] = 3.0
        logits[3, -1] = 100.0  # the maximum in the last, padded chunk
        logits[4, 0] = 100.0
        logits[5] = float("-inf")
        logits[5, vocab // 2] = -1e30
        logits[6, vocab // 3 :] = float("nan")  # argmax's rule: the first NaN counts as the maximum
        for dtype in (torch.float32, torch.bfloat16):
            x = logits.to(dtype)
            assert torch.equal(greedy_ids(x, chunks), x.argmax(dim=-1)), (vocab, chunks, dtype)


def test_compiled_greedy_ids_equal_argmax():
    """Compiled (Inductor, dynamic rows) as in the engine's forward; an argmax-then-gather form of
    the first pass was miscompiled by torch 2.11's CPU Inductor (benchmarks/NOTES.md section 17)."""
    g = torch.Generator().manual_seed(1)
    compiled = torch.compile(greedy_ids, dynamic=True)
    for rows, vocab in ((3, 1000), (5, 128256)):
        logits = torch.randn(rows, vocab, generator=g)
        logits[0, :] = logits[0].round()  # ties: the first maximum wins
        assert torch.equal(compiled(logits), logits.argmax(dim=-1)), (rows, vocab)


def test_a_burst_of_requests_is_queued_ahead_through_its_chunked_admissions():
    # The benchmark's shape in small: more prompt tokens than one step's budget, so every step that
    # admits requests ends with a prompt cut mid-way. Its next chunk continues in the step queued
    # ahead (host ids after the fed rows): after the first step, every step is queued ahead.
    alloc = BlockAllocator(num_blocks=256, block_size=BLOCK)
    sched = Scheduler(alloc, max_num_seqs=16, max_num_tokens=40, max_model_len=64)
    prompts = [[100 + i] * 12 for i in range(16)]  # 192 prompt tokens: 5 steps of 40
    seqs = make(prompts, 20)
    steps, ahead, mixed = run_overlapped(sched, seqs)
    assert ahead == steps - 1 and mixed >= 4
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.status is SeqStatus.FINISHED and seq.output_ids == expected(prompt, 20)
    assert alloc.num_free == 256
