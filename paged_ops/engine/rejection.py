"""Device side of speculative decoding: draft sampling and the verify step's rejection sampling.

Everything is row-wise over logits rows (a verify step has ``k + 1`` rows per sequence) and uses
the sampler's counter-based noise (:func:`~paged_ops.engine.sampler.counter_uniform`) keyed by
``(seed, generated-token index)``, with a different salt per use, so no draw depends on the batch
and seeded requests are reproducible. Nothing here reads a device value on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_ops.engine.sampler import (
    SamplingBatch,
    counter_uniform,
    gumbel_argmax,
    host_to_device,
    processed_logits,
)

# XOR-ed into a request's seed so that each use draws independent noise
ACCEPT_SALT = 0x5BD1E995
RESIDUAL_SALT = 0x27D4EB2F
DRAFT_SALT = 0x165667B1


def _seeds_steps(rows: SamplingBatch, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return host_to_device(rows.seeds, torch.int64, dev), host_to_device(
        rows.steps, torch.int64, dev
    )


def sample_drafts(
    logits: torch.Tensor, rows: SamplingBatch, greedy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft model's tokens and their distribution ``q``.

    Args:
        logits: ``[S, V]`` draft logits; greedy: ``[S]`` their argmax.
    Returns:
        ``[S]`` int64 drafts (greedy rows: the argmax) and ``q`` ``[S, V]`` float32 (``None`` when
        every row is greedy: greedy verification compares tokens only).
    """
    if rows.all_greedy:
        return greedy, None
    scores = processed_logits(logits, rows)
    seeds, steps = _seeds_steps(rows, logits.device)
    sampled = gumbel_argmax(scores, seeds ^ DRAFT_SALT, steps)
    is_greedy = host_to_device([t == 0.0 for t in rows.temperatures], torch.bool, logits.device)
    return torch.where(is_greedy, greedy, sampled), scores.softmax(dim=-1)


def verify(
    logits: torch.Tensor,
    rows: SamplingBatch,
    greedy: torch.Tensor,
    draft_ids: Sequence[int],
    draft_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """What each logits row of a verify step says about its draft.

    Args:
        logits: ``[R, V]`` target logits; greedy: ``[R]`` their argmax.
        rows: sampling settings per row; ``steps`` is the generated-token index the row samples.
        draft_ids: ``[R]`` the draft token that follows each row (``-1``: none, e.g. a sequence's
            last verify row or a row that does not verify).
        draft_probs: ``[R, V]`` float32, the draft distribution ``q`` each draft was drawn from;
            ``None`` for point-mass drafts (n-gram): ``q(d) = 1``.
    Returns:
        ``[3, R]`` int64: the row's target token (greedy: argmax; else a sample from ``p``), the
        token to take when the row's draft is rejected (greedy: argmax; else a sample from
        ``max(p - q, 0)`` renormalised, or ``p`` where that is all zero), and 1 where the draft
        is accepted (greedy: it equals the argmax; else with probability ``min(1, p(d) / q(d))``).
    """
    dev = logits.device
    drafts = host_to_device(list(draft_ids), torch.int64, dev)  # [R]
    greedy_accept = (drafts == greedy).long()
    if rows.all_greedy:
        return torch.stack([greedy, greedy, greedy_accept])
    scores = processed_logits(logits, rows)  # [R, V]
    seeds, steps = _seeds_steps(rows, dev)
    target = gumbel_argmax(scores, seeds, steps)  # the plain sampler's draw for this (seed, step)
    p = scores.softmax(dim=-1)
    d = drafts.clamp(min=0)[:, None]  # [R, 1]
    p_d = p.gather(-1, d)[:, 0]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
        residual = p.scatter(-1, d, 0.0)
    else:
        q_d = draft_probs.gather(-1, d)[:, 0]
        residual = (p - draft_probs).clamp(min=0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    u = counter_uniform(seeds ^ ACCEPT_SALT, steps, 1)[:, 0]  # [R]
    accept = ((u * q_d < p_d) & (drafts >= 0)).long()
    resampled = gumbel_argmax(residual.log(), seeds ^ RESIDUAL_SALT, steps)
    is_greedy = host_to_device([t == 0.0 for t in rows.temperatures], torch.bool, dev)
    return torch.stack(
        [
            torch.where(is_greedy, greedy, target),
            torch.where(is_greedy, greedy, resampled),
            torch.where(is_greedy, greedy_accept, accept),
        ]
    )
