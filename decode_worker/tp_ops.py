"""What a tensor-parallel decode worker's rank 0 asks its follower ranks to do, one class per operation: mirror
its reservations, so each rank's KVReceiver accepts its shard into the same blocks.

    rank 0: DecodeFollowers.reserve(...)  ─ ReserveBlocks ──────▶  DecodeRankHooks.reserve: add, same id
    rank 0: DecodeFollowers.release(id)   ─ ReleaseReservation ─▶  DecodeRankHooks.release: pop
    rank 0: DecodeFollowers.commit(id)    ─ CommitReservation ──▶  DecodeRankHooks.commit: pop; done iff complete

They cross as typed JSON (engine/follower_ops.py) through the engine's CALL (engine/tp_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.runtime import Runtime


@dataclass(frozen=True)
class ReserveBlocks:
    """Rank 0 reserved `block_ids` for `request_id`'s `num_tokens` of KV (its prompt, and a migrated request's
    tokens sent) for `ttl_s` seconds, under `reservation_id`: hold the same blocks under the same id here."""
    reservation_id: int
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    ttl_s: float


@dataclass(frozen=True)
class ReleaseReservation:
    """Rank 0 released or expired the reservation: once this returns, no write lands in its blocks here."""
    reservation_id: int


@dataclass(frozen=True)
class CommitReservation:
    """Rank 0 hands the reservation's blocks to a request: done only if this rank's shard arrived complete."""
    reservation_id: int


class DecodeFollowers:
    """Rank 0's handle on its follower ranks: one method per operation, each True iff every follower ran it.
    At tp_size 1 every method is True and sends nothing. Raises RuntimeError if a rank is gone."""

    def __init__(self, runtime: Runtime):
        self._runtime = runtime

    def reserve(self, reservation_id: int, request_id: str, block_ids: list[int], num_tokens: int,
                ttl_s: float) -> bool:
        return self._runtime.call_followers(ReserveBlocks(reservation_id, request_id, tuple(block_ids),
                                                          num_tokens, ttl_s))

    def release(self, reservation_id: int) -> bool:
        return self._runtime.call_followers(ReleaseReservation(reservation_id))

    def commit(self, reservation_id: int) -> bool:
        """True iff every follower rank's shard of the reservation arrived complete (it is popped everywhere)."""
        return self._runtime.call_followers(CommitReservation(reservation_id))
