"""The pool of KV-cache blocks: reference counts, the prefix cache, LRU eviction, KV events.

Every block is in exactly one state:

    in use      ref_count > 0                       held by one or more block tables (maybe cached too)
    cached      ref_count == 0, block_hash set      reusable by a prefix hit; evictable
    empty       ref_count == 0, no block_hash

Cached and empty blocks together form the free queue, oldest-freed first:

    head ─▶ [b7 cached] [b2 empty] [b9 cached] ... [b4 cached] ◀─ tail (most recently freed)

`allocate` takes from the head, evicting a cached block's hash (a `BlocksRemoved` event) only then,
so cached blocks survive until space is needed, least recently used first. `touch` pulls a cached
block out of the queue when a prefix hit reuses it. `free` appends at the tail.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from engine.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent

KVEventListener = Callable[[KVEvent], None]


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid: must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block_hash -> block_id
        self.epoch = int.from_bytes(os.urandom(8), "little") >> 1  # new per pool: a restart is visible
        self._sequence = 0
        self._listeners: list[KVEventListener] = []

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an `allocate` can hand out now (empty + cached-but-unreferenced)."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free_queue) / self.num_blocks

    def get_cached_block(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def cached_hashes(self) -> set[int]:
        return set(self._cached)

    def snapshot(self) -> tuple[int, int, list[int]]:
        """(epoch, sequence of the last event, cached hashes): the state a consumer that lost events resyncs
        to; every event after it has a higher sequence."""
        return self.epoch, self._sequence, list(self._cached)

    # -- check-then-act --------------------------------------------------------------------------

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free_queue)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` from the head of the free queue, evicting their cached hashes."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"allocate({num_blocks}) with only {len(self._free_queue)} free blocks")
        block_ids = []
        evicted = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            block_ids.append(block_id)
        if evicted:
            self._emit(BlocksRemoved, block_hashes=tuple(evicted))
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit); unreferenced ones leave the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_queue[block_id]
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order; unreferenced ones join the tail.

        Callers pass a sequence's blocks last-first, so its tail blocks (the least shared) are
        evicted before its head blocks.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"free of block {block_id} with ref_count {block.ref_count}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_queue[block_id] = None

    def cache_blocks(
        self, block_ids: Sequence[int], block_hashes: Sequence[int], parent_hash: int, token_ids: Sequence[int]
    ) -> int:
        """Register full, computed blocks under their chained hashes; returns how many were new.

        A hash that is already cached (another block computed the same prefix at the same time) keeps
        its first block: the duplicate stays uncached and becomes empty when freed.
        """
        if not self.enable_caching or not block_ids:
            return 0
        assert len(block_ids) == len(block_hashes) and len(token_ids) == len(block_ids) * self.block_size
        stored_hashes: list[int] = []
        stored_tokens: list[int] = []
        stored_parent = parent_hash
        num_new = 0
        for i, (block_id, block_hash) in enumerate(zip(block_ids, block_hashes)):
            block = self.blocks[block_id]
            if block_hash in self._cached or block.block_hash is not None:
                if stored_hashes:  # keep each event one contiguous chain
                    self._emit_stored(stored_hashes, stored_parent, stored_tokens)
                    stored_hashes, stored_tokens = [], []
                stored_parent = block_hash
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block_id
            num_new += 1
            stored_hashes.append(block_hash)
            stored_tokens.extend(token_ids[i * self.block_size : (i + 1) * self.block_size])
        if stored_hashes:
            self._emit_stored(stored_hashes, stored_parent, stored_tokens)
        return num_new

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use stay in use); emits `AllBlocksCleared`."""
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        self._emit(AllBlocksCleared)

    # -- events ----------------------------------------------------------------------------------

    def subscribe(self, listener: KVEventListener) -> None:
        """Call `listener(event)` for every event from now on, synchronously, in order."""
        self._listeners.append(listener)

    def unsubscribe(self, listener: KVEventListener) -> None:
        self._listeners.remove(listener)

    def _emit_stored(self, hashes: list[int], parent: int, tokens: list[int]) -> None:
        self._emit(
            BlocksStored,
            block_hashes=tuple(hashes),
            parent_block_hash=parent,
            token_ids=tuple(tokens),
            block_size=self.block_size,
        )

    def _emit(self, kind: type[KVEvent], **fields: object) -> None:
        self._sequence += 1
        if not self._listeners:
            return
        event = kind(epoch=self.epoch, sequence=self._sequence, **fields)
        for listener in self._listeners:
            listener(event)

    # -- integrity -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert the accounting: every block in exactly one state, queue and cache map consistent."""
        in_use = cached = empty = 0
        for block in self.blocks:
            if block.ref_count < 0:
                raise AssertionError(f"block {block.block_id} has ref_count {block.ref_count}")
            queued = block.block_id in self._free_queue
            if block.ref_count > 0:
                in_use += 1
                if queued:
                    raise AssertionError(f"block {block.block_id} is in use and in the free queue")
            else:
                if not queued:
                    raise AssertionError(f"block {block.block_id} is unreferenced but not in the free queue")
                if block.block_hash is None:
                    empty += 1
                else:
                    cached += 1
            if block.block_hash is not None and self._cached.get(block.block_hash) != block.block_id:
                raise AssertionError(f"block {block.block_id} has hash {block.block_hash} not mapped to it")
        for block_hash, block_id in self._cached.items():
            if self.blocks[block_id].block_hash != block_hash:
                raise AssertionError(f"cache maps {block_hash} to block {block_id} holding another hash")
        if in_use + cached + empty != self.num_blocks:
            raise AssertionError(f"in_use {in_use} + cached {cached} + empty {empty} != {self.num_blocks}")
        if cached + empty != len(self._free_queue):
            raise AssertionError(f"free queue holds {len(self._free_queue)}, expected {cached + empty}")
