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


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    Args:
        max_new_tokens: most tokens to generate (>= 1).
        temperature: 0 picks the most likely token (greedy); > 0 samples from ``softmax(logits / t)``.
        top_k: keep the ``k`` most likely tokens before sampling; 0 keeps all.
        top_p: keep the smallest set of tokens whose probability adds up to ``top_p`` (0 < p <= 1).
        seed: makes sampling reproducible: the same seed, prompt and settings give the same tokens
            whatever else runs in the batch. ``None`` draws a fresh seed per request.
        stop_token_ids: tokens that end the request (the stop token is kept in the output).
        ignore_eos: keep going past the model's end-of-sequence token.

    Example:
        >>> SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=0)
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # numpy / torch scalars become Python numbers (frozen: set through object.__setattr__)
        fix = object.__setattr__
        fix(self, "max_new_tokens", as_int("max_new_tokens", self.max_new_tokens, 1))
        fix(self, "top_k", as_int("top_k", self.top_k, 0))
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RequestOutput:
    """The result of one request, in the order the prompts were given.

    Attributes:
        prompt_token_ids: the prompt as token ids.
        token_ids: the generated token ids (stop token included when one ended the request).
        text: ``token_ids`` decoded, when the LLM has a tokenizer; else ``None``.
        finish_reason: ``"length"`` (max_new_tokens or max_model_len reached) or ``"stop"``.
        time_to_first_token: seconds from the start of ``generate`` to this request's first token.
        num_preemptions: how often the request was preempted and recomputed.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
    """

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    time_to_first_token: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass
class GenerationMetrics:
    """Figures of the last ``generate``/``stream`` call (``LLM.last_metrics``).

    ``tokens_per_s`` counts generated tokens over the wall time of the call (prefill included).
    ``num_overlapped_steps`` counts the steps queued before the previous step's ids were read (see
    ``LLM(overlap=True)``).
    """

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    elapsed_s: float = 0.0
    mean_time_to_first_token_s: float = 0.0
    num_steps: int = 0
    num_decode_steps: int = 0
    num_overlapped_steps: int = 0
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

    ``text`` is the newly decodable text (``""`` while a multi-byte character is incomplete;
    ``None`` without a tokenizer); ``finish_reason`` is set on the last chunk only.
    """

    token_id: int
    text: str | None = None
    finish_reason: str | None = None
