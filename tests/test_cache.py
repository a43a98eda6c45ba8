"""KV cache allocation and the block allocator's invariants."""

import random

import pytest
import torch

from paged_ops import BlockAllocator, KVCache, OutOfBlocksError


def test_kv_cache_is_one_allocation_with_per_layer_views():
    kv = KVCache(
        num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16
    )
    assert kv.layer(1).shape == (10, 2, 4, 2, 8)
    assert kv.layer(1).dtype == torch.bfloat16
    assert all(
        layer.untyped_storage().data_ptr() == kv.data.untyped_storage().data_ptr()
        for layer in kv.layers
    )
    kv.layer(2)[3, 1, 0] = 1.0
    assert kv.data[2, 3, 1, 0].eq(1.0).all() and kv.data[:2].eq(0).all()


def test_kv_cache_from_memory_budget_fits_the_budget():
    geometry = dict(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    per_block = KVCache.bytes_per_block(**geometry)
    assert per_block == 2 * 2 * 16 * 2 * 64 * 2
    kv = KVCache.from_memory_budget(per_block * 7 + per_block // 2, **geometry)
    assert kv.num_blocks == 7
    with pytest.raises(ValueError, match="holds no KV block"):
        KVCache.from_memory_budget(per_block - 1, **geometry)


def test_kv_cache_rejects_bad_geometry_and_dtype():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCache(num_layers=1, num_blocks=0, block_size=4, num_kv_heads=1, head_dim=8)
    with pytest.raises(TypeError, match="dtype"):
        KVCache(
            num_layers=1, num_blocks=1, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.int8
        )


def test_allocator_raises_when_blocks_run_out_and_changes_nothing():
    alloc = BlockAllocator(4, 16)
    alloc.allocate(3)
    with pytest.raises(OutOfBlocksError, match="out of KV cache blocks: 2 requested, 1 of 4"):
        alloc.allocate(2)
    assert alloc.num_free == 1


def test_allocator_rejects_double_free():
    alloc = BlockAllocator(4, 16)
    blocks = alloc.allocate(2)
    alloc.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(blocks[:1])


def test_prefix_lookup_revives_a_freed_block_until_it_is_reused():
    alloc = BlockAllocator(2, 4)
    (a,) = alloc.allocate(1)
    alloc.register_prefix(a, 1234)
    alloc.free([a])
    assert alloc.lookup_prefix(1234) == a and alloc.ref_counts[a] == 1
    alloc.free([a])
    alloc.allocate(2)  # reuses a for new contents: its hash must be forgotten
    assert alloc.lookup_prefix(1234) is None


@pytest.mark.parametrize("seed", range(5))
def test_allocator_invariants_hold_under_random_operations(seed):
    rng = random.Random(seed)
    num_blocks = 32
    alloc = BlockAllocator(num_blocks, 8)
    owners: list[list[int]] = []  # each owner holds one reference to each of its blocks
    for _ in range(2000):
        op = rng.random()
        if op < 0.35:
            n = rng.randint(0, 6)
            if alloc.can_allocate(n):
                blocks = alloc.allocate(n)
                held = {b for o in owners for b in o}
                assert not held & set(blocks), "a block in use was handed out again"
                owners.append(blocks)
            else:
                with pytest.raises(OutOfBlocksError):
                    alloc.allocate(n)
        elif op < 0.55 and owners:
            shared = rng.choice(owners)[: rng.randint(0, 3)]
            alloc.share(shared)
            owners.append(list(shared))
        elif op < 0.65 and owners:
            block = rng.choice(rng.choice(owners) or [None])
            if block is not None:
                alloc.register_prefix(block, rng.randint(0, 10))
        elif op < 0.75:
            block = alloc.lookup_prefix(rng.randint(0, 10))
            if block is not None:
                owners.append([block])
        elif owners:
            alloc.free(owners.pop(rng.randrange(len(owners))))
        # invariants: ref counts equal the references held; free list = blocks with no reference
        expected = [0] * num_blocks
        for o in owners:
            for b in o:
                expected[b] += 1
        assert alloc.ref_counts == expected
        assert alloc.num_free == expected.count(0)
    for o in owners:
        alloc.free(o)
    assert alloc.num_free == num_blocks and not any(alloc.ref_counts)
