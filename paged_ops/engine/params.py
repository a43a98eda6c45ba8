"""What a caller asks for (:class:`SamplingParams`) and what comes back (:class:`RequestOutput`).

Both are plain host-side objects: they never touch a device and validate eagerly, so bad input fails
with a ``ValueError``/``TypeError`` before any model work starts.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def _scalar(value: Any) -> Any:
    """A 0-d torch tensor as its Python number; anything else unchanged."""
    return value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 else value


def as_int(name: str, value: Any, low: int) -> int:
    """``value`` as a Python int >= ``low``: ints, numpy and torch integer scalars are accepted;
    bools, floats and anything else raise ``TypeError``, a smaller int ``ValueError``."""
    value = _scalar(value)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def as_float(name: str, value: Any) -> float:
    """``value`` as a finite Python float: ints, floats, numpy and torch real scalars accepted."""
    value = _scalar(value)
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def as_token_ids(name: str, value: Any) -> list[int]:
    """``value`` as a list of Python ints: a list/tuple of ints (or numpy/torch integer scalars),
    a 1-D integer tensor or numpy array. A float, a bool, text or a nested list raises
    ``TypeError`` naming ``name`` and the offending entry; negative ids ``ValueError``."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of token ids (ints), got {type(value).__name__}")
    if isinstance(value, torch.Tensor) or hasattr(value, "dtype"):  # one check for all entries
        shape = tuple(value.shape)
        if len(shape) != 1:
            raise TypeError(f"{name} must be 1-D, got shape {shape}")
        dtype = value.dtype
        integer = (
            not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
            if isinstance(dtype, torch.dtype)
            else getattr(dtype, "kind", "") in "iu"  # numpy
        )
        if not integer:
            raise TypeError(f"{name} must hold integer token ids, got dtype {dtype}")
        ids = value.tolist()
    else:
        ids = list(value)
        if not all(type(t) is int for t in ids):  # the common case stays one fast pass
            ids = [as_int(f"{name} entry {i}", t, 0) for i, t in enumerate(ids)]
    negative = [t for t in ids if t < 0]
    if negative:
        raise ValueError(f"{name} has negative token ids {negative[:5]}")
    return ids


