"""paged_ops: paged-KV-cache attention for Hugging Face causal LMs, compiled and graph-captured.

``import paged_ops`` needs only torch; triton, flashinfer and transformers load lazily where used.
"""

from paged_ops.backends import LayerSpec, available_backends
from paged_ops.cache import BlockAllocator, KVCache, OutOfBlocksError, blocks_needed
from paged_ops.engine import LLM, GenerationMetrics, RequestOutput, SamplingParams, StreamChunk
from paged_ops.metadata import AttentionMetadata, MetadataBuilder, SequenceSlice
from paged_ops.module import LayerConfig, PagedAttention
from paged_ops.ops import paged_attention, write_kv

__all__ = [
    "AttentionMetadata",
    "BlockAllocator",
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
    "StreamChunk",
    "available_backends",
    "blocks_needed",
    "paged_attention",
    "write_kv",
]
