"""paged_ops: paged-KV-cache attention for Hugging Face causal LMs, compiled and graph-captured.

``import paged_ops`` needs only torch; triton, flashinfer and transformers load lazily where used.
The Hugging Face entry points (``patch_model``, ``unpatch_model``, ``PagedCache``,
``paged_attention_of``) import ``paged_ops.integrations.transformers`` on first access, which also
registers ``attn_implementation="paged_ops"`` with transformers.
"""

from typing import Any

from paged_ops.argmax import greedy_argmax
from paged_ops.backends import LayerSpec, available_backends
from paged_ops.cache import BlockAllocator, KVCache, OutOfBlocksError, blocks_needed
from paged_ops.engine import (
    LLM,
    CompletionOutput,
    GenerationMetrics,
    RequestOutput,
    SamplingParams,
    SpeculativeConfig,
    StreamChunk,
    TokenLogprob,
    configure_compile_caches,
)
from paged_ops.gated_mlp import add_rms_norm_gated_mlp
from paged_ops.linear import small_linear
from paged_ops.metadata import AttentionMetadata, MetadataBuilder, SequenceSlice
from paged_ops.mlp_linear import silu_mul_linear
from paged_ops.mlp_norm_linear import silu_mul_add_rms_norm_linear
from paged_ops.module import LayerConfig, PagedAttention
from paged_ops.norm_linear import add_rms_norm_linear
from paged_ops.ops import paged_attention, write_kv

__all__ = [
    "AttentionMetadata",
    "BlockAllocator",
    "CompletionOutput",
    "GenerationMetrics",
    "LLM",
    "KVCache",
    "LayerConfig",
    "LayerSpec",
    "MetadataBuilder",
    "OutOfBlocksError",
    "PagedAttention",
    "RequestOutput",
    "SamplingParams",
    "SequenceSlice",
    "SpeculativeConfig",
    "StreamChunk",
    "TokenLogprob",
    "add_rms_norm_gated_mlp",
    "add_rms_norm_linear",
    "available_backends",
    "blocks_needed",
    "configure_compile_caches",
    "greedy_argmax",
    "paged_attention",
    "silu_mul_add_rms_norm_linear",
    "silu_mul_linear",
    "small_linear",
    "write_kv",
]

_HF_NAMES = ("PagedCache", "paged_attention_of", "patch_model", "unpatch_model")
__all__ += list(_HF_NAMES)


def __getattr__(name: str) -> Any:
    if name in _HF_NAMES:
        from paged_ops.integrations import transformers as hf

        return getattr(hf, name)
    raise AttributeError(f"module 'paged_ops' has no attribute {name!r}")