def _stop_strings(value: Any) -> tuple[str, ...] | None:
    """``stop`` as a tuple of non-empty strings (``None``/empty: no stop strings)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, (bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"stop must be a string or a list of strings, got {type(value).__name__}")
    stops = tuple(value)
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise TypeError(f"stop entry {i} must be a string, got {type(s).__name__} {s!r}")
        if not s:
            raise ValueError(f"stop entry {i} is the empty string (it would match at once)")
    return stops or None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    Args:
        max_new_tokens: most tokens to generate (>= 1); default 64. ``max_tokens`` is the same
            setting under vLLM's name (give either; both with different values is an error).
        temperature: 0 picks the most likely token (greedy); > 0 samples from ``softmax(logits / t)``.
        top_k: keep the ``k`` most likely tokens before sampling; 0 keeps all (-1, vLLM's
            spelling of "off", is accepted and stored as 0).
        top_p: keep the smallest set of tokens whose probability adds up to ``top_p`` (0 < p <= 1).
        seed: makes sampling reproducible: the same seed, prompt and settings give the same tokens
            whatever else runs in the batch. ``None`` draws a fresh seed per request.
        stop_token_ids: tokens that end the request (the stop token is kept in the output).
        ignore_eos: keep going past the model's end-of-sequence token.
        n: samples per prompt (>= 1). They share the prompt's KV blocks (computed once); sample
            ``j`` draws with the seed :func:`~paged_ops.engine.sampler.sample_seed` ``(seed, j)``
            (sample 0 with ``seed`` itself, so ``n=1`` is unchanged). Greedy samples are identical.
        stop: a string or a list of strings that end the request when the decoded output text
            contains one (also across token boundaries; needs the LLM's tokenizer). The returned
            text ends just before the stop string; ``token_ids`` end with the token that completed
            it. ``finish_reason`` is ``"stop"``.
        logprobs: ``None``, or ``k >= 0``: every generated token comes with its log-probability and
            the ``k`` most likely tokens' (``log_softmax`` of the model's raw logits, before
            penalties, temperature, top-k and top-p; see :class:`TokenLogprob`).
        repetition_penalty: > 0, 1.0 = off (Hugging Face's / vLLM's meaning): the logits of tokens
            in the prompt or the output so far are divided by it when positive, multiplied when
            negative.
        presence_penalty: in [-2, 2], 0.0 = off (OpenAI's meaning): subtracted once from the logit
            of every token the output already holds.
        frequency_penalty: in [-2, 2], 0.0 = off (OpenAI's meaning): subtracted from a token's logit
            once per time the output already holds it.
        max_tokens: vLLM's name of ``max_new_tokens``. The engine reads ``max_new_tokens`` (set
            from either); ``max_tokens`` stays as given (``None`` when not).

    Penalties apply before temperature, top-k and top-p (greedy requests too: they pick the most
    likely token of the penalised logits).

    Example:
        >>> SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=0)
        >>> SamplingParams(max_tokens=32, temperature=0.8, n=4, stop=["\\n\\n"], logprobs=5)
    """

    max_new_tokens: int | None = None  # None: max_tokens, else 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stop: str | Sequence[str] | None = None
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = None
    # more than the forward's argmax: sampling, penalties or logprobs (set in __post_init__)
    needs_sampler: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # numpy / torch scalars become Python numbers (frozen: set through object.__setattr__)
        fix = object.__setattr__
        length = self.max_new_tokens
        if length is not None:
            length = as_int("max_new_tokens", length, 1)
        if self.max_tokens is not None:
            alias = as_int("max_tokens", self.max_tokens, 1)
            if length is not None and length != alias:
                raise ValueError(
                    f"max_tokens={alias} and max_new_tokens={length} disagree; they are one "
                    "setting (max_tokens is vLLM's name): give one of them"
                )
            length = alias
            fix(self, "max_tokens", alias)
        fix(self, "max_new_tokens", 64 if length is None else length)
        top_k = as_int("top_k", self.top_k, -1)
        fix(self, "top_k", max(top_k, 0))  # -1: vLLM's "off"
        fix(self, "temperature", as_float("temperature", self.temperature))
        fix(self, "top_p", as_float("top_p", self.top_p))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            fix(self, "seed", as_int("seed", self.seed, 0))
        if self.stop_token_ids is not None:
            fix(self, "stop_token_ids", tuple(as_token_ids("stop_token_ids", self.stop_token_ids)))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        fix(self, "n", as_int("n", self.n, 1))
        fix(self, "stop", _stop_strings(self.stop))
        if self.logprobs is not None:
            fix(self, "logprobs", as_int("logprobs", self.logprobs, 0))
        fix(self, "repetition_penalty", as_float("repetition_penalty", self.repetition_penalty))
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1.0 = off), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = as_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0.0 = off), got {value}")
            fix(self, name, value)
        needs = self.temperature > 0 or self.has_penalties or self.logprobs is not None
        fix(self, "needs_sampler", needs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether any of the repetition, presence or frequency penalties is on."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probabilities of one generated token (``SamplingParams(logprobs=k)``).

    Log-probabilities are ``log_softmax`` (float32) of the model's raw logits at that position:
    before repetition/presence/frequency penalties, temperature, top-k and top-p, so they describe
    the model, not the sampler's choice (vLLM's default, ``logprobs_mode="raw_logprobs"``).

    Attributes:
        token_id: the generated token.
        logprob: its log-probability.
        top: the ``k`` most likely tokens as ``(token_id, logprob)``, most likely first (the
            generated token may or may not be among them); ``[]`` for ``k = 0``.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One of the ``n`` samples of a request (``RequestOutput.outputs``).

    Attributes:
        index: which sample (0 to n - 1).
        token_ids: its generated token ids (stop token included when one ended it; with a stop
            string, up to and including the token that completed the match).
        text: ``token_ids`` decoded, when the LLM has a tokenizer (cut just before a stop string
            that ended it); else ``None``.
        finish_reason: ``"length"`` or ``"stop"`` (a stop token or a stop string).
        logprobs: with ``SamplingParams(logprobs=k)``, one :class:`TokenLogprob` per generated
            token; else ``None``.
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """The result of one request, in the order the prompts were given.

    Attributes:
        prompt_token_ids: the prompt as token ids.
        token_ids: the generated token ids of the first sample (stop token included when one ended
            it; with a stop string, up to and including the token that completed the match).
        text: ``token_ids`` decoded, when the LLM has a tokenizer (cut before a stop string);
            else ``None``.
        finish_reason: ``"length"`` (max_new_tokens or max_model_len reached) or ``"stop"``.
        time_to_first_token: seconds from the start of ``generate`` to this request's first token.
        num_preemptions: how often the request's samples were preempted and recomputed.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
        outputs: every sample (``SamplingParams.n`` of them); ``outputs[0]`` holds the same
            ``token_ids``, ``text`` and ``finish_reason`` as the fields above, and the logprobs.
    """

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    time_to_first_token: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    outputs: list[CompletionOutput] = field(default_factory=list)


