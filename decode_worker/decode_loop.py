"""The decode worker's engine loop: reservations for arriving KV, then continuous batching.

    Reserve   ─▶ the prompt's leading blocks found in this worker's own prefix cache are held (touched), and
                 blocks allocated for the rest of its KV, held by a reservation (admission control: refused
                 when they would not fit next to the running requests); the request (prompt, sampling,
                 salt) waits with it, so it is sent to this worker once
    (KV arrives through kvtransfer into those blocks; the reservation completes)
    Decode    ─▶ attaches to the reservation: its blocks become the reserved request's block table; it
                 joins the running batch with the prefill worker's first token as output token 0, one token
                 left to compute
    Release / expiry ─▶ the blocks go back to the pool

Conditional disaggregation (the router's --local-prefill-tokens): for a short uncached suffix the router sends
Decode(reservation, prefill_locally) instead of a prefill worker: `start_local` releases the reservation and
adds its request as a plain prompt; the scheduler finds the cached leading blocks in the pool again (freed
just now, on this thread, they are still cached) and computes the suffix in the running batch, chunked like
any prompt. The reservation did the admission control; no KV arrives.

Decode-side prefix cache (multi-turn): a finished request's full blocks stay cached in the pool (LRU, evicted
only when an allocation needs the space) and its KV events reach the router's index like a prefill worker's.
A reservation's block table is therefore two parts:

    request's block table   [ h_0 .. h_{k-1} | r_0 .. r_{m-1} ]
                              cached here       the reservation's blocks: the KV transfer writes these only,
                              (touched at         reservation block i = request block k + i
                              Reserve)

`k` (`CachedReservation.num_cached_blocks`) goes back to the router, which tells the prefill worker to send
blocks from k on. The hits are this worker's real cache at Reserve time, not the index's guess, so a stale
index costs only transfer volume, never a wrong token.

Everything here runs on the engine thread (see worker.engine_thread); gRPC handlers post calls and read
each request's events from its own queue. Each step is one `EngineCore.step()`: KV arriving is
`add_transferred`, and the tokens a step gives a request are streamed as one event each.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

from decode_worker.tp_ops import DecodeFollowers
from engine.engine_core import EngineCore
from engine.kv_cache_manager import cdiv
from engine.request import Request, RequestStatus
from engine.runtime import Runtime
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from kvtransfer.errors import ReservationExpired
from kvtransfer.reservation import Reservation, ReservationTable
from worker.engine_thread import EngineThread
from worker.prefill_speed import PrefillSpeed

log = logging.getLogger("duet.decode")


@dataclass(frozen=True)
class DecodeEvent:
    token_id: int | None  # None on an abort with nothing new
    logprobs: TokenLogprobs | None
    finish_reason: str | None
    stop_token_id: int | None = None
    error: str | None = None  # finish_reason "error": the request failed on its own


@dataclass(frozen=True)
class ReservedRequest:
    """A request that Reserve carried: it waits with its reservation for the KV and the first token."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str = ""
    output_token_ids: tuple[int, ...] = ()  # a migrated request's tokens before the last one sent

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the reservation holds: the prompt, and a migrated request's earlier output."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def with_first_token(self, first_token_id: int, eos_token_ids: frozenset[int]) -> Request:
        """The engine request: its KV computed (it arrived), `first_token_id` as its latest output token (the
        prefill worker's first token, or the last one a migrated request sent before its worker was lost)."""
        return Request(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params, eos_token_ids=eos_token_ids, cache_salt=self.cache_salt,
            output_token_ids=[*self.output_token_ids, first_token_id], num_computed_tokens=self.num_tokens,
        )

    def to_prefill(self, eos_token_ids: frozenset[int]) -> Request:
        """The engine request as a plain prompt, nothing computed: prefilled here (conditional disaggregation)."""
        if self.output_token_ids:
            raise ValueError(f"request {self.request_id} carries {len(self.output_token_ids)} output tokens (a "
                             "migration): only a request without any is prefilled locally")
        return Request(request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
                       sampling_params=self.sampling_params, eos_token_ids=eos_token_ids, cache_salt=self.cache_salt)


