"""Block pool: exact ids and eviction order, integrity under random use, KV events mirror the cache."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_pool import BlockPool
from engine.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored


def test_allocates_in_order_and_frees_to_the_tail():
    pool = BlockPool(num_blocks=4, block_size=2)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.free([1, 0])  # last block first
    pool.check_integrity()
    assert pool.num_free_blocks == 3
    assert pool.allocate(3) == [3, 1, 0]
    assert not pool.can_allocate(1)
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_cached_blocks_survive_until_space_is_needed_lru_first():
    pool = BlockPool(num_blocks=4, block_size=2)
    events = []
    pool.subscribe(events.append)
    a = pool.allocate(2)  # [0, 1]
    pool.cache_blocks(a, [101, 102], parent_hash=100, token_ids=[1, 2, 3, 4])
    b = pool.allocate(1)  # [2]
    pool.cache_blocks(b, [201], parent_hash=200, token_ids=[5, 6])
    pool.free(reversed(a))  # queue: 3, 1, 0
    pool.free(b)  # queue: 3, 1, 0, 2
    pool.check_integrity()
    assert pool.num_cached_blocks == 3 and pool.num_free_blocks == 4
    assert pool.get_cached_block(101) == 0 and pool.get_cached_block(201) == 2
    # a hit pulls block 0 out of the queue; it is no longer evictable
    pool.touch([0])
    assert pool.num_free_blocks == 3
    # allocation takes the empty block 3 first, then evicts cached 1 (hash 102), then 2 (hash 201)
    assert pool.allocate(1) == [3]
    assert pool.allocate(2) == [1, 2]
    assert pool.get_cached_block(102) is None and pool.get_cached_block(201) is None
    assert pool.get_cached_block(101) == 0
    pool.check_integrity()
    kinds = [(type(e).__name__, getattr(e, "block_hashes", ())) for e in events]
    assert kinds == [("BlocksStored", (101, 102)), ("BlocksStored", (201,)), ("BlocksRemoved", (102, 201))]
    assert [e.sequence for e in events] == [1, 2, 3] and len({e.epoch for e in events}) == 1
    assert events[0].parent_block_hash == 100 and events[0].token_ids == (1, 2, 3, 4)


def test_duplicate_hash_keeps_the_first_block_and_splits_the_event_chain():
    pool = BlockPool(num_blocks=4, block_size=1)
    events = []
    pool.subscribe(events.append)
    pool.cache_blocks(pool.allocate(1), [11], parent_hash=10, token_ids=[1])
    blocks = pool.allocate(3)  # [1, 2, 3]
    assert pool.cache_blocks(blocks, [11, 12, 13], parent_hash=10, token_ids=[1, 2, 3]) == 2
    assert pool.get_cached_block(11) == 0 and pool.blocks[1].block_hash is None
    assert events[-1].block_hashes == (12, 13) and events[-1].parent_block_hash == 11
    pool.free(reversed(blocks))
    pool.check_integrity()


def test_reset_prefix_cache_clears_and_announces():
    pool = BlockPool(num_blocks=2, block_size=1)
    events = []
    pool.subscribe(events.append)
    pool.cache_blocks(pool.allocate(1), [5], parent_hash=4, token_ids=[9])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and isinstance(events[-1], AllBlocksCleared)
    pool.check_integrity()


def test_integrity_catches_a_double_free():
    pool = BlockPool(num_blocks=2, block_size=1)
    pool.free(pool.allocate(1))
    with pytest.raises(RuntimeError, match="ref_count 0"):
        pool.free([0])


class Mirror:
    """What the router's index does with events: a set of cached hashes per epoch."""

    def __init__(self):
        self.cached: set[int] = set()
        self.last_sequence = 0

    def __call__(self, event):
        assert event.sequence == self.last_sequence + 1, "gap in the event stream"
        self.last_sequence = event.sequence
        if isinstance(event, BlocksStored):
            assert not self.cached & set(event.block_hashes)
            self.cached |= set(event.block_hashes)
        elif isinstance(event, BlocksRemoved):
            assert set(event.block_hashes) <= self.cached
            self.cached -= set(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.cached.clear()


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "cache", "hit", "reset"]), st.integers(0, 7), st.integers(0, 30)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_use_keeps_integrity_and_the_mirror_in_sync(operations):
    pool = BlockPool(num_blocks=8, block_size=2)
    mirror = Mirror()
    pool.subscribe(mirror)
    held: list[list[int]] = []  # each entry: the blocks one owner holds, one reference each
    for op, n, h in operations:
        if op == "alloc" and pool.can_allocate(n):
            held.append(pool.allocate(n))
        elif op == "free" and held:
            pool.free(reversed(held.pop(n % len(held))))
        elif op == "cache" and held:
            blocks = held[n % len(held)]
            pool.cache_blocks(blocks, [1000 + h + i for i in range(len(blocks))], h, [h] * 2 * len(blocks))
        elif op == "hit":
            block_id = pool.get_cached_block(1000 + h)
            if block_id is not None:
                pool.touch([block_id])
                held.append([block_id])
        elif op == "reset":
            pool.reset_prefix_cache()
        pool.check_integrity()
        assert mirror.cached == pool.cached_hashes()
        assert sum(len(b) for b in held) == sum(b.ref_count for b in pool.blocks)
    for blocks in held:
        pool.free(blocks)
    pool.check_integrity()
    assert pool.num_free_blocks == 8