@dataclass
class GenerationMetrics:
    """Figures of the last ``generate``/``stream`` call (``LLM.last_metrics``).

    ``tokens_per_s`` counts generated tokens over the wall time of the call (prefill included).
    ``num_overlapped_steps`` counts the steps queued before the previous step's ids were read (see
    ``LLM(overlap=True)``); ``num_mixed_ahead_steps`` those of them that also carried prompt
    chunks (of requests admitted in them, or of a prompt the step before left mid-way) beside the
    decode rows fed on the device.
    """

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    elapsed_s: float = 0.0
    mean_time_to_first_token_s: float = 0.0
    num_steps: int = 0
    num_decode_steps: int = 0
    num_overlapped_steps: int = 0
    num_mixed_ahead_steps: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    # speculative decoding (LLM(speculative=...)): sequence-steps that verified drafts, drafts
    # verified (padding excluded) and drafts accepted
    num_verify_rows: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over verified drafts (0 without speculation)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a sequence gained per verify step: accepted drafts + the target's own token
        (vLLM's "mean acceptance length"; 1.0 = nothing accepted)."""
        rows = self.num_verify_rows
        return (self.num_accepted_tokens + rows) / rows if rows else 0.0

    def add_speculation(self, now: Any, before: Any) -> None:
        """Add the speculation counters gained between two snapshots of ``SpecMetrics``."""
        for name in ("num_verify_rows", "num_draft_tokens", "num_accepted_tokens"):
            setattr(self, name, getattr(self, name) + getattr(now, name) - getattr(before, name))

    def summary(self) -> str:
        line = (
            f"{self.num_requests} requests, {self.num_prompt_tokens} prompt + "
            f"{self.num_generated_tokens} generated tokens in {self.elapsed_s:.2f} s: "
            f"{self.tokens_per_s:,.1f} tok/s, mean TTFT {self.mean_time_to_first_token_s * 1e3:.1f} ms"
        )
        if self.num_draft_tokens:
            line += (
                f"; speculation: {self.num_accepted_tokens}/{self.num_draft_tokens} drafts "
                f"accepted ({self.acceptance_rate:.0%}), {self.mean_accepted_length:.2f} tokens "
                "per verify"
            )
        return line


@dataclass(frozen=True)
class StreamChunk:
    """One new token of a streamed request.

    ``text`` is the newly decodable text (``""`` while a multi-byte character is incomplete, or
    while the text could be the start of a stop string; ``None`` without a tokenizer);
    ``finish_reason`` is set on the last chunk only; ``logprob`` with ``SamplingParams(logprobs=k)``.
    """

    token_id: int
    text: str | None = None
    finish_reason: str | None = None
    logprob: TokenLogprob | None = None