@dataclass(frozen=True)
class CachedReservation:
    """Reserve's answer: the reservation for the blocks to transfer, after the leading blocks already cached here."""

    reservation: Reservation
    num_cached_blocks: int  # leading blocks of the request's KV held from this worker's prefix cache


class DecodeLoop:
    def __init__(self, runtime: Runtime, reservations: ReservationTable,
                 on_token_gap: Callable[[float], None] | None = None,
                 on_step_tokens: Callable[[int], None] | None = None):
        self.rt = runtime
        self.core = EngineCore.from_runtime(runtime)
        self._on_token_gap = on_token_gap  # seconds between a request's consecutive tokens (metrics)
        self._on_step_tokens = on_step_tokens  # tokens each step computed (metrics)
        self._last_token_s: dict[str, float] = {}
        self.reservations = reservations
        self._followers = DecodeFollowers(runtime)
        self._live: dict[str, tuple[Request, queue.SimpleQueue]] = {}
        self._reserved: dict[int, list[int]] = {}  # reservation id -> the request's block table: cached hits,
        # then the reservation's blocks (engine thread's view)
        self._reserved_requests: dict[int, ReservedRequest] = {}  # reservation id -> the request it waits for
        # local prefills (conditional disaggregation) before their first token: the request and its uncached tokens
        self._prefilling: dict[str, tuple[Request, int]] = {}
        self.num_waiting_tokens = 0  # their uncached prompt tokens not computed yet: what a new local prefill waits
        # behind (reported with the load, like a prefill worker's queue: router admission predicts from it)
        self.local_prefill_speed = PrefillSpeed()  # those tokens over the steps that computed them (reported too)
        self.thread = EngineThread(
            "decode-engine", self.core.has_unfinished_requests, self._step, tick=self._expire
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.thread.stop()

    # -- engine thread: reservations -------------------------------------------------------------

    def reserve(self, request: ReservedRequest, ttl_s: float) -> CachedReservation | None:
        """Blocks for the request's prompt KV that this worker's prefix cache lacks (the cached leading ones are
        held too), or None when admitting it would crowd out running requests. The request waits with the
        reservation until `start_request` (or release / expiry drops it)."""
        request_id, num_tokens = request.request_id, request.num_tokens
        core, pool, block_size = self.core, self.rt.block_pool, self.rt.block_size
        if core.num_requests + len(self.reservations) >= core.max_num_seqs:
            return None
        hit_block_ids = self._cached_prefix_blocks(request)
        num_new_blocks = cdiv(num_tokens, block_size) - len(hit_block_ids)  # >= 1: a hit leaves a token over
        # a hit block sitting unreferenced in the free queue stops being allocatable once held
        num_hit_free = sum(1 for b in hit_block_ids if pool.blocks[b].ref_count == 0)
        # keep one free block per running request so the batch can grow without preempting at once
        if pool.num_free_blocks - num_hit_free - num_new_blocks < core.num_running + 1:
            return None
        pool.touch(hit_block_ids)  # before allocating: allocation must not evict them
        block_ids = pool.allocate(num_new_blocks)
        num_new_tokens = num_tokens - len(hit_block_ids) * block_size
        reservation = self.reservations.add(request_id, block_ids, num_new_tokens, ttl_s)
        self._reserved[reservation.reservation_id] = [*hit_block_ids, *block_ids]
        self._reserved_requests[reservation.reservation_id] = request
        mirrored = self._followers.reserve(reservation.reservation_id, request_id, block_ids, num_new_tokens, ttl_s)
        if not mirrored:  # a follower rank refused: undo everywhere
            self.release(reservation.reservation_id)
            raise RuntimeError(f"reservation {reservation.reservation_id}: a tensor-parallel rank refused it")
        return CachedReservation(reservation, len(hit_block_ids))

    def _cached_prefix_blocks(self, request: ReservedRequest) -> list[int]:
        """The request's leading blocks (prompt, then a migrated request's output) cached here. With a draft
        model, the draft's KV in them is used where the drafter knows it holds these tokens (`Drafter.adopt`)."""
        token_ids = [*request.prompt_token_ids, *request.output_token_ids]
        return self.rt.kv_cache.cached_prefix_blocks(token_ids, request.cache_salt)

    def release(self, reservation_id: int) -> bool:
        reservation = self.reservations.pop(reservation_id)
        if reservation is None:
            return False
        self._free(reservation)
        return True

    def release_request(self, request_id: str) -> bool:
        """Release the reservation held for `request_id`, if any (its Reserve reply never reached the router)."""
        held = [rid for rid, r in self._reserved_requests.items() if r.request_id == request_id]
        return any([self.release(rid) for rid in held])

    def _free(self, reservation: Reservation) -> None:
        # followers first: once they popped it no write lands there, then the blocks may be reused
        self._followers.release(reservation.reservation_id)
        block_table = self._reserved.pop(reservation.reservation_id)
        del self._reserved_requests[reservation.reservation_id]
        self.rt.block_pool.free(reversed(block_table))  # tail first, as a finished request's
        self._check_idle()

    def _expire(self) -> None:
        for reservation in self.reservations.pop_expired():
            log.info("request=%s event=reservation_expired reservation=%d", reservation.request_id,
                     reservation.reservation_id)
            self._free(reservation)

    # -- engine thread: requests -----------------------------------------------------------------

    def start_request(self, reservation_id: int, first_token_id: int, sink: queue.SimpleQueue) -> Request:
        """The reserved request, with the prefill worker's first token, takes over its complete reservation's
        blocks and joins the batch; returns it (its events go to `sink`)."""
        reservation = self.reservations.pop(reservation_id)
        if reservation is None:
            raise ReservationExpired(f"reservation {reservation_id} is unknown, released or expired")
        request = self._reserved_requests[reservation_id].with_first_token(
            first_token_id, self.rt.tokenizer.eos_token_ids)
        if not reservation.complete:
            self._free(reservation)
            raise ReservationExpired(f"reservation {reservation_id} is not usable: its KV is incomplete")
        if not self._followers.commit(reservation_id):
            self._free(reservation)
            raise ReservationExpired(f"reservation {reservation_id}: the KV shard of a tensor-parallel rank is "
                                     "incomplete or failed")
        try:
            block_table = self._reserved[reservation_id]  # this pool's cached hits, then what the transfer wrote
            self.core.add_transferred(request, block_table, len(block_table) - len(reservation.block_ids))
        except ValueError:
            self._free(reservation)
            raise
        del self._reserved[reservation.reservation_id]  # the request's block table holds them now
        del self._reserved_requests[reservation.reservation_id]
        self._live[request.request_id] = (request, sink)
        self._last_token_s[request.request_id] = time.monotonic()
        return request

    def start_local(self, reservation_id: int, sink: queue.SimpleQueue) -> Request:
        """The reserved request prefilled here instead of by a prefill worker: its reservation is released and
        the request queued as a plain prompt (this worker's prefix cache supplies the leading blocks it holds);
        returns it (its events, from output token 0 on, go to `sink`). ReservationExpired if the reservation is
        gone; ValueError (the reservation released) if the request cannot be prefilled here."""
        reserved = self._reserved_requests.get(reservation_id)
        reservation = self.reservations.pop(reservation_id)
        if reservation is None or reserved is None:
            raise ReservationExpired(f"reservation {reservation_id} is unknown, released or expired")
        num_hit_blocks = len(self._reserved[reservation_id]) - len(reservation.block_ids)
        self._free(reservation)  # its hit blocks stay cached in the pool: the scheduler finds them again
        request = reserved.to_prefill(self.rt.tokenizer.eos_token_ids)
        self.core.add_request(request)
        self._live[request.request_id] = (request, sink)
        self._last_token_s[request.request_id] = time.monotonic()
        self._prefilling[request.request_id] = (request, request.num_tokens - num_hit_blocks * self.rt.block_size)
        self._count_waiting_tokens()
        return request

    def abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        self._last_token_s.pop(request_id, None)
        if self._prefilling.pop(request_id, None) is not None:
            self._count_waiting_tokens()
        if live is None:
            return
        sink = live[1]
        self.core.abort(request_id)
        sink.put(DecodeEvent(None, None, RequestStatus.FINISHED_ABORTED.finish_reason))
        self._check_idle()

    def _step(self) -> None:
        start_s, waiting_tokens = time.monotonic(), self.num_waiting_tokens
        new_tokens = self.core.step()
        now = time.monotonic()
        if self._on_step_tokens is not None:
            self._on_step_tokens(self.core.last_step_num_tokens)
        for new in new_tokens:
            self._prefilling.pop(new.request_id, None)  # its first token (or its failure): prefilled
            request, sink = self._live[new.request_id]
            if new.error is not None:  # this request's own sampling failed; the others go on
                del self._live[new.request_id]
                self._last_token_s.pop(new.request_id, None)
                sink.put(DecodeEvent(None, None, new.status.finish_reason, error=new.error))
                continue
            last = self._last_token_s.get(new.request_id)
            if last is not None and self._on_token_gap is not None:
                self._on_token_gap(now - last)
            self._last_token_s[new.request_id] = now
            finish_reason = None
            stop_token_id = None
            if new.finished:
                del self._live[new.request_id]
                self._last_token_s.pop(new.request_id, None)
                finish_reason = new.status.finish_reason
                stop_token_id = request.stop_reason if isinstance(request.stop_reason, int) else None
            last_index = len(new.token_ids) - 1
            for k, token_id in enumerate(new.token_ids):  # one event per token; the last one says how it ended
                logprobs = new.logprobs[k] if new.logprobs is not None else None
                if k < last_index:
                    sink.put(DecodeEvent(token_id, logprobs, None))
                else:
                    sink.put(DecodeEvent(token_id, logprobs, finish_reason, stop_token_id))
        if self._prefilling or self.num_waiting_tokens:
            self._count_waiting_tokens()
        if waiting_tokens:  # local prefill work this step computed (decode rows took part of its time)
            self.local_prefill_speed.observe(waiting_tokens - self.num_waiting_tokens, now - start_s)
        self._check_idle()

    def _count_waiting_tokens(self) -> None:
        """num_waiting_tokens: each local prefill's uncached tokens, less what its chunks computed so far (a request
        not scheduled yet has computed nothing, its cached prefix not found again until it is)."""
        self.num_waiting_tokens = sum(min(uncached, request.num_tokens - request.num_computed_tokens)
                                      for request, uncached in self._prefilling.values())

    def _check_idle(self) -> None:
        if self.core.has_unfinished_requests() or self._reserved:
            return
        pool = self.rt.block_pool
        if pool.num_free_blocks != pool.num_blocks:
            log.error("decode idle with %d blocks held: a leak", pool.num_blocks - pool.num_free_blocks)

    @property
    def reserved_block_ids(self) -> list[list[int]]:
        return list(self._reserved.values())

    def check_integrity(self) -> None:
        """Every block is held exactly by the request tables and reservations that claim it."""
        self.core.check_integrity(self.reserved_block_ids)
        if set(self._reserved_requests) != set(self._reserved):
            raise AssertionError(f"reservations {sorted(self._reserved)} hold blocks, requests wait on "
                                 f"{sorted(self._reserved_requests)}")
        if len(self._reserved) != len(self.reservations):
            raise AssertionError(f"{len(self._reserved)} reservations hold blocks, the table has "
                                 f"{len(self.reservations)}")
