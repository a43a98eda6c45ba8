"""Continuous batching: which sequences run in a step, with how many tokens, in which KV blocks.

Each step has a token budget (``max_num_tokens``) and a seat limit (``max_num_seqs``). Running
sequences go first, oldest first: a decoding one adds its last token, one still in its prompt adds
the next chunk that fits the budget (chunked prefill, mixed with the decodes). Waiting sequences
join in arrival order while budget, seats and blocks last; finished ones leave after every step.

When the KV blocks run out, the newest running sequence is preempted: its blocks are freed and it
goes back to the front of the queue with everything it has generated, to be recomputed (prompt +
generated tokens re-prefilled) later. No request is lost or cut short.

Prefix caching: once a block is full, it is registered with the allocator under a hash chained over
the previous block's hash and this block's token ids (so equal hashes mean equal whole prefixes).
A sequence that joins looks its full blocks up and shares the hits instead of recomputing them; it
always keeps at least one token to compute, so the step has logits to sample from. Blocks filled by
generated tokens are registered as well, which makes a preempted sequence's recompute cheap.

Several samples of one prompt (``SamplingParams.n``): the request enters as its first sample, which
carries the others (``Sequence.children``) and reserves seats for them. The step that completes
its prompt samples a first token for every sample from the same logits (``ScheduledBatch.forks``),
and :meth:`Scheduler.postprocess` forks the others off: each shares the prompt's full blocks
(one more reference each in the allocator, never recomputed) and recomputes only the tokens of the
last, partial prompt block into a block of its own, together with its first token, in its next
step; a prompt that ends on a block boundary shares every block. From there each sample is a
sequence of its own (preempted and recomputed alone, finishing alone). This needs neither the
prefix cache nor a device-side block copy.

Overlapped decode (:meth:`Scheduler.schedule_ahead`): while a step runs on the device, the next
decode step of the same sequences can be scheduled before the step's sampled tokens are known. Its
input ids are those sampled tokens, fed on the device; each sequence is one token "pending" until
the running step is postprocessed. A sequence that then stops on a stop token had one wasted row in
the step ahead, which :meth:`Scheduler.postprocess` skips. When waiting requests could join, the
step ahead is a mixed one: the fed decode rows first, then the requests admitted as the normal step
after would admit them (their prompt chunks' ids are known on the host), so that the steps that
start requests in a busy run are overlapped too. Seats that a stop token frees in the running step
are not known yet: the next normal step fills them.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from paged_ops.cache import BlockAllocator, blocks_needed
from paged_ops.engine.params import SamplingParams, TokenLogprob
from paged_ops.engine.stop import StopStrings
from paged_ops.metadata import SequenceSlice


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request as the engine tracks it (host side only)."""

    seq_id: int  # arrival order: higher is newer
    prompt_len: int
    tokens: list[int]  # prompt + generated so far
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    num_computed: int = 0  # leading tokens whose K/V is in the cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hash per registered full block
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    # Speculative decoding: draft tokens this sequence asks to verify in its next decode step
    # (set by the LLM's speculator before ``schedule``; 0 = a plain decode step), and the
    # speculator's per-request state (``None`` without speculation).
    num_draft: int = 0
    spec: Any = None
    index: int = 0  # which sample of its request (SamplingParams.n)
    children: list[Sequence] = field(default_factory=list)  # samples forked off after the prompt
    logprobs: list[TokenLogprob] | None = None  # one per generated token (SamplingParams.logprobs)
    stop_strings: StopStrings | None = None  # SamplingParams.stop

    @property
    def num_seats(self) -> int:
        """Seats the sequence takes when it joins: its own and its samples' to be forked."""
        return 1 + len(self.children)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass
class ScheduledBatch:
    """One step: the sequences, their slices for ``prepare_slices`` and the packed new tokens."""

    seqs: list[Sequence]
    num_new: list[int]
    slices: list[SequenceSlice]
    # [T - F] the new tokens of the rows not fed from the device (all rows but the first F =
    # num_fed), sequence-major: every new token of a normal step, none of a decode step ahead,
    # the admitted requests' prompt chunks of a mixed step ahead
    input_ids: list[int]
    # Scheduled ahead: row i < F = len(feed_rows) is a decode row whose input id is row
    # feed_rows[i] of the previous step's sampled ids, still on the device (its sequence has that
    # one token not yet appended). The rows after them, if any, are requests admitted in this
    # step (a mixed step), whose ids are known on the host (input_ids).
    feed_rows: list[int] | None = None
    # Speculative decoding: row i verifies num_draft[i] draft tokens (its new tokens are its last
    # known token followed by the drafts, which the speculator writes into ``input_ids``); the
    # step then needs logits at every new token of such a row. ``None``: no row verifies.
    num_draft: list[int] | None = None

    @property
    def is_verify(self) -> bool:
        return self.num_draft is not None

    @property
    def logit_rows(self) -> list[int]:
        """Packed-token index of every row that needs logits: each sequence's last new token,
        and every new token of a sequence that verifies drafts (sequence-major)."""
        rows, start = [], 0
        for i, n in enumerate(self.num_new):
            if self.num_draft is not None and self.num_draft[i]:
                rows.extend(range(start, start + n))
            else:
                rows.append(start + n - 1)
            start += n
        return rows

    # Samples forked off when their prompt completes in this step: (row of the prompt's sequence,
    # forked sample). The step samples one token per row of seqs, then one per fork, in order.
    forks: list[tuple[int, Sequence]] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.num_new)

    @property
    def num_fed(self) -> int:
        """Leading rows whose input id comes from the previous step's sampled ids (F)."""
        return 0 if self.feed_rows is None else len(self.feed_rows)

    @property
    def is_mixed_ahead(self) -> bool:
        """Scheduled ahead with rows whose ids come from the host: prompt chunks that continue
        a prompt the step before left mid-way, or requests admitted in it."""
        return self.feed_rows is not None and len(self.feed_rows) < len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    @property
    def sample_steps(self) -> list[int]:
        """Index among its generated tokens of the token each logits row samples in this step
        (one row per sequence, ``k + 1`` for a sequence verifying ``k`` drafts). A fed row's
        sequence has one generated token more than it holds yet (the pending one); a row admitted
        in a step ahead has none pending."""
        if self.num_draft is None:  # (a verify step is never scheduled ahead)
            fed = self.num_fed
            return [s.num_generated + (i < fed) for i, s in enumerate(self.seqs)]
        return [
            s.num_generated + j
            for s, k in zip(self.seqs, self.num_draft, strict=True)
            for j in range(k + 1 if k else 1)
        ]


