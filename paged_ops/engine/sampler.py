"""Token sampling on the device: penalties, greedy, temperature, top-k, top-p, per-request seeds,
and the log-probabilities of the chosen tokens.

Sampling uses the Gumbel-max trick with counter-based noise: the noise for vocabulary entry ``v`` of
a request's ``n``-th generated token is a hash of ``(seed, n, v)``. So a request's tokens depend only
on its seed, its prompt and its settings, never on which other requests share the batch or on any
global RNG state, and nothing needs a per-request ``torch.Generator``. Top-k and top-p set the logits
outside the kept set to ``-inf``; Gumbel-max over the rest samples exactly from the renormalised
distribution. No step reads a device value on the host: the caller reads the sampled ids once.
Per-row settings reach the device through pinned, non-blocking copies, so sampling never waits for
the device either (the engine launches the next step before reading this one's ids).

Everything here works on *rows*, not sequences: row ``r`` of ``logits [R, V]`` is described by entry
``r`` of a :class:`SamplingBatch` (its settings, seed, step and token history). The engine has one
row per sequence plus one per extra sample of a prompt that just finished its prefill
(``SamplingParams.n``); a speculative verify step can describe each verified position as a row.
:func:`processed_logits` (penalties, temperature, top-k/top-p masks) and :func:`token_logprobs`
are the building blocks :func:`sample` uses and a rejection sampler can call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_ops.argmax import greedy_argmax

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


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded ``seed`` (``SamplingParams.n``): ``seed``
    itself for sample 0, else a 32-bit hash of ``(seed, index)``. Running a request with ``n``
    samples gives sample ``j`` the tokens of the same request with ``n=1, seed=sample_seed(seed, j)``.
    """
    if index == 0:
        return seed
    x = _mix32_int((_mix32_int(seed & _MASK32) ^ ((seed >> 32) & _MASK32)) + index * 0x9E3779B9)
    return _mix32_int(x ^ 0x5BD1E995)


