"""A request's way through the engine: its samples as scheduler sequences, and its output.

A request of ``SamplingParams(n=k)`` becomes ``k`` sequences with consecutive ids: sample 0
enters the scheduler and carries the other ``k - 1`` (``Sequence.children``), which the scheduler
forks off once the prompt is computed (see :mod:`paged_ops.engine.scheduler`).
"""

from __future__ import annotations

from typing import Any

from paged_ops.engine.params import CompletionOutput, RequestOutput, SamplingParams
from paged_ops.engine.sampler import sample_seed
from paged_ops.engine.scheduler import Sequence as Seq
from paged_ops.engine.stop import StopStrings


def make_samples(
    first_id: int,
    prompt: list[int],
    params: SamplingParams,
    seed: int,
    stop_ids: frozenset[int],
    tokenizer: Any | None,
) -> list[Seq]:
    """The request's ``params.n`` sequences, ids ``first_id``, ``first_id + 1``, ...; sample ``j``
    seeded :func:`~paged_ops.engine.sampler.sample_seed` ``(seed, j)``. Only the first is
    scheduled; it carries the rest."""
    samples = []
    for j in range(params.n):
        seq = Seq(first_id + j, len(prompt), list(prompt), params, sample_seed(seed, j), stop_ids)
        seq.index = j
        if params.logprobs is not None:
            seq.logprobs = []
        if params.stop:
            seq.stop_strings = StopStrings(params.stop, tokenizer)
        samples.append(seq)
    samples[0].children = samples[1:]
    return samples


def request_output(samples: list[Seq], tokenizer: Any | None) -> RequestOutput:
    """The finished request as returned by ``LLM.generate``; ``outputs[0]`` mirrors the top level."""
    outputs = []
    for seq in samples:
        text = None
        if seq.stop_strings is not None and seq.stop_strings.stop_at is not None:
            text = seq.stop_strings.final_text()  # cut before the stop string
        elif tokenizer is not None:
            text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        outputs.append(
            CompletionOutput(seq.index, seq.output_ids, text, seq.finish_reason, seq.logprobs)
        )
    first = outputs[0]
    return RequestOutput(
        prompt_token_ids=samples[0].tokens[: samples[0].prompt_len],
        token_ids=first.token_ids,
        text=first.text,
        finish_reason=first.finish_reason,
        num_preemptions=sum(s.num_preemptions for s in samples),
        num_cached_tokens=samples[0].num_cached_tokens,
        outputs=outputs,
    )
