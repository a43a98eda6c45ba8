"""The paged KV cache tensors and the block allocator.

One allocation holds every layer's cache (``[L, N, 2, B, Hkv, D]``); each layer gets a view
``[N, 2, B, Hkv, D]`` (the op contract). The allocator hands out block ids with reference counts, so
sequences with a common prompt prefix can share full blocks; a freed block keeps its prefix hash until
it is reused, so a later sequence with the same prefix can revive it (least recently freed goes first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

from paged_ops.fp8 import FLOAT_DTYPES, FP8_DTYPES

_CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES


class OutOfBlocksError(ValueError):
    """The KV cache has too few free blocks for a request."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class KVCache:
    """Every layer's paged KV cache in one allocation.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: the cache geometry.
        dtype: float32, float16 or bfloat16, or float8_e4m3fn/float8_e5m2 (a quantized cache:
            one byte per value, so a memory budget holds twice the blocks of bfloat16).
        device: where the cache lives.

    ``kv.layer(i)`` is layer ``i``'s ``[num_blocks, 2, block_size, Hkv, D]`` view.

    Example:
        >>> kv = KVCache(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=64)
        >>> kv.layer(0).shape
        torch.Size([64, 2, 16, 2, 64])
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, v in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if dtype not in _CACHE_DTYPES:
            raise TypeError(f"KV cache dtype must be one of {_CACHE_DTYPES}, got {dtype}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        # [L, N, 2, B, Hkv, D]: one allocation, per-layer views. Never an inference tensor (made
        # under inference_mode, it could not be written outside it).
        with torch.inference_mode(False):
            self.data = torch.zeros(
                (num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim),
                dtype=dtype,
                device=device,
            )
        self.layers: list[torch.Tensor] = list(self.data.unbind(0))

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes across all layers (keys and values)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize

    @classmethod
    def from_memory_budget(
        cls,
        memory_bytes: int,
        *,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """As many blocks as fit in ``memory_bytes``; raises ``ValueError`` if not even one does."""
        per_block = cls.bytes_per_block(
            num_layers=num_layers,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
        )
        num_blocks = int(memory_bytes) // per_block
        if num_blocks < 1:
            raise ValueError(
                f"a memory budget of {memory_bytes} bytes holds no KV block ({per_block} bytes each)"
            )
        return cls(
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
        )

    def layer(self, index: int) -> torch.Tensor:
        return self.layers[index]  # [N, 2, B, Hkv, D]

    @property
    def device(self) -> torch.device:
        return self.data.device


class BlockAllocator:
    """Hands out KV block ids with reference counts and an optional prefix-hash index.

    ``allocate(n)`` returns ``n`` fresh blocks (ref 1) or raises :class:`OutOfBlocksError` without
    changing anything; ``share(blocks)`` adds a reference; ``free(blocks)`` drops one and returns a
    block to the free list when its count reaches zero. A full block can be registered under a hash
    of its tokens (``register_prefix``); ``lookup_prefix`` finds it again, reviving it from the free
    list if nobody holds it.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        # free block ids in the order they should be reused: least recently freed first
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of_block: dict[int, int] = {}
        self._block_of_hash: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocksError(
                f"out of KV cache blocks: {n} requested, {len(self._free)} of {self.num_blocks} "
                "free; raise num_blocks / the memory budget or run fewer sequences at once"
            )
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._forget_hash(block)  # its old contents are about to be overwritten
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Add a reference to blocks that are already in use (a shared prefix)."""
        for block in blocks:
            if self.ref_counts[block] < 1:
                raise ValueError(f"block {block} is free; only blocks in use can be shared")
            self.ref_counts[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block; a block with no references goes back to the free list."""
        for block in blocks:
            if not 0 <= block < self.num_blocks or self.ref_counts[block] < 1:
                raise ValueError(f"block {block} is not allocated (double free?)")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def register_prefix(self, block: int, prefix_hash: int) -> None:
        """Remember that full block ``block`` holds the tokens hashed to ``prefix_hash``."""
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is free; register a prefix only on a block in use")
        if prefix_hash in self._block_of_hash:
            return  # another block already holds this prefix; keep the first
        self._forget_hash(block)
        self._hash_of_block[block] = prefix_hash
        self._block_of_hash[prefix_hash] = block

    def prefix_block(self, prefix_hash: int) -> int | None:
        """The block holding ``prefix_hash`` (or ``None``), taking no reference."""
        return self._block_of_hash.get(prefix_hash)

    def lookup_prefix(self, prefix_hash: int) -> int | None:
        """The block holding ``prefix_hash`` with one more reference taken, or ``None``."""
        block = self.prefix_block(prefix_hash)
        if block is None:
            return None
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1
        return block

    def _forget_hash(self, block: int) -> None:
        old = self._hash_of_block.pop(block, None)
        if old is not None:
            del self._block_of_hash[old]