def _mix32_int(x: int) -> int:
    """:func:`_mix32` on one Python int (taken modulo 2**32 first)."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _MASK32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


@dataclass
class SamplingBatch:
    """Host-side sampling settings of the rows of one step (built without a device sync).

    Every list has one entry per row of the logits it describes. The penalty lists may be ``None``
    (all off); ``prompt_ids`` / ``output_ids`` are each row's token history, read only for rows
    with a penalty on (others may hold ``()``): the prompt (repetition penalty) and the tokens
    generated before the one this row picks (all penalties).
    """

    temperatures: list[float]
    top_ks: list[int]  # <= 0: off
    top_ps: list[float]
    seeds: list[int]
    steps: list[int]  # how many tokens the row's request has generated before this one
    repetition_penalties: list[float] | None = None  # 1.0 = off
    presence_penalties: list[float] | None = None  # 0.0 = off
    frequency_penalties: list[float] | None = None  # 0.0 = off
    prompt_ids: list[Sequence[int]] | None = None
    output_ids: list[Sequence[int]] | None = None

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperatures)

    def penalised_rows(self) -> list[int]:
        """Rows with any penalty on."""
        rep = self.repetition_penalties or [1.0] * len(self.temperatures)
        pres = self.presence_penalties or [0.0] * len(self.temperatures)
        freq = self.frequency_penalties or [0.0] * len(self.temperatures)
        return [
            r
            for r, (a, b, c) in enumerate(zip(rep, pres, freq, strict=True))
            if a != 1.0 or b != 0.0 or c != 0.0
        ]


def greedy_ids(logits: torch.Tensor, chunks: int = 16) -> torch.Tensor:
    """``logits.argmax(-1)`` in two passes: the first index of each row's maximum.

    A one-pass argmax over a vocabulary of ~10^5 runs as one program per row under torch.compile
    (about 30 us per decode step on an H200, for a 128k vocabulary). Splitting each row into
    ``chunks`` pieces gives the first pass ``S x chunks`` programs. 16 pieces: compiled with a
    dynamic S on an H200 (128k vocabulary, bf16), 5.4 / 21 / 73 us at S = 1 / 64 / 256, against
    5.2 / 80 / 301 us with 128 pieces (benchmarks/NOTES.md section 12). Ties resolve as in
    ``argmax``.

    On CUDA the rows go to ``paged_ops::greedy_argmax`` instead: one Triton pass that keeps a
    running maximum per lane (H100, 128k vocabulary, bf16, benchmarks/NOTES.md section 22: 4.2 /
    9.7 / 28.8 us at S = 1 / 64 / 256 against 5.9 / 20.9 / 73.5 us for the 16 pieces below).

    Args:
        logits: ``[S, V]``.
    Returns:
        ``[S]`` int64.
    """
    if logits.is_cuda and logits.dim() == 2:
        return greedy_argmax(logits)
    vocab = logits.shape[-1]
    width = -(-vocab // chunks)
    if width * chunks != vocab:  # pad with -inf: never a row's first maximum unless all are -inf
        logits = torch.nn.functional.pad(logits, (0, width * chunks - vocab), value=float("-inf"))
    # (``max`` runs as two reductions under Inductor, a maximum and a maximum-with-index; argmax
    # then a gather of each piece's maximum is one, 8-14% faster on an H100, but torch 2.11's CPU
    # Inductor miscompiles that form: benchmarks/NOTES.md section 17)
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


def apply_penalties(
    logits: torch.Tensor, batch: SamplingBatch, pending: torch.Tensor | None = None
) -> torch.Tensor:
    """Repetition, presence and frequency penalties of the rows that have any (vLLM's order and
    meaning); other rows and the input are left as they are.

    Per penalised row, with ``c[v]`` the count of token ``v`` among the row's generated tokens
    (``output_ids``, plus its ``pending`` token) and ``seen[v]`` whether ``v`` is in the prompt or
    the generated tokens: a seen token's logit ``x`` becomes ``x / rep`` if ``x > 0`` else
    ``x * rep``; then ``x - frequency * c[v] - presence * (c[v] > 0)``.

    Args:
        logits: ``[R, V]`` float32 (not modified).
        pending: ``[F]`` int64 on the device (``F <= R``), or ``None``: one more generated token
            for each of the first ``F`` rows that the host does not know yet (a step scheduled
            ahead feeds its leading rows the previous step's ids; rows of requests admitted in
            it, and forked samples, come after them and have none).
    Returns:
        ``[R, V]`` float32: ``logits`` itself when no row has a penalty, else a new tensor.
    """
    rows = batch.penalised_rows()
    if not rows:
        return logits
    assert batch.output_ids is not None, "penalties need each row's generated tokens"
    num, vocab = len(rows), logits.shape[-1]
    dev = logits.device
    index = host_to_device(rows, torch.int64, dev)  # [P]
    x = logits.index_select(0, index)  # [P, V]
    # generated-token counts, from flat indices row * V + token (index_add_: no host sync)
    flat = [j * vocab + t for j, r in enumerate(rows) for t in batch.output_ids[r]]
    counts = torch.zeros(num * vocab, dtype=torch.float32, device=dev)
    if flat:
        counts.index_add_(0, host_to_device(flat, torch.int64, dev), _ones(len(flat), dev))
    # rows ascend: the penalised rows with a pending token are the first ``fed`` of them
    fed = sum(r < len(pending) for r in rows) if pending is not None else 0
    if fed:
        at = torch.arange(fed, device=dev) * vocab + pending.index_select(0, index[:fed])  # [fed]
        counts.index_add_(0, at, _ones(fed, dev))
    counts = counts.view(num, vocab)  # [P, V]
    rep = [batch.repetition_penalties[r] for r in rows] if batch.repetition_penalties else []
    if any(p != 1.0 for p in rep):
        assert batch.prompt_ids is not None, "a repetition penalty needs each row's prompt"
        prompt = [j * vocab + t for j, r in enumerate(rows) for t in batch.prompt_ids[r]]
        seen = (counts > 0).view(-1)
        if prompt:
            seen = seen.index_fill(0, host_to_device(prompt, torch.int64, dev), True)
        penalty = host_to_device(rep, torch.float32, dev)[:, None]  # [P, 1]
        x = torch.where(seen.view(num, vocab), torch.where(x > 0, x / penalty, x * penalty), x)
    for values, of in (
        (batch.frequency_penalties, counts),
        (batch.presence_penalties, (counts > 0).float()),
    ):
        per_row = [values[r] for r in rows] if values else []
        if any(v != 0.0 for v in per_row):
            x = x - host_to_device(per_row, torch.float32, dev)[:, None] * of
    return logits.index_copy(0, index, x)


def _ones(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float32, device=device)


def _temper_and_mask(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``logits [R, V]`` float32 divided by each row's temperature (1 for greedy rows), with
    top-k / top-p masks (``-inf``) applied; a new tensor."""
    temps = [t if t > 0 else 1.0 for t in batch.temperatures]
    logits = logits / host_to_device(temps, torch.float32, logits.device)[:, None]
    if any(k > 0 for k in batch.top_ks) or any(p < 1.0 for p in batch.top_ps):
        logits = _apply_top_k_top_p(logits, batch.top_ks, batch.top_ps)  # on the tempered (as HF)
    return logits


