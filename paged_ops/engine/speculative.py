"""Speculative decoding: cheap drafts of the next tokens, verified by the target model in one step.

A sequence that speculates runs a **verify step**: its last known token followed by ``k`` draft
tokens, ``k + 1`` query tokens through the same paged-attention ops as any step, with logits at
every one of them. Row ``j``'s logits are the target's distribution for the token after draft
``j``, so one forward checks all drafts at once:

- **greedy**: draft ``j + 1`` is accepted while it equals the target's argmax at row ``j``; the
  first mismatch is replaced by that argmax, and when every draft is accepted row ``k``'s argmax
  is a bonus token. The output is the non-speculative greedy output, token for token.
- **sampling**: standard rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft ``d``
  drawn from ``q`` is accepted with probability ``min(1, p(d) / q(d))``; at the first rejection a
  token is drawn from ``max(p - q, 0)`` renormalised; after ``k`` acceptances a bonus token from
  ``p``. The output distribution is exactly the target's ``p`` (temperature, top-k and top-p
  applied). An n-gram draft is a point mass (``q(d) = 1``). The noise is counter based like the
  sampler's (:mod:`paged_ops.engine.sampler`): a seeded request gives the same tokens every run.

The KV of rejected drafts is rolled back by the scheduler: the sequence's computed length stops
after the accepted tokens (their slots are rewritten by later steps) and blocks past what the
sequence needs are freed (:meth:`~paged_ops.engine.scheduler.Scheduler.postprocess`). Prefix-cache
blocks are registered from computed (accepted) tokens only.

Drafts come from :class:`NgramProposer` (prompt lookup: the most recent earlier occurrence of the
sequence's last ``n`` tokens, ``ngram_max >= n >= ngram_min``, proposes what followed it) or from a
small draft model (:mod:`paged_ops.engine.draft`). A request whose drafts keep being rejected stops
speculating for a while (an exponential moving average of accepted drafts per verify below
``min_mean_accepted`` backs it off: n-gram drafts for 16, 32, ... 256 generated tokens, a draft
model for 256 each time), then it probes again with one verify step (on every 16th step of the LLM,
so that a batch's probes share verify steps, see :mod:`paged_ops.engine.speculator`): a probe that
accepts fewer than ``min_mean_accepted`` drafts backs it off again, one that accepts more turns
speculation back on. Text the drafter cannot predict runs at about the speed of plain decoding, and
text that becomes predictable later (a generation that falls into a loop) is caught.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from paged_ops.engine.params import as_float, as_int

METHODS = ("ngram", "draft")
_EMA = 0.5  # weight of the newest verify in a request's mean accepted drafts
_PRIOR = 1.0  # the mean a new request starts from: two verifies that accept nothing back it off
# at the default threshold of 0.5, one does not. A probe after a back-off starts from the threshold
# instead, so that a probe that accepts nothing costs one verify, not two.
# Generated tokens a request waits after its first back-off before it probes again; each failed
# probe doubles the pause, up to _BACKOFF_MAX. The first pause follows what a failed probe costs
# (H100, Llama-3.2-1B shape, batch 1: a decode step 1.48 ms, 256 tokens ~380 ms). An n-gram probe is
# one verify step in place of a decode step (~1.3 ms more, 0.35%): after 16 tokens, then 32, 64 and
# 128, ~1.5% per 256 tokens, and a generation that falls into a loop is caught within ~30 tokens. A
# draft model's probe also runs a catch-up forward over the paused stretch (compiled, no graph) and
# k draft steps: ~6-12 ms, 2-3% of 256 tokens each. Measured (H100, 2-layer random draft, batch 1,
# 256 tokens): a new request's two verifies plus one probe after 128 tokens made it 0.93x of plain
# (0.97x of a second plain build): so a draft model waits 256 tokens from its first back-off, i.e.
# about one failed attempt per 256 tokens after the first two.
FIRST_PAUSE = {"ngram": 16, "draft": 256}
_BACKOFF_MAX = 256


@dataclass(frozen=True)
class SpeculativeConfig:
    """How ``LLM(..., speculative=...)`` drafts tokens for the target to verify.

    Args:
        method: ``"ngram"`` (prompt lookup in the sequence's own tokens, no second model) or
            ``"draft"`` (a small causal LM with the target's vocabulary, ``draft_model``).
        num_tokens: draft tokens per verify step (``k``; each verify step feeds ``k + 1`` tokens).
        draft_model: for ``"draft"``: a transformers causal LM with the same vocabulary, on the
            target's device. ``LLM`` patches it onto its own paged cache (same block ids as the
            target's, so the same block tables serve both) and compiles / graph-captures it as it
            does the target.
        ngram_min, ngram_max: for ``"ngram"``: the longest suffix of ``ngram_max`` tokens is
            looked up first, down to ``ngram_min``.
        disable_by_batch_size: no speculation in a step with more running sequences than this
            (large batches are compute bound: verifying ``k + 1`` tokens per sequence costs about
            ``k + 1`` decode steps there).
        min_mean_accepted: a request whose moving average of accepted drafts per verify step
            falls below this stops speculating for a while (16 to 256 generated tokens), then
            probes again with one verify step, which accepts at least this many drafts to end
            the pause.

    A step verifies drafts only when none of the requests running or waiting uses penalties,
    ``logprobs`` or has samples still to fork (``n > 1`` before its prompt completes); such
    requests run plain decode steps (and so does everything beside them while they run).

    Example:
        >>> LLM(model, tok, speculative=SpeculativeConfig(method="ngram", num_tokens=4))
    """

    method: str = "ngram"
    num_tokens: int = 4
    draft_model: nn.Module | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    disable_by_batch_size: int = 32
    min_mean_accepted: float = 0.5

    def __post_init__(self) -> None:
        fix = object.__setattr__
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        fix(self, "num_tokens", as_int("num_tokens", self.num_tokens, 1))
        fix(self, "ngram_min", as_int("ngram_min", self.ngram_min, 1))
        fix(self, "ngram_max", as_int("ngram_max", self.ngram_max, 1))
        fix(
            self,
            "disable_by_batch_size",
            as_int("disable_by_batch_size", self.disable_by_batch_size, 1),
        )
        fix(self, "min_mean_accepted", as_float("min_mean_accepted", self.min_mean_accepted))
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})"
            )
        if self.min_mean_accepted < 0:
            raise ValueError(f"min_mean_accepted must be >= 0, got {self.min_mean_accepted}")
        if self.method == "draft":
            if not isinstance(self.draft_model, nn.Module) or not hasattr(
                self.draft_model, "config"
            ):
                raise TypeError(
                    "method='draft' needs draft_model, a transformers causal LM, got "
                    f"{type(self.draft_model).__name__}"
                )
        elif self.draft_model is not None:
            raise ValueError("draft_model is only used with method='draft'")


class NgramProposer:
    """Prompt-lookup drafts from one sequence's own tokens, with an incremental index.

    For each ``n`` in ``[n_min, n_max]`` a dict maps every ``n``-gram of the sequence to the end
    position of its latest occurrence that has a following token; indexing a new token costs
    ``n_max - n_min + 1`` dict writes, a proposal as many look-ups.
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        self.maps: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(n_max, n_min - 1, -1)
        }
        self.indexed = 0  # n-grams ending before this position are in the maps

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """``k`` tokens that followed the latest earlier occurrence of the longest suffix of
        ``tokens`` found (``[]`` when none is found). Where that occurrence is closer to the end
        than ``k`` tokens, the text between it and the end repeats: the drafts continue that
        period (a loop of 3 tokens drafts it over and over)."""
        last = len(tokens) - 1
        for p in range(self.indexed, last):  # n-grams ending at p: p + 1 exists
            for n, positions in self.maps.items():
                if p + 1 >= n:
                    positions[tuple(tokens[p + 1 - n : p + 1])] = p
        self.indexed = max(self.indexed, last)
        for n, positions in self.maps.items():
            if len(tokens) >= n:
                p = positions.get(tuple(tokens[len(tokens) - n :]))
                if p is not None:
                    period = last - p
                    drafts = tokens[p + 1 : p + 1 + k]
                    while len(drafts) < k:
                        drafts.append(drafts[len(drafts) - period])
                    return drafts
        return []


@dataclass
class SpecState:
    """One request's speculation bookkeeping (``Sequence.spec``)."""

    proposer: NgramProposer | None = None
    first_pause: int = FIRST_PAUSE["ngram"]  # generated tokens of the first back-off
    drafts: list[int] = field(default_factory=list)  # the real drafts of the next verify step
    drafting: bool = False  # drafts in the next step (else its verify rows are padding)
    mean_accepted: float | None = None  # moving average of accepted drafts per verify
    off_until: int = 0  # no speculation before this many generated tokens
    missed: bool = False  # its last n-gram lookup found nothing
    pause: int = 0  # generated tokens of the last back-off (0: not backed off)
    draft_computed: int = 0  # a draft model's cache holds K/V of tokens before this position

    @property
    def backed_off(self) -> bool:
        """Backed off, and no probe went well since: it drafts only on probe steps."""
        return self.pause > 0

    def blocks_dropped(self) -> None:
        """The sequence lost its blocks (preempted or finished): a draft model's KV is gone."""
        self.draft_computed = 0
        self.drafts = []

    def observe(self, num_generated: int, accepted: int, threshold: float) -> None:
        """Update the moving average after a verify; back off when it falls below
        ``threshold``, doubling the pause each time; a probe that accepts ``threshold`` or more
        ends the back-off."""
        avg = max(_PRIOR, threshold) if self.mean_accepted is None else self.mean_accepted
        self.mean_accepted = (1 - _EMA) * avg + _EMA * accepted
        if self.mean_accepted < threshold:
            self.pause = min(2 * self.pause, _BACKOFF_MAX) if self.pause else self.first_pause
            self.off_until = num_generated + self.pause
            self.mean_accepted = threshold  # the probe: below the threshold backs off again
        elif accepted >= threshold:
            self.pause = 0


def accept_drafts(
    drafts: list[int], target: list[int], residual: list[int], accepted: list[bool]
) -> tuple[list[int], int]:
    """The tokens a verify step appends for one sequence.

    Args:
        drafts: the real draft tokens (``r <= k``; rows past ``r`` verified padding).
        target: per verify row ``j`` (``k + 1`` rows), the target's token at that row: its
            argmax (greedy) or a sample from its distribution ``p_j``.
        residual: per row, the token to take when row ``j``'s draft is rejected (greedy: the
            argmax; sampling: a sample from ``max(p_j - q_j, 0)``).
        accepted: per row, whether its draft is accepted (``drafts[j] == argmax`` for greedy).
    Returns:
        ``(accepted drafts, next token)``.
    """
    m = 0
    while m < len(drafts) and accepted[m]:
        m += 1
    return drafts[:m], (residual[m] if m < len(drafts) else target[m])


@dataclass
class SpecMetrics:
    """Counters of speculative decoding (also summed into ``GenerationMetrics``)."""

    num_verify_rows: int = 0  # sequence-steps that verified drafts
    num_draft_tokens: int = 0  # real drafts verified
    num_accepted_tokens: int = 0


def spec_eligible(seq: Any) -> bool:
    """Whether a request may be in a verify step: no penalties (they depend on every earlier
    token, drafts included), no log-probabilities (a verify step reports none) and no samples
    still to fork (``SamplingParams.n``: forks happen in plain steps)."""
    p = seq.params
    return not (p.has_penalties or p.logprobs is not None or seq.children)
