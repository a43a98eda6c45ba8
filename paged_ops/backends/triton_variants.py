"""Which launch configurations of the triton backend the steps of an engine can reach.

Every distinct :class:`~paged_ops.backends.triton.LaunchConfig` is a kernel variant that Triton
compiles (~0.5 s on an H100 host) the first time a step picks it. An engine's warm-up runs a step
that picks each configuration once, so that none compiles while it serves: :func:`reachable_configs`
lists them with a step that picks each, without calling ``launch_config`` for every step of the
domain (a million at 256 sequences x 4,096 tokens: 3-4 s of Python).

It relies on how ``launch_config`` depends on a step's ``T`` tokens and ``S`` sequences (checked
against the brute force over whole domains in ``tests/test_triton_variants.py``):

* steps are decode-like (``T <= 2 S``) or prefill-like, and within one kind and one ``S`` the
  configuration depends on ``T`` only through ``T // block_q``, ``ceil(T / block_q)`` and, for
  prefill-like steps, ``T >= 1024 S`` (long prompts);
* the KV split comes from the programs ``(T // block_q + S + 1) x heads`` when they are fewer than
  the SMs, so it only shrinks as ``T`` grows, and a step of ``S >= num_sms`` sequences never splits
  (its FP8 decode split, from ``max(S, ceil(T / block_q)) x heads``, still varies with both);
* past those, a decode-like step's configuration depends on ``max(S, ceil(T / block_q))`` and,
  through the KV-head pairs of a 16-bit cache at D=64 (from ``S x Hkv >= 4 x num_sms``), on
  ``S``: the probe at ``(S, S)`` for every ``S`` meets both.

A variant is also told apart by whether the attention kernel writes the step's K/V itself (a
decode step of a layer whose decode steps do: :func:`step_variant`). Warm-up steps give each
sequence ``T // S`` tokens, so that is the case for ``S <= T < 2 S`` only: within the
decode-like range it changes at ``T = 2 S`` alone, which the probes below meet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

Step = tuple[int, int]  # (T tokens, S sequences)


def _boundaries(lo: int, hi: int, block_q: int) -> Iterator[int]:
    """``T`` in ``[lo, hi]`` at which ``T // block_q`` or ``ceil(T / block_q)`` takes a new value."""
    yield lo
    k = -(-lo // block_q)
    while k * block_q <= hi:
        yield k * block_q
        if k * block_q + 1 <= hi:
            yield k * block_q + 1
        k += 1
    yield hi


def _probe_steps(
    config_of: Callable[[int, int], Any], max_num_seqs: int, max_num_tokens: int, num_sms: int
) -> Iterator[Step]:
    """Steps at which a new configuration can first appear (see the module docstring)."""
    for s in range(1, max_num_seqs + 1):
        decode_hi = min(2 * s, max_num_tokens)
        if s <= num_sms:  # the KV split may depend on T: every boundary of the decode range
            if s <= decode_hi:
                bq = config_of(s, s).block_q
                for t in _boundaries(s, decode_hi, bq):
                    yield t, s
        else:  # decode-like: max(S, ceil(T / block_q)) alone; (S, S) gives the value S
            yield s, s
            if 2 * s <= max_num_tokens:  # the same configuration, no longer a decode step
                yield 2 * s, s
        if 2 * s + 1 > max_num_tokens:
            continue
        bq = config_of(2 * s + 1, s).block_q
        for t in _boundaries(2 * s + 1, max_num_tokens, bq):  # prefill-like: until one pass
            yield t, s
            if config_of(t, s).num_segments == 1:
                break
        for t in (1024 * s - 1, 1024 * s, max_num_tokens):  # the long-prompt edge, the end
            if 2 * s + 1 <= t <= max_num_tokens:
                yield t, s
    # decode-like steps of S > num_sms whose ceil(T / block_q) exceeds every S (block_q 1)
    s = max_num_seqs
    if s > num_sms:
        for t in range(s + 1, min(2 * s, max_num_tokens) + 1):
            yield t, s


def reachable_configs(
    config_of: Callable[[int, int], Any],
    max_num_seqs: int,
    max_num_tokens: int,
    num_sms: int,
    writes_decode_kv: bool = False,
) -> dict[tuple[Any, bool], Step]:
    """Every kernel variant (:func:`step_variant`: the configuration ``config_of(T, S)``, and
    whether the kernel writes the K/V) over the steps an engine can run (``1 <= S <= T``,
    ``S <= max_num_seqs``, ``T <= max_num_tokens``), with a step that takes it.

    ``config_of`` is ``launch_config`` for one layer kind (heads, head size, cache, causal) on a
    GPU of ``num_sms`` SMs; ``writes_decode_kv`` whether that layer's decode steps write their
    K/V inside the attention kernel."""
    variant = step_variant(config_of, writes_decode_kv)
    seen: dict[Step, Any] = {}

    def cached(t: int, s: int) -> Any:  # (the probes meet many steps twice)
        if (t, s) not in seen:
            seen[t, s] = config_of(t, s)
        return seen[t, s]

    found: dict[tuple[Any, bool], Step] = {}
    for t, s in _probe_steps(cached, max_num_seqs, max_num_tokens, num_sms):
        if t >= s:
            found.setdefault(variant(t, s), (t, s))
    return found


def step_variant(
    config_of: Callable[[int, int], Any], writes_decode_kv: bool
) -> Callable[[int, int], tuple[Any, bool]]:
    """``(T, S) -> (configuration, writes K/V)``: the kernel variant of a warm-up step (``T // S``
    new tokens per sequence: ``paged_ops.engine.runner.warm_up_slices``) on a layer whose decode
    steps write their K/V inside the attention kernel when ``writes_decode_kv``
    (``PagedAttention.attention_writes_decode_kv``; the unified kernel only)."""

    def variant(num_tokens: int, num_seqs: int) -> tuple[Any, bool]:
        cfg = config_of(num_tokens, num_seqs)
        decode = num_tokens // num_seqs == 1
        return cfg, writes_decode_kv and decode and cfg.kernel == "unified"

    return variant
