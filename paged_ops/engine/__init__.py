"""Continuous-batching generation: scheduler, model runner (compile + CUDA graphs), sampler, LLM."""

from paged_ops.engine.compile_cache import configure_compile_caches
from paged_ops.engine.llm import LLM
from paged_ops.engine.params import GenerationMetrics, RequestOutput, SamplingParams, StreamChunk
from paged_ops.engine.speculative import SpeculativeConfig

__all__ = [
    "LLM",
    "GenerationMetrics",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "StreamChunk",
    "configure_compile_caches",
]
