"""What a caller asks for (:class:`SamplingParams`) and what comes back (:class:`RequestOutput`).

Both are plain host-side objects: they never touch a device and validate eagerly, so bad input fails
with a ``ValueError``/``TypeError`` before any model work starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def _check_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


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
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        _check_int("top_k", self.top_k, 0)
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise TypeError(f"{name} must be a float, got {type(v).__name__} {v!r}")
            if not math.isfinite(v):
                raise ValueError(f"{name} must be finite, got {v}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(
                self.stop_token_ids, Sequence
            ):
                raise TypeError(
                    f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}"
                )
            for t in self.stop_token_ids:
                _check_int("stop_token_ids entry", t, 0)
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
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

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> str:
        return (
            f"{self.num_requests} requests, {self.num_prompt_tokens} prompt + "
            f"{self.num_generated_tokens} generated tokens in {self.elapsed_s:.2f} s: "
            f"{self.tokens_per_s:,.1f} tok/s, mean TTFT {self.mean_time_to_first_token_s * 1e3:.1f} ms"
        )


@dataclass(frozen=True)
class StreamChunk:
    """One new token of a streamed request.

    ``text`` is the newly decodable text (``""`` while a multi-byte character is incomplete;
    ``None`` without a tokenizer); ``finish_reason`` is set on the last chunk only.
    """

    token_id: int
    text: str | None = None
    finish_reason: str | None = None
