"""The decode worker's gRPC service: Reserve takes a request and blocks for its prompt's KV (Release gives
them back), then Decode attaches to that reservation with the first token and streams the rest of the
answer from the running batch (or, `prefill_locally`, computes the uncached prompt here and streams from the
first token on: conditional disaggregation). The request (prompt, sampling, salt) comes once, in Reserve; it was
validated by the router, and is only guarded here against this worker's own limits (workers.proto: Trust).

Status codes: RESOURCE_EXHAUSTED with `grpc-retry-pushback-ms` (no room to reserve), INVALID_ARGUMENT,
FAILED_PRECONDITION (reservation unknown, expired or released), DATA_LOSS (KV checksum mismatch),
DEADLINE_EXCEEDED (the KV did not arrive in time). A cancelled Decode aborts the request and frees its blocks.
"""

from __future__ import annotations

import logging
import queue
import time

import grpc

from cluster.grpc_plumbing import REQUEST_FAULT
from cluster.internal_tls import kv_receiver_tls
from cluster.proto_convert import logprobs_to_proto, sampling_from_proto
from cluster.registry import WorkerLoad
from decode_worker.decode_loop import DecodeLoop, ReservedRequest
from duet.internal.v1 import workers_pb2 as wpb
from duet.internal.v1 import workers_pb2_grpc as wpb_grpc
from engine.errors import ExceedsContextError, InvalidRequestError
from engine.kv_cache_manager import cdiv
from engine.validation import check_request, check_token_ids, check_token_ids_fast
from kvtransfer.errors import ChecksumMismatch, ReservationExpired, TransferError, TransferTimeout
from kvtransfer.receiver import KVReceiver
from kvtransfer.reservation import ReservationTable
from worker.process import WorkerConfig, WorkerProcess, abort_with, remaining_s

log = logging.getLogger("duet.decode")
MAX_RESERVATION_TTL_S = 300.0
DEFAULT_RESERVATION_TTL_S = 30.0
RETRY_PUSHBACK_MS = 200
DEFAULT_TIMEOUT_S = 3600.0


