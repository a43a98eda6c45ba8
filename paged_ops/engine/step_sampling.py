"""One step's sampling as the engine runs it: rows from the scheduled batch, sampling and
log-probabilities on the device, and their copy to the host.

Rows: one per sequence of the step (``batch.seqs``), then one per sample forked off in this step
(``batch.forks``), which draws from its prompt's logits row with its own seed. Row ``i < S`` is
always ``batch.seqs[i]``'s, so a step scheduled ahead can feed those ids to the next step. In a
step scheduled ahead the fed rows come first (``batch.num_fed``): only they have a generated token
the host does not know yet (``batch.sample_steps`` and the penalties count it); rows of requests
admitted in it and forked samples have none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_ops.engine.params import TokenLogprob
from paged_ops.engine.sampler import SamplingBatch, host_to_device, sample, token_logprobs
from paged_ops.engine.scheduler import ScheduledBatch
from paged_ops.engine.scheduler import Sequence as Seq
from paged_ops.mapped_copy import copy_pinned


def sampling_rows(batch: ScheduledBatch) -> tuple[list[Seq], list[int], SamplingBatch]:
    """Each sampling row's sequence, the logits row it reads and its settings (host only)."""
    seqs = [*batch.seqs, *(child for _, child in batch.forks)]
    logits_rows = [*range(len(batch.seqs)), *(row for row, _ in batch.forks)]
    steps = [*batch.sample_steps, *[0] * len(batch.forks)]
    params = [s.params for s in seqs]
    rows = SamplingBatch(
        temperatures=[p.temperature for p in params],
        top_ks=[p.top_k for p in params],
        top_ps=[p.top_p for p in params],
        seeds=[s.seed for s in seqs],
        steps=steps,
    )
    if any(p.has_penalties for p in params):
        rows.repetition_penalties = [p.repetition_penalty for p in params]
        rows.presence_penalties = [p.presence_penalty for p in params]
        rows.frequency_penalties = [p.frequency_penalty for p in params]
        # a forked sample's history is its prompt's (it has generated nothing yet)
        rows.prompt_ids = [s.tokens[: s.prompt_len] if s.params.has_penalties else () for s in seqs]
        rows.output_ids = [
            s.output_ids if s.params.has_penalties and i < len(batch.seqs) else ()
            for i, s in enumerate(seqs)
        ]
    return seqs, logits_rows, rows


@dataclass
class StepSample:
    """What one step sampled: ids of every row and, for the rows that asked, log-probabilities.

    ``ids``: ``[R]`` int64; ``chosen``: ``[L]`` float32, ``top_ids``: ``[L, k]`` int64 and
    ``top_logprobs``: ``[L, k]`` float32 for the rows ``logprob_rows`` (``k`` the largest of their
    ``logprob_ks``). On the device after :func:`sample_step`, on the host after :meth:`to_host`.
    """

    ids: torch.Tensor
    logprob_rows: list[int]
    logprob_ks: list[int]
    chosen: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def to_host(self) -> StepSample:
        """A copy on the host, queued without waiting (pinned memory on CUDA: the caller waits
        on an event recorded after this before reading it, or dropping it: the ids' pinned
        buffer is written by a kernel, which the host allocator does not track)."""
        if self.ids.device.type == "cpu":
            return self

        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to("cpu", non_blocking=True)

        ids = torch.empty(self.ids.shape, dtype=self.ids.dtype, pin_memory=True)
        copy_pinned(ids, self.ids.contiguous())  # a kernel through the mapped address
        return StepSample(
            ids,
            self.logprob_rows,
            self.logprob_ks,
            copy(self.chosen),
            copy(self.top_ids),
            copy(self.top_logprobs),
        )

    def read(self) -> tuple[list[int], list[TokenLogprob | None] | None]:
        """(ids of every row, each row's :class:`TokenLogprob` or ``None``; ``None`` when no row
        asked for log-probabilities); host tensors only, once their copy is done."""
        ids = self.ids.tolist()
        if not self.logprob_rows:
            return ids, None
        assert self.chosen is not None and self.top_ids is not None
        assert self.top_logprobs is not None
        per_row: list[TokenLogprob | None] = [None] * len(ids)
        chosen, top_ids, top_lp = (
            self.chosen.tolist(),
            self.top_ids.tolist(),
            self.top_logprobs.tolist(),
        )
        for j, (row, k) in enumerate(zip(self.logprob_rows, self.logprob_ks, strict=True)):
            top = list(zip(top_ids[j][:k], top_lp[j][:k], strict=True))
            per_row[row] = TokenLogprob(ids[row], chosen[j], top)
        return ids, per_row


def sample_step(
    logits: torch.Tensor,
    greedy: torch.Tensor,
    batch: ScheduledBatch,
    fed_from: torch.Tensor | None,
) -> StepSample:
    """Sample every row of ``batch`` on the device; nothing here waits for the device.

    Args:
        logits: ``[S, V]`` of the step's sequences; greedy: ``[S]`` int64, their argmax.
        fed_from: ``[S_prev]`` int64 ids of the previous step when ``batch`` was scheduled ahead
            (each fed row's generated token that the host does not know yet, for penalties).
    """
    if not batch.forks and not any([s.params.needs_sampler for s in batch.seqs]):
        return StepSample(greedy, [], [])  # the common case stays one cheap pass
    seqs, logits_rows, rows = sampling_rows(batch)
    if batch.forks:  # forked samples draw from their prompt's logits row
        index = host_to_device(logits_rows, torch.int64, logits.device)  # [R]
        logits, greedy = logits.index_select(0, index), greedy.index_select(0, index)
    if rows.all_greedy and rows.repetition_penalties is None:
        ids = greedy  # the forward's argmax is the sample
    else:
        pending = None
        if batch.feed_rows is not None and rows.repetition_penalties is not None:
            feed = host_to_device(batch.feed_rows, torch.int64, logits.device)  # [F]
            pending = fed_from.index_select(0, feed) if fed_from is not None else None  # [F]
        ids = sample(logits, rows, greedy, pending)  # [R]
    wanted = [(r, s.params.logprobs) for r, s in enumerate(seqs) if s.params.logprobs is not None]
    if not wanted:
        return StepSample(ids, [], [])
    lp_rows, ks = [r for r, _ in wanted], [k for _, k in wanted]
    index = host_to_device(lp_rows, torch.int64, logits.device)  # [L]
    chosen, top_ids, top_lp = token_logprobs(
        logits.index_select(0, index), ids.index_select(0, index), max(ks)
    )
    return StepSample(ids, lp_rows, ks, chosen, top_ids, top_lp)
