"""KV-cache events: what a worker's prefix cache gained or lost, for the router's index.

Every event carries the pool's `epoch` (new each time a pool is made, so a restart is visible) and a
`sequence` number that grows by one per event within an epoch, so a consumer can tell a gap (lost
events: resync that worker) from an ordinary stream.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class KVEvent:
    epoch: int
    sequence: int


@dataclass(frozen=True, kw_only=True)
class BlocksStored(KVEvent):
    """Blocks now cached, in chain order: block_hashes[0]'s parent is parent_block_hash."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int
    token_ids: tuple[int, ...]  # block_size tokens per block, concatenated
    block_size: int


@dataclass(frozen=True, kw_only=True)
class BlocksRemoved(KVEvent):
    """Blocks no longer cached (evicted to make room, or dropped)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class AllBlocksCleared(KVEvent):
    """The whole prefix cache was dropped."""