class DecodeWorker(WorkerProcess, wpb_grpc.DecodeWorkerServicer):
    service_names = ("duet.internal.v1.DecodeWorker",)

    def __init__(self, config: WorkerConfig):
        super().__init__(config)
        self.reservations = ReservationTable(self.layout.num_layers)
        if self.rt.draft_ships_kv:
            self.rt.drafter.receives_kv = True  # the draft's prompt KV arrives with the target's
        self.receiver = KVReceiver(self.layout, self.rt.transfer_caches, self.reservations, host=config.host,
                                   port=config.kv_port, handshake_key=self.kv_handshake_key,
                                   **kv_receiver_tls(self.internal_tls))
        self.rank_kv_addresses: list[str] = []  # tensor parallelism: ranks 1..N-1's receivers, in rank order
        if self.tp_store is not None:
            from decode_worker.tp_rank import kv_address_key

            self.rank_kv_addresses = [self.tp_store.get(kv_address_key(r)).decode() for r in range(1, self.tp_size)]
        self.loop = DecodeLoop(self.rt, self.reservations, on_token_gap=self.metrics.inter_token_s.observe,
                               on_step_tokens=self.metrics.observe_step)

    def add_services(self, server: grpc.Server) -> None:
        wpb_grpc.add_DecodeWorkerServicer_to_server(self, server)

    def start_engine(self) -> None:
        self.receiver.start()
        self.loop.start()

    def stop_engine(self) -> None:
        self.loop.stop()
        self.receiver.close()

    def kv_address(self) -> str:
        host = f"[{self.advertise_host}]" if ":" in self.advertise_host else self.advertise_host
        return f"{host}:{self.receiver.port}"

    def load(self) -> WorkerLoad:
        core = self.loop.core
        return WorkerLoad(
            num_waiting=core.num_waiting + len(self.reservations), num_running=core.num_running,
            num_free_blocks=self.rt.block_pool.num_free_blocks, num_waiting_tokens=self.loop.num_waiting_tokens,
            prefill_tokens_per_s=round(self.loop.local_prefill_speed.tokens_per_s, 1),
        )

    def role_stats(self) -> dict[str, int]:
        return {"num_reservations": len(self.reservations), "num_waiting_tokens": self.loop.num_waiting_tokens}

    # -- RPCs ------------------------------------------------------------------------------------

    def Reserve(self, request: wpb.ReserveRequest, context: grpc.ServicerContext) -> wpb.ReserveResponse:
        prompt, history = list(request.prompt_token_ids), tuple(request.output_token_ids)
        n = len(prompt) + len(history)
        try:
            params = sampling_from_proto(request.sampling)
            check_request(prompt, params, vocab_size=self.rt.model_config.vocab_size,
                          max_model_len=self.rt.max_model_len, max_logprobs=self.rt.config.max_logprobs, routed=True)
            check_token_ids_fast("output_token_ids", history, self.rt.model_config.vocab_size)
            if params.structured_output is not None:  # compiled here, not on the engine thread
                self.rt.grammar_compiler.prepare(params.structured_output)
        except ExceedsContextError as e:  # the router's limit is above this worker's: another may hold it
            abort_with(context, grpc.StatusCode.FAILED_PRECONDITION, f"decode worker {self.worker_id}: {e}")
        except InvalidRequestError as e:
            abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        ttl_s = request.ttl_s or DEFAULT_RESERVATION_TTL_S
        if not 0 < ttl_s <= MAX_RESERVATION_TTL_S:
            abort_with(context, grpc.StatusCode.INVALID_ARGUMENT,
                       f"ttl_s={ttl_s} is invalid: must be in (0, {MAX_RESERVATION_TTL_S}]")
        num_blocks = cdiv(n, self.rt.block_size)
        if num_blocks > self.rt.block_pool.num_blocks - 1:  # reserve() keeps one block free for the batch
            abort_with(context, grpc.StatusCode.FAILED_PRECONDITION,
                       f"{n} tokens need {num_blocks} KV blocks: decode worker {self.worker_id} holds "
                       f"at most {self.rt.block_pool.num_blocks - 1} for one request, even when idle")
        reserved = ReservedRequest(request.request_id, prompt, params, request.cache_salt, history)
        cached = self.loop.thread.call(self.loop.reserve, reserved, ttl_s)
        if cached is not None and not context.is_active():  # the caller gave up: nobody will use it
            self.loop.thread.post(self.loop.release, cached.reservation.reservation_id)
            abort_with(context, grpc.StatusCode.CANCELLED, f"reserve for {request.request_id}: the caller left")
        if cached is None:
            context.set_trailing_metadata((("grpc-retry-pushback-ms", str(RETRY_PUSHBACK_MS)),))
            abort_with(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"decode worker {self.worker_id} has no room for {n} prompt tokens now; retry later")
        reservation = cached.reservation
        return wpb.ReserveResponse(reservation_id=reservation.reservation_id, kv_address=self.kv_address(),
                                   num_blocks=len(reservation.block_ids),
                                   kv_addresses=[self.kv_address(), *self.rank_kv_addresses],
                                   num_cached_blocks=cached.num_cached_blocks)

    def Release(self, request: wpb.ReleaseRequest, context: grpc.ServicerContext) -> wpb.ReleaseResponse:
        if request.reservation_id:
            return wpb.ReleaseResponse(found=self.loop.thread.call(self.loop.release, request.reservation_id))
        return wpb.ReleaseResponse(found=self.loop.thread.call(self.loop.release_request, request.request_id))

    def Decode(self, request: wpb.DecodeRequest, context: grpc.ServicerContext):
        if request.prefill_locally:
            sink: queue.SimpleQueue = queue.SimpleQueue()
            yield from self._stream(self._start_local(request.reservation_id, sink, context), sink, context)
            return
        reservation_id = request.reservation_id
        try:
            check_token_ids("first_token_id", [request.first_token_id], self.rt.model_config.vocab_size)
        except InvalidRequestError as e:
            self.loop.thread.post(self.loop.release, reservation_id)
            abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            self.reservations.wait_complete(reservation_id, remaining_s(context, DEFAULT_RESERVATION_TTL_S))
        except TransferError as e:
            self.loop.thread.post(self.loop.release, reservation_id)
            code = {
                ChecksumMismatch: grpc.StatusCode.DATA_LOSS,
                TransferTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
                ReservationExpired: grpc.StatusCode.FAILED_PRECONDITION,
            }.get(type(e), grpc.StatusCode.ABORTED)
            abort_with(context, code, f"KV of reservation {reservation_id} not usable: {e}")

        sink: queue.SimpleQueue = queue.SimpleQueue()
        try:
            request_id = self.loop.thread.call(self.loop.start_request, reservation_id, request.first_token_id,
                                               sink).request_id
        except ReservationExpired as e:
            abort_with(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            self.loop.thread.post(self.loop.release, reservation_id)
            abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        yield from self._stream(request_id, sink, context)

    def _start_local(self, reservation_id: int, sink: queue.SimpleQueue, context: grpc.ServicerContext) -> str:
        """Conditional disaggregation: the reserved request is prefilled here (DecodeRequest.prefill_locally);
        returns its id, its events going to `sink`."""
        try:
            return self.loop.thread.call(self.loop.start_local, reservation_id, sink).request_id
        except ReservationExpired as e:
            abort_with(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:  # the reservation is released already
            abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _stream(self, request_id: str, sink: queue.SimpleQueue, context: grpc.ServicerContext):
        """The request's tokens as DecodeResponses, coalescing what is ready; a cancelled call aborts it."""
        started_s = time.monotonic()  # its decode phase: the KV and the first token are here
        if not context.add_callback(lambda: self.loop.thread.post(self.loop.abort, request_id)):
            self.loop.thread.post(self.loop.abort, request_id)  # cancelled before we got here
            return

        while True:
            try:
                event = sink.get(timeout=min(1.0, remaining_s(context, DEFAULT_TIMEOUT_S)) or 0.001)
            except queue.Empty:
                if not context.is_active() or not self.loop.thread.alive:
                    self.loop.thread.post(self.loop.abort, request_id)
                    abort_with(context, grpc.StatusCode.UNAVAILABLE, f"request {request_id}: decode stopped")
                if remaining_s(context, DEFAULT_TIMEOUT_S) <= 0:
                    self.loop.thread.post(self.loop.abort, request_id)
                    abort_with(context, grpc.StatusCode.DEADLINE_EXCEEDED, f"request {request_id}: deadline passed")
                continue
            if event.error is not None:
                abort_with(context, grpc.StatusCode.INTERNAL, f"request {request_id} failed: {event.error}",
                           fault=REQUEST_FAULT)
            reply = wpb.DecodeResponse(finish_reason=event.finish_reason or "")
            events = [event]
            while not event.finish_reason:  # coalesce what is already there into one message
                try:
                    event = sink.get_nowait()
                except queue.Empty:
                    break
                if event.error is not None:  # sent with the next message
                    sink.put(event)
                    break
                events.append(event)
                reply.finish_reason = event.finish_reason or ""
            for ev in events:
                if ev.token_id is not None:
                    reply.token_ids.append(ev.token_id)
                    if ev.logprobs is not None:
                        reply.logprobs.append(logprobs_to_proto(ev.logprobs))
                if ev.stop_token_id is not None:
                    reply.stop_token_id = ev.stop_token_id
            if reply.finish_reason:
                self.metrics.decode_s.observe(time.monotonic() - started_s)
            yield reply
            if reply.finish_reason:
                return

