"""The prefill worker's gRPC service: `Prefill` runs a prompt through the prefill loop, streams its KV to
the decode worker's reservation, and answers with the first token once the decode worker holds all of it.

Status codes: INVALID_ARGUMENT (bad request, field named), FAILED_PRECONDITION (layout mismatch or an
expired reservation), DATA_LOSS (checksum mismatch), UNAVAILABLE (decode worker gone), DEADLINE_EXCEEDED,
CANCELLED (the caller went away: the request is aborted and its blocks freed).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import TimeoutError as FutureTimeout

import grpc

from cluster.grpc_plumbing import KV_TARGET_FAULT, REQUEST_FAULT
from cluster.internal_tls import kv_sender_tls
from cluster.proto_convert import logprobs_to_proto, sampling_from_proto
from cluster.registry import WorkerLoad
from duet.internal.v1 import workers_pb2 as wpb
from duet.internal.v1 import workers_pb2_grpc as wpb_grpc
from engine.errors import ExceedsContextError, InvalidRequestError, RequestFailed
from engine.request import Request
from engine.speculative_config import SpeculativeConfig
from engine.validation import check_request, check_token_ids_fast
from kvtransfer.errors import (
    ChecksumMismatch,
    LayoutMismatch,
    PeerGone,
    ReservationExpired,
    TransferError,
    TransferTimeout,
)
from kvtransfer.sender import KVSender
from prefill_worker.follower_acks import FollowerAcks
from prefill_worker.prefill_loop import KVTarget, PrefillLoop, RequestAborted
from worker.process import WorkerConfig, WorkerProcess, abort_with, remaining_s

log = logging.getLogger("duet.prefill")
DEFAULT_TIMEOUT_S = 600.0

_TRANSFER_STATUS = {
    LayoutMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    ReservationExpired: grpc.StatusCode.FAILED_PRECONDITION,
    ChecksumMismatch: grpc.StatusCode.DATA_LOSS,
    PeerGone: grpc.StatusCode.UNAVAILABLE,
    TransferTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
}


# Failures of the decode side or of the path to it, not of this worker: the decode worker died or restarted
# (PeerGone, an unknown reservation), stopped acking (TransferTimeout), or bytes changed in flight.
_TARGET_FAULTS = (PeerGone, ReservationExpired, TransferTimeout, ChecksumMismatch)


def transfer_status(error: TransferError) -> grpc.StatusCode:
    return _TRANSFER_STATUS.get(type(error), grpc.StatusCode.UNAVAILABLE)


def abort_transfer(context: grpc.ServicerContext, what: str, endpoint: str, error: TransferError) -> None:
    """End Prefill for a failed KV connect or transfer, marked as the decode worker's fault when it is (the
    router then blames that worker and hands the request off again, grpc_plumbing.KV_TARGET_FAULT)."""
    abort_with(context, transfer_status(error), f"{what} to {endpoint}: {error}",
               fault=KV_TARGET_FAULT if isinstance(error, _TARGET_FAULTS) else None)


class PrefillWorker(WorkerProcess, wpb_grpc.PrefillWorkerServicer):
    service_names = ("duet.internal.v1.PrefillWorker",)

    def __init__(self, config: WorkerConfig):
        speculative = SpeculativeConfig.parse(config.engine.speculative_config)
        if speculative is not None and speculative.method != "draft_model":
            raise ValueError("--speculative-config is for decode workers: a prefill worker samples only a request's "
                             "first token (give it to `duet decode`, or to `duet up`, which passes it there); only a "
                             "draft_model one is taken here, to compute and ship the draft's prompt KV")
        super().__init__(config)
        # a prefill samples one token: no guesses, ever. A step that computes a request's last token alone looks like
        # a decode step to the scheduler, which then gives it guesses and the step returns several tokens (seen with
        # the re-prefill of a migrated request, which carries its history: the engine thread died on them).
        self.rt.scheduler.speculator = None
        if self.rt.draft_ships_kv:
            self.rt.drafter.shadows = True  # every chunk's draft KV, shipped after the target's layers
        self.sender = KVSender(self.layout, self.rt.transfer_caches, transport=config.kv_transport,
                               checksum=config.kv_checksum, handshake_key=self.kv_handshake_key,
                               **kv_sender_tls(self.internal_tls))
        self.acks = FollowerAcks(self.tp_store, list(range(1, self.tp_size))) if self.tp_store is not None else None
        self.loop = PrefillLoop(self.rt, self.sender.send, self.layout, config.layer_group_size,
                                self.acks, on_step_tokens=self.metrics.observe_step)

    def add_services(self, server: grpc.Server) -> None:
        wpb_grpc.add_PrefillWorkerServicer_to_server(self, server)

    def start_engine(self) -> None:
        self.loop.measure_speed()  # before serving: a fresh worker reports its speed from its first heartbeat
        self.loop.start()

    def stop_engine(self) -> None:
        self.loop.stop()
        self.sender.close()
        if self.acks is not None:
            self.acks.close()

    def load(self) -> WorkerLoad:
        core = self.loop.core
        return WorkerLoad(
            num_waiting=core.num_waiting, num_running=core.num_running,
            num_free_blocks=self.rt.block_pool.num_free_blocks,
            num_waiting_tokens=self.loop.num_waiting_tokens,
            prefill_tokens_per_s=round(self.loop.speed.tokens_per_s, 1),
        )

    def role_stats(self) -> dict[str, int]:
        return {"num_waiting_tokens": self.loop.num_waiting_tokens}

    # -- RPCs ------------------------------------------------------------------------------------

    def Prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext) -> wpb.PrefillResponse:
        try:
            params = sampling_from_proto(request.sampling)
            token_ids = list(request.prompt_token_ids)
            # validated by the router; guarded only against this worker's own limits (workers.proto: Trust)
            check_request(token_ids, params, vocab_size=self.rt.model_config.vocab_size,
                          max_model_len=self.rt.max_model_len, max_logprobs=self.rt.config.max_logprobs, routed=True)
            history = list(request.output_token_ids)  # a migrated request's earlier output
            check_token_ids_fast("output_token_ids", history, self.rt.model_config.vocab_size)
            if params.structured_output is not None:  # compiled here, not on the engine thread
                self.rt.grammar_compiler.prepare(params.structured_output)
        except ExceedsContextError as e:  # the router's limit is above this worker's
            abort_with(context, grpc.StatusCode.FAILED_PRECONDITION, f"prefill worker {self.worker_id}: {e}")
        except InvalidRequestError as e:
            abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        target = None
        if request.HasField("target"):
            endpoints = tuple(request.target.kv_addresses) or (request.target.kv_address,)
            try:
                target = KVTarget(endpoints[0], request.target.reservation_id, endpoints,
                                  request.target.num_cached_blocks)
            except ValueError as e:
                abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, f"target: {e}")
            if len(endpoints) != self.tp_size:
                abort_with(context, grpc.StatusCode.FAILED_PRECONDITION,
                           f"TP sizes differ: this prefill worker runs tp_size={self.tp_size}, the decode worker "
                           f"gave {len(endpoints)} KV endpoint(s) (tp_size={len(endpoints)}); KV moves rank to "
                           "rank, so prefill and decode workers need the same --tp")
            try:
                self.sender.connect(target.endpoint)
            except TransferError as e:
                abort_transfer(context, "kv connect", target.endpoint, e)
        engine_request = Request(
            request_id=request.request_id, prompt_token_ids=token_ids, sampling_params=params,
            eos_token_ids=self.rt.tokenizer.eos_token_ids, cache_salt=request.cache_salt, output_token_ids=history,
        )
        future = self.loop.submit(engine_request, target)
        if not context.add_callback(lambda: future.done() or self.loop.abort(request.request_id)):
            self.loop.abort(request.request_id)  # the caller went away before we got here
        try:
            result = future.result(timeout=remaining_s(context, DEFAULT_TIMEOUT_S))
        except FutureTimeout:
            self.loop.abort(request.request_id)
            abort_with(context, grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {request.request_id} timed out")
        except RequestAborted as e:
            abort_with(context, grpc.StatusCode.CANCELLED, str(e))
        except TransferError as e:
            abort_transfer(context, "kv transfer", target.endpoint, e)
        except ValueError as e:
            abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RequestFailed as e:
            abort_with(context, grpc.StatusCode.INTERNAL, str(e), fault=REQUEST_FAULT)
        except Exception as e:  # noqa: BLE001 - a failed step: say what, keep serving
            abort_with(context, grpc.StatusCode.INTERNAL, f"prefill of {request.request_id} failed: {e!r}")

        computed_s = time.monotonic()
        self.metrics.queue_s.observe(result.queue_s)
        self.metrics.prefill_s.observe(result.prefill_s)
        for transfer in result.transfers:
            try:
                transfer.result(timeout=remaining_s(context, DEFAULT_TIMEOUT_S))
            except FutureTimeout:  # the caller's deadline
                abort_with(context, grpc.StatusCode.DEADLINE_EXCEEDED, "kv transfer timed out")
            except TransferError as e:
                abort_transfer(context, "kv transfer", target.endpoint, e)
            except Exception as e:  # noqa: BLE001
                abort_with(context, grpc.StatusCode.INTERNAL, f"kv transfer to {target.endpoint} failed: {e!r}")
        if result.transfers:
            self.metrics.kv_transfer_s.observe(time.monotonic() - computed_s)
            self.metrics.kv_transfer_bytes.inc(result.kv_bytes)
        reply = wpb.PrefillResponse(
            first_token_id=result.token_id,
            cached_tokens=result.num_cached_tokens,
            finish_reason=result.finish_reason or "",
            queue_s=result.queue_s,
            prefill_s=result.prefill_s,
            transfer_s=time.monotonic() - computed_s,
            kv_bytes=result.kv_bytes,
            kv_transferred_tokens=result.kv_transferred_tokens,
        )
        if result.stop_token_id is not None:
            reply.stop_token_id = result.stop_token_id
        if result.logprobs is not None:
            reply.logprob.CopyFrom(logprobs_to_proto(result.logprobs))
        return reply

