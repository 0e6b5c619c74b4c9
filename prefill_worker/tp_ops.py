"""What a tensor-parallel prefill worker's rank 0 asks its follower ranks to do, one class per operation.

    rank 0: PrefillFollowers.send_kv(entries)  ─ KVSends ──────▶  PrefillRankHooks.send_kv: ship these blocks'
                                                                   shards in the coming STEP
    rank 0: PrefillFollowers.forget(rid)       ─ ForgetRequest ─▶  PrefillRankHooks.forget: the request was
                                                                   aborted, nothing waits for its report

They cross as typed JSON (engine/follower_ops.py) through the engine's CALL (engine/tp_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.runtime import Runtime


@dataclass(frozen=True)
class KVSendEntry:
    """One request's blocks to ship in the coming step: blocks [first_block, first_block + len(block_ids)) of
    its prompt, held in this worker's `block_ids`, to the decode reservation `reservation_id`, rank r's shard
    to `endpoints[r]`."""
    request_id: str
    endpoints: tuple[str, ...]  # every decode rank's kvtransfer receiver, in rank order
    reservation_id: int
    first_block: int
    block_ids: tuple[int, ...]
    last: bool  # the prompt's last blocks: once they are sent, each rank reports the request's outcome

    def __post_init__(self) -> None:
        if self.first_block < 0 or not self.block_ids:
            raise ValueError(f"request {self.request_id}: first_block={self.first_block} (must be >= 0) with "
                             f"{len(self.block_ids)} block ids (must be >= 1)")


@dataclass(frozen=True)
class KVSends:
    """The coming step's sends (empty: none; rank 0 also sends it to cancel a failed step's sends)."""
    entries: tuple[KVSendEntry, ...]


@dataclass(frozen=True)
class ForgetRequest:
    """Rank 0 aborted `request_id`: drop what this rank tracks for it; rank 0 no longer waits for its report."""
    request_id: str


PREFILL_OPS = (KVSends, ForgetRequest)


class PrefillFollowers:
    """Rank 0's handle on its follower ranks: one method per operation, each True iff every follower ran it.
    At tp_size 1 every method is True and sends nothing. Raises RuntimeError if a rank is gone."""

    def __init__(self, runtime: Runtime):
        self._runtime = runtime

    def send_kv(self, entries: tuple[KVSendEntry, ...]) -> bool:
        return self._runtime.call_followers(KVSends(entries))

    def forget(self, request_id: str) -> bool:
        return self._runtime.call_followers(ForgetRequest(request_id))