class Scheduler:
    """Owns the block allocator's bookkeeping for every sequence and picks each step's batch.

    Args:
        allocator: the KV block allocator (of the model's PagedAttention).
        max_num_seqs: most sequences in one step.
        max_num_tokens: token budget of one step (>= max_num_seqs, so every decode fits).
        max_model_len: longest sequence, prompt + generated.
        prefix_caching: share full blocks between sequences with a common prefix.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_num_seqs: int,
        max_num_tokens: int,
        max_model_len: int,
        prefix_caching: bool = True,
    ) -> None:
        if max_num_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_tokens ({max_num_tokens}) must be >= max_num_seqs ({max_num_seqs})"
            )
        self.allocator, self.block_size = allocator, allocator.block_size
        self.max_num_seqs, self.max_num_tokens = max_num_seqs, max_num_tokens
        self.max_model_len, self.prefix_caching = max_model_len, prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by seq_id: oldest first
        self.num_preemptions = 0
        self.num_cached_blocks = 0
        self.num_prefill_chunks = 0  # prompt chunks that stopped short of the end of the prompt

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise ``ValueError`` for a request that could never run, before any work starts."""
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"prompt has {prompt_len} tokens; max_model_len={self.max_model_len} leaves room "
                f"for prompts of at most {self.max_model_len - 1} tokens"
            )
        longest = min(prompt_len + params.max_new_tokens, self.max_model_len)
        if blocks_needed(longest, self.block_size) > self.allocator.num_blocks:
            raise ValueError(
                f"a request of {longest} tokens needs {blocks_needed(longest, self.block_size)} KV "
                f"blocks but the cache has {self.allocator.num_blocks}; raise num_blocks"
            )

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_all(self) -> None:
        """Drop every unfinished sequence and free its blocks (a stream closed early)."""
        for seq in [*self.running, *self.waiting]:
            self._drop_blocks(seq)
            seq.status = SeqStatus.FINISHED
        self.running.clear()
        self.waiting.clear()

    # ---- one step ----

    def schedule(self) -> ScheduledBatch:
        """Pick the next step's sequences and give them the blocks their new tokens need."""
        budget = self.max_num_tokens
        picked: list[tuple[Sequence, int]] = []
        drafts: dict[int, int] = {}  # index in picked -> draft tokens it verifies
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq.tokens) - seq.num_computed, budget)
            need = blocks_needed(seq.num_computed + n, self.block_size) - len(seq.block_ids)
            while not self.allocator.can_allocate(need):
                victim = self.running[-1]  # the newest; never one already picked (those are < i)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            seq.block_ids += self.allocator.allocate(need)
            k = self._draft_room(seq, n, budget)
            if k:  # the drafts' blocks come only from free ones: speculation never preempts
                drafts[len(picked)] = k
                n += k
                seq.block_ids += self.allocator.allocate(
                    blocks_needed(seq.num_computed + n, self.block_size) - len(seq.block_ids)
                )
            picked.append((seq, n))
            budget -= n
            i += 1
        # Newcomers join only when nobody had to be preempted (else they would evict each other).
        if not preempted:
            picked += self._admit(budget)
        slices, input_ids, forks = self._host_rows(
            [(seq, seq.num_computed, n) for seq, n in picked], drafts
        )
        return ScheduledBatch(
            seqs=[s for s, _ in picked],
            num_new=[n for _, n in picked],
            slices=slices,
            input_ids=input_ids,
            forks=forks,
            num_draft=[drafts.get(j, 0) for j in range(len(picked))] if drafts else None,
        )

    def _admit(self, budget: int) -> list[tuple[Sequence, int]]:
        """Let waiting requests join, in arrival order, while seats, ``budget`` tokens and free
        blocks last (never preempting): each takes its cached prefix (prefix caching) and the
        blocks of its first prompt chunk, and becomes running. Returns (sequence, chunk tokens)
        of each; used by :meth:`schedule` and by a mixed step of :meth:`schedule_ahead`."""
        joined: list[tuple[Sequence, int]] = []
        seats = self._seats_taken() if self.waiting else 0
        while self.waiting and budget > 0:
            if seats + self.waiting[0].num_seats > self.max_num_seqs:
                break
            seq = self.waiting[0]
            if not seq.block_ids and self.prefix_caching:
                self._attach_cached_prefix(seq)
            n = min(len(seq.tokens) - seq.num_computed, budget)
            need = blocks_needed(seq.num_computed + n, self.block_size) - len(seq.block_ids)
            if not self.allocator.can_allocate(need):
                self._drop_blocks(seq)
                break
            seq.block_ids += self.allocator.allocate(need)
            seq.num_cached_tokens += seq.num_computed  # what the prefix cache gave
            self.num_cached_blocks += seq.num_computed // self.block_size
            self.waiting.popleft()
            seats += seq.num_seats
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)
            joined.append((seq, n))
            budget -= n
        return joined

    def _host_rows(
        self,
        picked: list[tuple[Sequence, int, int]],
        drafts: dict[int, int],
        first_row: int = 0,
    ) -> tuple[list[SequenceSlice], list[int], list[tuple[int, Sequence]]]:
        """Slices, packed input ids and forks of rows whose new tokens the host knows: ``picked``
        (sequence, position of its first new token, new tokens) are the step's rows
        ``first_row``, ``first_row + 1``, ...; ``drafts`` maps an index in ``picked`` to the
        drafts that row verifies (their ids are written later by the speculator). Counts the
        prompt chunks that stop short of the prompt's end."""
        slices, input_ids, forks = [], [], []
        for j, (seq, start, n) in enumerate(picked):
            k = drafts.get(j, 0)
            self.num_prefill_chunks += start + n - k < len(seq.tokens)
            slices.append(SequenceSlice(seq.block_ids, start, n))
            input_ids.extend(seq.tokens[start : start + n - k])
            input_ids.extend([0] * k)  # the drafts, written by the speculator
            if seq.children and start + n == len(seq.tokens):
                forks += [(first_row + j, child) for child in seq.children]
        return slices, input_ids, forks

    def _draft_room(self, seq: Sequence, n: int, budget: int) -> int:
        """Draft rows ``seq`` verifies in this step: what it asked for (``seq.num_draft``), if it
        is decoding and budget, model length and free blocks allow; else 0. Rows past what the
        request may still generate stay (the speculator verifies padding there), so that a step
        near the requests' length limits keeps the target-verify graphs' shape."""
        k = seq.num_draft
        if not k or n != 1 or seq.num_computed + 1 != len(seq.tokens):
            return 0
        # the last draft row sits at position len(tokens) + k - 1 < max_model_len
        k = min(k, budget - 1, self.max_model_len - len(seq.tokens) - 1)
        if k <= 0:
            return 0
        more = blocks_needed(len(seq.tokens) + k, self.block_size) - len(seq.block_ids)
        return k if self.allocator.can_allocate(more) else 0

    def schedule_ahead(self, running: ScheduledBatch) -> ScheduledBatch | None:
        """Schedule the step that follows ``running`` before its sampled tokens are known.

        Every sequence of ``running`` that will get a token from it and can go on adds that token
        (fed from the device, see ``ScheduledBatch.feed_rows``); ``running``'s sequences that
        finish on length are left out, they need no further step. A sequence that ``running``
        left mid-prompt continues with its next chunk (the budget the fed rows leave; its ids
        are the prompt's, known on the host). When the first waiting request could join (a seat
        and the blocks of its first prompt chunk are free beside the new tokens' blocks, as
        ``schedule`` would find them after ``running``), waiting requests join behind those rows
        as that ``schedule`` would admit them (:meth:`_admit`: the token budget left, seats, free
        blocks, the prefix cache with the blocks ``running`` fills): a mixed step, whose rows
        after the fed ones take their ids from the host. Seats that ``running``'s stop
        tokens free are not known yet: the next normal step fills them. A request that could not
        join (every seat taken, or too few free blocks, as under KV pressure) does not stop steps
        from being queued ahead: it joins in the first normal step after blocks free up. Returns
        ``None`` (schedule normally after ``running`` is postprocessed) when

        - a running sequence is not in ``running``, or a prompt left mid-way gets no budget (the
          step's token budget ran out before it: only a normal step gives it its turn);
        - a request waits while a seat frees as a sequence of ``running`` finishes on length (the
          normal step gives it that seat), or a request could join while ``running`` forks
          samples off (their first steps come before newcomers, as in ``schedule``);
        - the new tokens' blocks are not free without preempting (this never preempts).
        """
        if running.is_verify:
            return None  # how many tokens each sequence gets is known only once it is read
        live = SeqStatus.RUNNING  # bound once: the loops below run for every row of every step
        if sum([s.status is live for s in running.seqs]) != len(self.running):
            return None
        rows: list[int] = []
        starts: list[int] = []  # position of each row's new token
        chunked: list[tuple[Sequence, int]] = []  # mid-prompt sequences: (seq, next position)
        reaches_length = self._reaches_length
        for i, (seq, n) in enumerate(zip(running.seqs, running.num_new, strict=True)):
            if seq.status is not live:
                continue  # finished on a stop token in the step before ``running``
            # The step before ``running`` has been postprocessed, so ``seq.tokens`` holds every
            # token but the one ``running`` samples, which goes at position ``pending``.
            pending = seq.num_computed + n
            if pending != len(seq.tokens):
                chunked.append((seq, pending))  # a prompt chunk short of the prompt's end
                continue
            if reaches_length(seq, pending + 1):  # with ``running``'s sample appended
                if self.waiting:
                    return None  # its seat frees: let a waiting request take it in a normal step
                continue  # finishes on length with ``running``'s token
            rows.append(i)
            starts.append(pending)
        if not rows and not chunked:
            return None
        seqs = [running.seqs[i] for i in rows]
        needs = [
            blocks_needed(p + 1, self.block_size) - len(s.block_ids)
            for s, p in zip(seqs, starts, strict=True)
        ]
        budget = self.max_num_tokens - len(rows)
        # The next chunk of each prompt ``running`` left mid-way (its ids are the prompt's, known
        # here), with the budget the decode rows leave, in ``running``'s order.
        continued: list[tuple[Sequence, int, int]] = []  # (seq, first position, tokens)
        for seq, p in chunked:
            if budget <= 0:
                return None  # it gets no turn: only a normal step gives it one
            n = min(len(seq.tokens) - p, budget)
            continued.append((seq, p, n))
            budget -= n
        chunk_needs = [blocks_needed(p + n, self.block_size) - len(s.block_ids)
                       for s, p, n in continued]  # fmt: skip
        if not self.allocator.can_allocate(sum(needs) + sum(chunk_needs)):
            return None
        if self.waiting and self.prefix_caching:
            # What ``running`` computes is known here (every token before ``pending``): register
            # the blocks it fills now, as its postprocess would, so that a newcomer finds them.
            # Their K/V is written by ``running``, queued on the device before any step that
            # could read them.
            for seq, p in [*zip(seqs, starts, strict=True), *chunked]:
                self._register_full_blocks(seq, p)
        joins = bool(self.waiting) and self._could_join(
            self.waiting[0], self.allocator.num_free - sum(needs) - sum(chunk_needs), budget
        )
        if joins and running.forks:
            return None
        for seq, need in zip([*seqs, *(s for s, _, _ in continued)], needs + chunk_needs,
                             strict=True):  # fmt: skip
            if need:
                seq.block_ids += self.allocator.allocate(need)
        # rows after the fed ones: the prompts' next chunks, then the requests admitted now
        joined = self._admit(budget) if joins else []
        host = continued + [(s, s.num_computed, n) for s, n in joined]
        slices, input_ids, forks = self._host_rows(host, {}, first_row=len(rows))
        return ScheduledBatch(
            seqs=seqs + [s for s, _, _ in host],
            num_new=[1] * len(seqs) + [n for _, _, n in host],
            slices=[SequenceSlice(s.block_ids, p, 1) for s, p in zip(seqs, starts, strict=True)]
            + slices,
            input_ids=input_ids,
            feed_rows=rows,
            forks=forks,
        )

    def postprocess(
        self,
        batch: ScheduledBatch,
        sampled: list[int],
        logprobs: list[TokenLogprob | None] | None = None,
        accepted: list[list[int]] | None = None,
    ) -> list[Sequence]:
        """Account for a step that ran: append sampled tokens, fork samples, finish and free.

        ``sampled[i]`` is the token drawn for ``batch.seqs[i]``, then one per ``batch.forks``
        entry; it is dropped for a sequence whose step was a prompt chunk that did not reach the
        end of its known tokens, and for one that already finished (a step scheduled ahead, see
        :meth:`schedule_ahead`). ``logprobs``, when given, has an entry per entry of ``sampled``,
        appended to ``Sequence.logprobs`` with the token. For a step that verified drafts,
        ``accepted[i]`` are the drafts row ``i`` accepted: they come before ``sampled[i]``, the
        rejected drafts' KV is rolled back (the sequence's computed length stops after the
        accepted ones, so their slots are rewritten later) and blocks past what the sequence now
        needs are freed; stop tokens and length limits apply token by token (speculation never
        runs a step with logprobs or forks). Steps must be postprocessed in the order they were
        scheduled. Returns the sequences that got a new token (forked samples included).
        """
        rows = len(batch.seqs)
        if len(sampled) != rows + len(batch.forks):
            raise ValueError(
                f"{len(sampled)} sampled ids for {rows} rows + {len(batch.forks)} forks"
            )
        extra: list[Any] = list(logprobs) if logprobs is not None else [None] * len(sampled)
        advanced: list[Sequence] = []
        finishing: list[tuple[Sequence, str]] = []
        # This loop runs for every row of every step (256 rows: ~1 ms of host time on a slow
        # core), so the usual row (no drafts: one sampled token) takes the short path and the
        # per-row lookups are bound once.
        running, drafts, finish_reason = SeqStatus.RUNNING, batch.num_draft, self._finish_reason
        register = self._register_full_blocks if self.prefix_caching else None
        block = self.block_size
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new, strict=True)):
            if seq.status is not running:
                continue  # stopped in the previous step; this row was scheduled ahead of that
            kept = None  # the drafts a verify row accepted
            if drafts is not None and drafts[i] > 0:
                kept = accepted[i] if accepted is not None else []
                n = len(kept) + 1  # the last known token and the accepted drafts: KV kept
            seq.num_computed += n
            if register is not None and seq.num_computed // block > len(seq.block_hashes):
                register(seq)  # a block filled up (every block_size-th step of a decode row)
            if seq.num_computed < len(seq.tokens):
                continue  # a prompt chunk: more of the prompt to go before sampling
            if kept is None:
                _append(seq, sampled[i], extra[i])
                reason = finish_reason(seq)
            else:
                reason = None
                for token, logprob in zip([*kept, sampled[i]], [*[None] * len(kept), extra[i]],
                                          strict=True):  # fmt: skip
                    _append(seq, token, logprob)
                    reason = finish_reason(seq)
                    if reason is not None:
                        break  # drafts accepted after a stop token are dropped
            advanced.append(seq)
            if reason is not None:
                finishing.append((seq, reason))
            elif kept is not None:
                self._trim_blocks(seq)
        for j, (row, child) in enumerate(batch.forks):  # before a finished parent frees blocks
            self._fork(batch.seqs[row], child)
            _append(child, sampled[rows + j], extra[rows + j])
            advanced.append(child)
            reason = self._finish_reason(child)
            if reason is not None:
                finishing.append((child, reason))
        for seq, reason in finishing:
            self.finish(seq, reason)
        return advanced

    def _finish_reason(self, seq: Sequence) -> str | None:
        """ "stop" when the last token is a stop token, "length" at a length limit, else None."""
        if seq.tokens[-1] in seq.stop_ids:
            return "stop"
        return "length" if self._reaches_length(seq, len(seq.tokens)) else None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` now with ``finish_reason = reason``: it leaves the running set and its
        blocks go back to the allocator at once. A sequence that already finished takes the new
        reason (e.g. a stop string completed by the token that reached the length limit)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._drop_blocks(seq)
        seq.finish_reason, seq.status = reason, SeqStatus.FINISHED

    def _trim_blocks(self, seq: Sequence) -> None:
        """Free the blocks a verify step reserved past what the sequence's tokens need."""
        keep = blocks_needed(len(seq.tokens), self.block_size)
        if len(seq.block_ids) > keep:
            self.allocator.free(seq.block_ids[keep:])
            del seq.block_ids[keep:]

    # ---- helpers ----

    def _could_join(self, seq: Sequence, free: int, budget: int) -> bool:
        """Whether ``schedule`` would let waiting ``seq`` join with ``free`` blocks left beside
        the running sequences' and ``budget`` tokens of the step left (changes nothing)."""
        if self._seats_taken() + seq.num_seats > self.max_num_seqs:
            return False
        held, revived = len(seq.block_ids), 0  # blocks it would hold; cached ones now free
        if not seq.block_ids and self.prefix_caching:  # what _attach_cached_prefix would find
            prev = None
            for j in range((len(seq.tokens) - 1) // self.block_size):
                prev = self._block_hash(seq, j, prev)
                block = self.allocator.prefix_block(prev)
                if block is None:
                    break
                held += 1
                revived += self.allocator.ref_counts[block] == 0
        computed = held * self.block_size if not seq.block_ids else seq.num_computed
        n = min(len(seq.tokens) - computed, budget)
        return blocks_needed(computed + n, self.block_size) - held <= free - revived

    def _seats_taken(self) -> int:
        """Running sequences and the samples they will fork off (those have their seats)."""
        return len(self.running) + sum([len(s.children) for s in self.running])

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """Start sample ``child`` of ``parent``'s request, whose prompt just completed: it shares
        the prompt's full blocks and recomputes the last, partial block's tokens itself."""
        parent.children.remove(child)
        full = parent.prompt_len // self.block_size
        shared = parent.block_ids[:full]
        self.allocator.share(shared)
        child.tokens = parent.tokens[: parent.prompt_len]
        child.block_ids, child.block_hashes = list(shared), parent.block_hashes[:full]
        child.num_computed = full * self.block_size
        child.status = SeqStatus.RUNNING
        bisect.insort(self.running, child, key=lambda s: s.seq_id)

    def _reaches_length(self, seq: Sequence, length: int) -> bool:
        """Whether ``seq`` is done on length once it holds ``length`` tokens."""
        return length - seq.prompt_len >= seq.params.max_new_tokens or length >= self.max_model_len

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and queue it first for recompute (prompt + generated)."""
        self.running.remove(seq)
        self._drop_blocks(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _drop_blocks(self, seq: Sequence) -> None:
        # Registered blocks keep their hashes on the free list: a later lookup can revive them.
        self.allocator.free(seq.block_ids)
        seq.block_ids, seq.block_hashes, seq.num_computed = [], [], 0
        if seq.spec is not None:
            seq.spec.blocks_dropped()  # a draft model's KV in those blocks is gone too

    def _block_hash(self, seq: Sequence, j: int, prev: int | None = None) -> int:
        """Hash of ``seq``'s block ``j`` chained on the hash of block ``j - 1`` (``prev``; by
        default the one ``seq`` registered)."""
        if prev is None and j:
            prev = seq.block_hashes[j - 1]
        return hash((prev, tuple(seq.tokens[j * self.block_size : (j + 1) * self.block_size])))

    def _attach_cached_prefix(self, seq: Sequence) -> None:
        # Leave at least one token to compute so that the step produces logits for this sequence.
        for j in range((len(seq.tokens) - 1) // self.block_size):
            h = self._block_hash(seq, j)
            block = self.allocator.lookup_prefix(h)  # takes a reference on a hit
            if block is None:
                break
            seq.block_ids.append(block)
            seq.block_hashes.append(h)
        seq.num_computed = len(seq.block_ids) * self.block_size

    def _register_full_blocks(self, seq: Sequence, computed: int | None = None) -> None:
        """Register the full blocks among ``seq``'s first ``computed`` tokens (default: its
        computed ones) that are not registered yet."""
        full = (seq.num_computed if computed is None else computed) // self.block_size
        while len(seq.block_hashes) < full:
            j = len(seq.block_hashes)
            h = self._block_hash(seq, j)
            self.allocator.register_prefix(seq.block_ids[j], h)
            seq.block_hashes.append(h)


def _append(seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
    seq.tokens.append(token)
    if seq.logprobs is not None:
        assert logprob is not None, "a sequence with logprobs got a token without"
        seq.logprobs.append(logprob)