def processed_logits(
    logits: torch.Tensor, batch: SamplingBatch, pending: torch.Tensor | None = None
) -> torch.Tensor:
    """The logits a row samples from: penalties (:func:`apply_penalties`), then temperature,
    then top-k and top-p masks (``-inf`` outside the kept set). ``softmax`` of a row is the
    distribution :func:`sample` draws from; a greedy row (temperature 0) comes back penalised and
    masked but untempered, its choice is the argmax.

    Args:
        logits: ``[R, V]``, any float dtype (not modified); pending: as for
            :func:`apply_penalties`.
    Returns:
        ``[R, V]`` float32.
    """
    return _temper_and_mask(apply_penalties(logits.float(), batch, pending), batch)


def token_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities (``log_softmax`` in float32 of the given logits) of chosen tokens and
    each row's ``k`` most likely tokens. Runs on the device; nothing is read on the host.

    Args:
        logits: ``[R, V]`` any float dtype; ids: ``[R]`` int64, the chosen token of each row.
        k: how many top tokens (>= 0) per row.
    Returns:
        ``[R]`` float32 log-prob of ``ids``, ``[R, k]`` int64 top token ids (most likely first),
        ``[R, k]`` float32 their log-probs.
    """
    logp = logits.float().log_softmax(dim=-1)  # [R, V]
    chosen = logp.gather(-1, ids[:, None])[:, 0]  # [R]
    top_logp, top_ids = logp.topk(k, dim=-1)  # [R, k] each (k = 0: empty)
    return chosen, top_ids, top_logp


def gumbel_argmax(scores: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``argmax(scores + Gumbel noise)``: a draw from ``softmax(scores)`` whose noise depends only
    on ``(seed, step, token id)`` (:func:`counter_uniform`).

    Args:
        scores: ``[R, V]`` float32; seeds, steps: ``[R]`` int64.
    Returns:
        ``[R]`` int64.
    """
    u = counter_uniform(seeds, steps, scores.shape[-1])  # [R, V]
    return (scores + -torch.log(-torch.log(u))).argmax(dim=-1)


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    greedy: torch.Tensor | None = None,
    pending: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``[R, V]`` (any float dtype), described row by row by ``batch``.
        greedy: ``[R]`` int64 :func:`greedy_ids` of ``logits`` when the caller has it already
            (the engine computes it inside the compiled forward / CUDA graph).
        pending: ``[F]`` int64 for the first ``F`` rows, see :func:`apply_penalties` (used only
            by penalised rows).
    Returns:
        ``[R]`` int64 token ids, on the logits' device.
    """
    penalised = batch.penalised_rows()
    if greedy is None:
        greedy = greedy_ids(logits)  # [R]
    if batch.all_greedy and not penalised:
        return greedy
    dev = logits.device
    logits = apply_penalties(logits.float(), batch, pending)
    if penalised:  # greedy rows pick the most likely token of the penalised logits
        index = host_to_device(penalised, torch.int64, dev)
        greedy = greedy.index_copy(0, index, greedy_ids(logits.index_select(0, index)))
    if batch.all_greedy:
        return greedy
    logits = _temper_and_mask(logits, batch)
    seeds = host_to_device(batch.seeds, torch.int64, dev)  # [R]
    steps = host_to_device(batch.steps, torch.int64, dev)  # [R]
    sampled = gumbel_argmax(logits, seeds, steps)  # [R]
    is_greedy = host_to_device([t == 0.0 for t in batch.temperatures], torch.bool, dev)  # [R]
    return torch.where(is_greedy, greedy, sampled)
