"""Continuous-batching generation: scheduler, model runner (compile + CUDA graphs), sampler, LLM."""

from paged_ops.engine.compile_cache import configure_compile_caches
from paged_ops.engine.llm import LLM
from paged_ops.engine.params import (
    CompletionOutput,
    GenerationMetrics,
    RequestOutput,
    SamplingParams,
    StreamChunk,
    TokenLogprob,
)
from paged_ops.engine.speculative import SpeculativeConfig

__all__ = [
    "LLM",
    "CompletionOutput",
    "GenerationMetrics",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "StreamChunk",
    "TokenLogprob",
    "configure_compile_caches",
]
