"""Token sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

Sampling uses the Gumbel-max trick with counter-based noise: the noise for vocabulary entry ``v`` of
a request's ``n``-th generated token is a hash of ``(seed, n, v)``. So a request's tokens depend only
on its seed, its prompt and its settings, never on which other requests share the batch or on any
global RNG state, and nothing needs a per-request ``torch.Generator``. Top-k and top-p set the logits
outside the kept set to ``-inf``; Gumbel-max over the rest samples exactly from the renormalised
distribution. No step reads a device value on the host: the caller reads the sampled ids once.
Per-row settings reach the device through pinned, non-blocking copies, so sampling never waits for
the device either (the engine launches the next step before reading this one's ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in ``[0, 2**32)``."""
    # products fit in 64 bits (wrapping past 2**63 keeps the low 32 bits right)
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def counter_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform noise in ``(0, 1)`` that depends only on ``(seed, step, vocab index)``.

    Args:
        seeds: ``[S]`` int64 (only the low 32 bits are used); steps: ``[S]`` int64.
    Returns:
        ``[S, vocab_size]`` float32.
    """
    key = _mix32((_mix32(seeds & _MASK32) ^ (steps * 0x9E3779B9)) & _MASK32)  # [S]
    v = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)  # [V]
    h = _mix32((key[:, None] + v[None, :] * 0x27D4EB2F) & _MASK32)  # [S, V]
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingBatch:
    """Host-side sampling settings of the sequences of one step (built without a device sync)."""

    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    seeds: list[int]
    steps: list[int]  # how many tokens each request has generated so far

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperatures)


def greedy_ids(logits: torch.Tensor, chunks: int = 16) -> torch.Tensor:
    """``logits.argmax(-1)`` in two passes: the first index of each row's maximum.

    A one-pass argmax over a vocabulary of ~10^5 runs as one program per row under torch.compile
    (about 30 us per decode step on an H200, for a 128k vocabulary). Splitting each row into
    ``chunks`` pieces gives the first pass ``S x chunks`` programs. 16 pieces: compiled with a
    dynamic S on an H200 (128k vocabulary, bf16), 5.4 / 21 / 73 us at S = 1 / 64 / 256, against
    5.2 / 80 / 301 us with 128 pieces (benchmarks/NOTES.md section 12). Ties resolve as in
    ``argmax``.

    Args:
        logits: ``[S, V]``.
    Returns:
        ``[S]`` int64.
    """
    vocab = logits.shape[-1]
    width = -(-vocab // chunks)
    if width * chunks != vocab:  # pad with -inf: never a row's first maximum unless all are -inf
        logits = torch.nn.functional.pad(logits, (0, width * chunks - vocab), value=float("-inf"))
    piece_max, piece_arg = logits.view(-1, chunks, width).max(dim=-1)  # [S, chunks] each
    best = piece_max.argmax(dim=-1, keepdim=True)  # [S, 1] the first piece holding the maximum
    return (best * width + piece_arg.gather(-1, best))[:, 0]


def host_to_device(
    values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device
):
    """``[len(values)]`` tensor on ``device``, copied without a host sync (pinned on CUDA)."""
    on_cuda = device.type == "cuda"
    host = torch.tensor(values, dtype=dtype, pin_memory=on_cuda)
    return host.to(device, non_blocking=True) if on_cuda else host


def _apply_top_k_top_p(
    logits: torch.Tensor, top_ks: Sequence[int], top_ps: Sequence[float]
) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to ``-inf``. logits: ``[S, V]`` float32."""
    s, vocab = logits.shape
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
    rank = torch.arange(vocab, device=dev)[None, :]  # [1, V]
    k = host_to_device([kk if kk > 0 else vocab for kk in top_ks], torch.int64, dev)  # [S]
    drop = rank >= k[:, None]  # [S, V]
    if any(p < 1.0 for p in top_ps):
        p = host_to_device(list(top_ps), torch.float32, dev)  # [S]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop |= before >= p[:, None]  # the most likely token always stays (before = 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor, batch: SamplingBatch, greedy: torch.Tensor | None = None
) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``[S, V]`` (any float dtype) for the S sequences of ``batch``.
        greedy: ``[S]`` int64 :func:`greedy_ids` of ``logits`` when the caller has it already
            (the engine computes it inside the compiled forward / CUDA graph).
    Returns:
        ``[S]`` int64 token ids, on the logits' device.
    """
    if greedy is None:
        greedy = greedy_ids(logits)  # [S]
    if batch.all_greedy:
        return greedy
    dev = logits.device
    temps = host_to_device([t if t > 0 else 1.0 for t in batch.temperatures], torch.float32, dev)
    logits = logits.float() / temps[:, None]  # top-p acts on the tempered distribution (as HF)
    if any(k > 0 for k in batch.top_ks) or any(p < 1.0 for p in batch.top_ps):
        logits = _apply_top_k_top_p(logits, batch.top_ks, batch.top_ps)
    seeds = host_to_device(batch.seeds, torch.int64, dev)  # [S]
    steps = host_to_device(batch.steps, torch.int64, dev)  # [S]
    u = counter_uniform(seeds, steps, logits.shape[-1])  # [S, V]
    gumbel = -torch.log(-torch.log(u))
    sampled = (logits + gumbel).argmax(dim=-1)  # [S]
    is_greedy = host_to_device([t == 0.0 for t in batch.temperatures], torch.bool, dev)  # [S]
    return torch.where(is_greedy, greedy, sampled)
