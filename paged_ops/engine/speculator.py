"""The LLM's side of speculative decoding: which requests draft, the drafts, and their verdicts.

Per step (no overlap while any request speculates: how many tokens a verify step gives each
sequence is known only once its result is read; :meth:`Speculator.may_draft` tells the LLM
whether the next step may verify, :meth:`Speculator.count_step` counts every step launched):

1. :meth:`Speculator.plan` sets ``Sequence.num_draft`` for the running requests that may speculate
   (decoding, not backed off, no penalties, the step at most ``disable_by_batch_size`` sequences).
   With n-grams, every candidate looks its drafts up now; when nobody finds one, nobody speculates
   (and they pause for a token, or for a few after two lookups in a row found nothing). Otherwise
   every decoding sequence of the step verifies ``k`` rows, those with fewer real drafts (or none:
   backed off, penalties, fewer tokens left before ``max_new_tokens``) padded, so that the step's
   shape is one of the target-verify CUDA graphs; padding is never accepted, and a sequence without
   real drafts gets exactly the token a plain decode step would give it.
2. The scheduler gives the verifying sequences ``k + 1`` new tokens (blocks permitting).
3. :meth:`Speculator.fill` writes the drafts into the step's input ids (a draft model proposes them
   here) and returns what :func:`~paged_ops.engine.rejection.verify` needs per logits row.
4. :meth:`Speculator.resolve` turns the verify step's ``[3, R]`` result into the accepted drafts
   and the next token of each sequence, and keeps each request's back-off;
   :meth:`Speculator.postprocessed` counts the accepted drafts that the sequences kept.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

from paged_ops.engine.draft import DraftModel
from paged_ops.engine.sampler import SamplingBatch
from paged_ops.engine.scheduler import ScheduledBatch
from paged_ops.engine.scheduler import Sequence as Seq
from paged_ops.engine.speculative import (
    FIRST_PAUSE,
    NgramProposer,
    SpecMetrics,
    SpecState,
    SpeculativeConfig,
    accept_drafts,
    spec_eligible,
)

_NO_MATCH_PAUSE = 8  # generated tokens before an n-gram lookup is tried again after two in a row
# found nothing (while a request waits, its steps can be scheduled ahead). After a lookup that found
# drafts, one that finds nothing is tried again at the next token: the token the target put in
# place of a rejected draft is often one that occurs nowhere earlier, while the token after it
# does (the cost is one step without overlap, against up to 8 steps without drafts).
_PROBE_EVERY = 16  # a request that backed off probes again only on every 16th step of the LLM
# (every step launched counts, scheduled ahead or not), so that the probes of a batch's requests
# share verify steps (each slower than a decode step) instead of each making its own.


class Speculator:
    """Drafting and verification bookkeeping for one LLM.

    Args:
        config: the speculative decoding settings.
        draft: the patched draft model (``method="draft"``), else ``None``.
    """

    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None) -> None:
        self.config, self.draft, self.k = config, draft, config.num_tokens
        self.metrics = SpecMetrics()
        self._real: dict[int, list[int]] = {}  # row of the step being verified -> its real drafts
        # per sequence of the step being verified that drafted: its token count before the step
        # and the drafts it accepted (fewer are kept where it stops)
        self._kept: list[tuple[Seq, int, int]] = []
        self._launched = 0  # steps launched so far (planned here or scheduled ahead)

    def _state(self, seq: Seq) -> SpecState:
        if seq.spec is None:
            cfg = self.config
            proposer = (
                NgramProposer(cfg.ngram_min, cfg.ngram_max) if cfg.method == "ngram" else None
            )
            seq.spec = SpecState(proposer=proposer, first_pause=FIRST_PAUSE[cfg.method])
        return seq.spec

    def count_step(self) -> None:
        """Called by the LLM for every step it launches (planned or scheduled ahead)."""
        self._launched += 1

    def _next_is_probe_step(self) -> bool:
        """Whether the next step launched is one where backed-off requests may probe."""
        return (self._launched + 1) % _PROBE_EVERY == 0

    def plan(self, running: list[Seq], waiting: Iterable[Seq] = ()) -> bool:
        """Set ``num_draft`` of every running sequence for the next step; whether any drafts.
        ``waiting``: the requests that may join the step (none may need a plain step)."""
        for seq in running:
            seq.num_draft = 0
            state = self._state(seq)
            state.drafts, state.drafting = [], False
        if not self._may_verify(itertools.chain(running, waiting), len(running)):
            return False
        decoding = [seq for seq in running if seq.num_computed + 1 == len(seq.tokens)]
        probe_step = self._next_is_probe_step()
        candidates = [
            seq
            for seq in decoding
            if _due(seq.spec, seq.num_generated, probe_step) and _room(seq) > 0
        ]
        if not candidates:
            return False
        if self.config.method == "ngram":
            for seq in candidates:
                seq.spec.drafts = seq.spec.proposer.propose(seq.tokens, self.k)
            if not any(seq.spec.drafts for seq in candidates):
                for seq in candidates:
                    state = seq.spec
                    state.off_until = seq.num_generated + (_NO_MATCH_PAUSE if state.missed else 1)
                    state.missed = True
                return False
            for seq in candidates:
                seq.spec.missed = not seq.spec.drafts
        for seq in candidates:
            seq.spec.drafting = True
        for seq in decoding:  # the others verify padding: one graph shape for the step
            seq.num_draft = self.k
        return True

    def may_draft(self, running: list[Seq]) -> bool:
        """Whether the next step could verify drafts (then no step is scheduled ahead), by
        :meth:`plan`'s rule, while the step before it runs (it gives each sequence a token)."""
        if not self._may_verify(running, len(running)):
            return False
        probe_step = self._next_is_probe_step()
        return any(
            _room(seq) > 1
            and (seq.spec is None or _due(seq.spec, seq.num_generated + 1, probe_step))
            for seq in running
        )

    def _may_verify(self, seqs: Iterable[Seq], num_running: int) -> bool:
        """A step may verify drafts: few enough running sequences, and none of ``seqs`` needs a
        plain step (logprobs, penalties or samples to fork)."""
        return num_running <= self.config.disable_by_batch_size and all(map(spec_eligible, seqs))

    def fill(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor | None]:
        """Write the drafts of ``batch``'s verifying rows into ``batch.input_ids``.

        Returns:
            per logits row (``batch.logit_rows``), the draft token that follows it (``-1``: none
            or padding), and the draft distributions per row ``[R, V]`` float32 (a draft model
            that samples; ``None`` for point-mass or greedy drafts).
        """
        assert batch.num_draft is not None
        starts = list(itertools.accumulate(batch.num_new, initial=0))
        verifying = [i for i, k in enumerate(batch.num_draft) if k]
        self._real = {}
        probs_of: dict[int, torch.Tensor] = {}  # row -> [k, V]
        if self.draft is None:
            for i in verifying:
                seq = batch.seqs[i]
                self._real[i] = seq.spec.drafts[: min(batch.num_draft[i], _room(seq))]
        else:
            by_k: dict[int, list[int]] = {}
            for i in verifying:
                if not batch.seqs[i].spec.drafting:
                    self._real[i] = []  # padding only
                    continue
                by_k.setdefault(batch.num_draft[i], []).append(i)
            for k, rows in by_k.items():  # one proposal loop per draft length (usually one)
                seqs = [batch.seqs[i] for i in rows]
                settings = _settings(seqs, [s.num_generated for s in seqs])
                drafts, probs = self.draft.propose(seqs, k, settings)  # [S, k], [S, k, V]
                for r, i in enumerate(rows):
                    if probs is not None:
                        probs_of[i] = probs[r]
                for i, ids in zip(rows, drafts.tolist(), strict=True):
                    self._real[i] = ids[: _room(batch.seqs[i])]  # the rest: padding
        draft_ids: list[int] = []
        for i, n in enumerate(batch.num_new):
            k = batch.num_draft[i]
            if not k:
                draft_ids.append(-1)
                continue
            real = self._real[i]
            seq = batch.seqs[i]
            padded = real + [seq.tokens[-1]] * (k - len(real))
            batch.input_ids[starts[i] + 1 : starts[i] + n] = padded
            draft_ids.extend(real + [-1] * (k + 1 - len(real)))
        if not probs_of:
            return draft_ids, None
        first = next(iter(probs_of.values()))
        probs = first.new_zeros(len(draft_ids), first.shape[-1])  # [R, V]
        row = 0
        for i, k in enumerate(batch.num_draft):
            if i in probs_of:
                probs[row : row + k] = probs_of[i]
            row += k + 1 if k else 1
        return draft_ids, probs

    def resolve(
        self, batch: ScheduledBatch, result: list[list[int]]
    ) -> tuple[list[int], list[list[int]]]:
        """Per sequence of a verify step: the next token and the accepted drafts before it.

        Args:
            result: the host copy of :func:`~paged_ops.engine.rejection.verify`'s ``[3, R]``.
        """
        assert batch.num_draft is not None
        target, residual, accept = result
        sampled: list[int] = []
        accepted: list[list[int]] = []
        row = 0
        m = self.metrics
        self._kept = []
        for i, seq in enumerate(batch.seqs):
            k = batch.num_draft[i]
            if not k:
                sampled.append(target[row])
                accepted.append([])
                row += 1
                continue
            real = self._real[i]
            span = slice(row, row + k + 1)
            kept, token = accept_drafts(real, target[span], residual[span], accept[span])
            row += k + 1
            sampled.append(token)
            accepted.append(kept)
            if real:
                m.num_verify_rows += 1
                m.num_draft_tokens += len(real)
                self._kept.append((seq, len(seq.tokens), len(kept)))
                seq.spec.observe(seq.num_generated, len(kept), self.config.min_mean_accepted)
        return sampled, accepted

    def postprocessed(self, batch: ScheduledBatch) -> None:
        """After the verify step's tokens were appended (and cut after a stop token, a stop string
        or the length limit): count the accepted drafts that were kept, and roll a draft model's
        KV back to the target's computed tokens."""
        for seq, before, accepted in self._kept:
            self.metrics.num_accepted_tokens += min(accepted, len(seq.tokens) - before)
        self._kept = []
        for seq in batch.seqs:
            if seq.spec is not None:
                seq.spec.draft_computed = min(seq.spec.draft_computed, seq.num_computed)

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()


