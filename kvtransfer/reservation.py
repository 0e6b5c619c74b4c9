"""The decode side's book of blocks reserved for KV that a prefill worker will send.

Ownership: the decode engine thread owns the BlockPool. It allocates blocks, then `add`s a reservation;
it `pop`s a reservation, then frees (release) or keeps (commit) its blocks. This table never allocates or
frees a block; it only says which blocks a transfer may write and when they have all arrived.

What a caller may rely on:
- reservation ids are positive, unique within a table and never reused; they start at a random offset
  below 2**52 (int64- and JSON-safe) so a sender talking to a restarted worker is unlikely to hit a live id;
- `write` copies into the cache only while the reservation is live, and `pop` waits for a write in progress,
  so once `pop` (or `pop_expired`) returns no write can land in those blocks again;
- a reservation expires at `expires_at_s` (the table's clock); on completion it becomes a short lease:
  its deadline moves to now + `complete_grace_s` (COMMIT_LEASE_S), so a commit right after the transfer is
  not lost to the original deadline, while a commit that never comes (the router died, or moved the request
  away from a worker that could not answer its Release) frees the blocks within seconds, not a long TTL;
- every `(layer, block)` counts once, however often it is rewritten; `complete` turns true exactly when the
  last one arrives.

Locks: the table lock guards the id map; each reservation's own lock guards its state and its blocks'
writes, so writes into different reservations run in parallel. Order: table lock, then reservation lock.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtransfer.errors import ReservationExpired, TransferError, TransferTimeout


@dataclass
class Reservation:
    reservation_id: int
    request_id: str
    block_ids: list[int]  # the receiver's block ids, in block-table order
    num_tokens: int  # prompt tokens whose KV will arrive
    expires_at_s: float  # deadline on the table's clock
    num_layers: int
    received: bytearray = field(init=False, repr=False)  # [num_layers * len(block_ids)] 0/1, layer-major
    num_received: int = 0  # distinct (layer, block) pairs written
    error: str | None = None
    error_kind: type[TransferError] = TransferError
    complete: bool = False
    popped: bool = False
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.received = bytearray(self.num_layers * len(self.block_ids))

    @property
    def num_expected(self) -> int:
        return self.num_layers * len(self.block_ids)


# The router calls Decode as soon as Prefill returns, which is once the KV is complete: seconds are plenty.
COMMIT_LEASE_S = 10.0


class ReservationTable:
    def __init__(self, num_layers: int, clock: Callable[[], float] = time.monotonic,
                 complete_grace_s: float = COMMIT_LEASE_S):
        if num_layers < 1:
            raise ValueError(f"num_layers={num_layers} is invalid: must be >= 1")
        self.num_layers = num_layers
        self.complete_grace_s = complete_grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._reservations: dict[int, Reservation] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._reservations)

    def add(self, request_id: str, block_ids: list[int], num_tokens: int, ttl_s: float, *,
            reservation_id: int | None = None) -> Reservation:
        """Register blocks the caller already allocated; a transfer may write them for `ttl_s` seconds.
        `reservation_id` forces the id (a tensor-parallel follower rank mirrors rank 0's reservations)."""
        if not block_ids:
            raise ValueError("block_ids is empty: a reservation needs >= 1 block")
        if len(set(block_ids)) != len(block_ids) or min(block_ids) < 0:
            raise ValueError(f"block_ids={block_ids} is invalid: must be distinct ids >= 0")
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens} is invalid: must be >= 1")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s={ttl_s} is invalid: must be > 0")
        if reservation_id is not None and not (isinstance(reservation_id, int) and reservation_id >= 1):
            raise ValueError(f"reservation_id={reservation_id!r} is invalid: must be an int >= 1")
        with self._lock:
            if reservation_id in self._reservations:
                raise ValueError(f"reservation_id={reservation_id} is invalid: already in the table")
            rid = self._unguessable_id() if reservation_id is None else reservation_id
            reservation = Reservation(rid, request_id, list(block_ids), num_tokens, self._clock() + ttl_s,
                                      self.num_layers)
            self._reservations[reservation.reservation_id] = reservation
        return reservation

    def _unguessable_id(self) -> int:
        """Under the lock: a random id in [1, 2**53) that no live reservation has (53 bits: exact in any JSON
        reader). Random, not counted, so nobody can name (write into, attach to, release) a reservation whose
        id they were not given."""
        while True:
            rid = 1 + secrets.randbelow(2**53 - 1)
            if rid not in self._reservations:
                return rid

    def _live(self, reservation_id: int) -> Reservation:
        """Look up under the table lock; raises ReservationExpired if unknown (never added, or popped)."""
        reservation = self._reservations.get(reservation_id)
        if reservation is None:
            raise ReservationExpired(f"reservation {reservation_id} is unknown or was released")
        return reservation

    def _check_writable(self, r: Reservation) -> None:
        """Under r's lock."""
        if r.popped:
            raise ReservationExpired(f"reservation {r.reservation_id} was released")
        if self._clock() >= r.expires_at_s:
            raise ReservationExpired(f"reservation {r.reservation_id} (request {r.request_id}) expired "
                                     f"{self._clock() - r.expires_at_s:.3f} s ago")
        if r.error is not None:
            raise r.error_kind(f"reservation {r.reservation_id} failed earlier: {r.error}")

    def write(self, reservation_id: int, layer_start: int, layer_end: int, block_start: int, num_blocks: int,
              write_fn: Callable[[list[int]], None]) -> None:
        """Call `write_fn(dst_block_ids)` to copy layers [layer_start, layer_end) of blocks
        block_ids[block_start : block_start + num_blocks] into the cache, and record them as received.

        Raises ReservationExpired (unknown, popped or expired: nothing is written), ValueError (ranges outside
        the reservation), or the reservation's earlier error. If write_fn raises, nothing is marked received.
        """
        with self._lock:
            r = self._live(reservation_id)
            r._cond.acquire()  # table lock -> reservation lock; held across write_fn so pop() waits for it
        try:
            self._check_writable(r)
            if not 0 <= layer_start < layer_end <= self.num_layers:
                raise ValueError(f"layers [{layer_start}, {layer_end}) are invalid: must be a non-empty range "
                                 f"within [0, {self.num_layers})")
            if not (0 <= block_start and num_blocks >= 1 and block_start + num_blocks <= len(r.block_ids)):
                raise ValueError(f"blocks [{block_start}, {block_start + num_blocks}) are invalid: must be a "
                                 f"non-empty range within the reservation's [0, {len(r.block_ids)})")
            write_fn(r.block_ids[block_start : block_start + num_blocks])
            stride = len(r.block_ids)
            for layer in range(layer_start, layer_end):
                row = layer * stride
                for i in range(row + block_start, row + block_start + num_blocks):
                    if not r.received[i]:
                        r.received[i] = 1
                        r.num_received += 1
            if r.num_received == r.num_expected and not r.complete:
                r.complete = True
                # the commit (Decode) gets a short lease of its own; a commit that never comes frees the blocks
                r.expires_at_s = self._clock() + self.complete_grace_s
                r._cond.notify_all()
        finally:
            r._cond.release()

    def fail(self, reservation_id: int, error: str, kind: type[TransferError] = TransferError) -> None:
        """Mark the reservation failed (e.g. kind=ChecksumMismatch): waiters and later writes get `kind(error)`.
        Unknown ids are ignored (the reservation may have been popped meanwhile)."""
        with self._lock:
            r = self._reservations.get(reservation_id)
            if r is None:
                return
            r._cond.acquire()
        try:
            if r.error is None:
                r.error, r.error_kind = error, kind
            r._cond.notify_all()
        finally:
            r._cond.release()

    def wait_complete(self, reservation_id: int, timeout_s: float) -> Reservation:
        """Block until every (layer, block) arrived and return the reservation (still in the table: pop it).

        Raises TransferTimeout after `timeout_s` (real seconds), ReservationExpired if it is unknown, popped or
        expires meanwhile, or the error it was failed with (ChecksumMismatch, ...)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            r = self._live(reservation_id)
        with r._cond:
            while True:
                if r.error is not None:
                    raise r.error_kind(f"reservation {reservation_id} failed: {r.error}")
                if r.complete:
                    return r
                if r.popped:
                    raise ReservationExpired(f"reservation {reservation_id} was released while waiting")
                now_clock = self._clock()
                if now_clock >= r.expires_at_s:
                    raise ReservationExpired(f"reservation {reservation_id} expired with "
                                             f"{r.num_received}/{r.num_expected} (layer, block)s received")
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise TransferTimeout(f"reservation {reservation_id}: {r.num_received}/{r.num_expected} "
                                          f"(layer, block)s received after {timeout_s} s")
                r._cond.wait(min(remaining_s, r.expires_at_s - now_clock))

    def _retire(self, r: Reservation) -> None:
        """After removal from the map: wait for a write in progress, then refuse all later ones."""
        with r._cond:
            r.popped = True
            r._cond.notify_all()

    def pop(self, reservation_id: int) -> Reservation | None:
        """Remove the reservation (commit or release); None if already gone. Idempotent."""
        with self._lock:
            r = self._reservations.pop(reservation_id, None)
        if r is not None:
            self._retire(r)
        return r

    def pop_expired(self) -> list[Reservation]:
        """Remove and return reservations past their deadline (a complete one's deadline moved to
        completion + complete_grace_s); the caller frees their blocks."""
        now = self._clock()
        with self._lock:
            expired = [r for r in self._reservations.values() if now >= r.expires_at_s]
            for r in expired:
                del self._reservations[r.reservation_id]
        for r in expired:
            self._retire(r)
        return expired