def _room(seq: Seq) -> int:
    """Drafts ``seq`` can still use: a verify step gives at most ``drafts + 1`` tokens, and the
    request stops at ``max_new_tokens`` (verify rows past this verify padding)."""
    return seq.params.max_new_tokens - seq.num_generated - 1


def _due(state: SpecState, num_generated: int, probe_step: bool) -> bool:
    """Whether a request with ``num_generated`` tokens may draft: past its pause, and (once it
    backed off) on a probe step."""
    return num_generated >= state.off_until and (probe_step or not state.backed_off)


def _settings(seqs: list[Seq], steps: list[int]) -> SamplingBatch:
    return SamplingBatch(
        temperatures=[s.params.temperature for s in seqs],
        top_ks=[s.params.top_k for s in seqs],
        top_ps=[s.params.top_p for s in seqs],
        seeds=[s.seed for s in seqs],
        steps=steps,
    )


def row_settings(batch: ScheduledBatch) -> SamplingBatch:
    """Sampling settings per logits row of ``batch`` (``k + 1`` rows for a verifying sequence)."""
    counts = [k + 1 if k else 1 for k in (batch.num_draft or [0] * len(batch.seqs))]
    seqs = [s for s, c in zip(batch.seqs, counts, strict=True) for _ in range(c)]
    return _settings(seqs, batch.sample_steps)
