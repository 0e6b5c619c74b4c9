"""The router: the public `duet.v1.Generation` service. Per request:

    validate + tokenize ─▶ pick decode D (load) ─▶ D.Reserve ─▶ pick prefill P ─▶ P.Prefill(target = D's
    reservation) ─▶ first token to the client ─▶ D.Decode ─▶ tokens to the client (detokenized here, stop
    strings cut here) ─▶ final message with usage and timing

Every downstream call gets the client's remaining deadline, and a client cancel (or `Abort`) cancels the
call in flight; workers abort the request and free its blocks. A reservation that will not be decoded is
released at once (it would expire on its own anyway). A worker that fails to answer is avoided for
a few seconds (router/worker_view.py), so new requests route around it before its registry entry expires.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from cluster import grpc_plumbing
from cluster.prefix_index import PrefixIndex
from cluster.proto_convert import sampling_to_proto
from cluster.registry import WorkerInfo, WorkerRegistry
from duet.internal.v1 import workers_pb2 as wpb
from duet.internal.v1 import workers_pb2_grpc as wpb_grpc
from duet.v1 import generation_pb2 as pb
from duet.v1 import generation_pb2_grpc as pb_grpc
from engine.config import ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.tokenizer import Tokenizer
from router.load_policy import rank_decode, without
from router.metrics import RouterMetrics
from router.prefill_chooser import PrefillChooser
from router.prefix_policy import PolicyConfig
from router.request_builder import BuiltRequest, ModelLimits, build_request
from router.request_stream import Failed, Live, abort_message, downstream_code, tokens_message
from router.worker_view import NoWorkers, WorkerView

log = logging.getLogger("duet.router")
RESERVE_TIMEOUT_S = 5.0
DEFAULT_TIMEOUT_S = 3600.0
SERVICE_NAME = "duet.v1.Generation"


@dataclass
class RouterConfig:
    """The router's settings; `duet router` flags map onto these fields."""

    redis_url: str
    model_dir: Path | None = None  # for the tokenizer, chat template and limits; None: the embedded tiny model
    model_id: str | None = None  # the workers' model id; None: the model directory's name
    host: str = "127.0.0.1"
    port: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_logprobs: int = 20
    reservation_ttl_s: float = 60.0  # reserve -> KV complete; Decode then has the worker's grace period
    max_concurrent_streams: int = 256
    auth_token: str | None = None
    http_port: int | None = None  # OpenAI-compatible HTTP (router/openai_http.py); None: off
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: off
    policy: PolicyConfig | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None


class Router(pb_grpc.GenerationServicer):
    def __init__(self, config: RouterConfig):
        self.config = config
        model_dir = config.model_dir
        if model_dir is None:
            from engine.tiny_model import default_model_dir

            model_dir = default_model_dir()
        self.tokenizer = Tokenizer.from_dir(model_dir)
        model_config = ModelConfig.from_dir(model_dir)
        self.model_id = config.model_id or Path(model_dir).resolve().name
        self.limits = ModelLimits(
            vocab_size=model_config.vocab_size,
            max_model_len=config.max_model_len or model_config.max_position_embeddings,
            max_logprobs=config.max_logprobs,
        )
        self.registry = WorkerRegistry.from_url(config.redis_url)
        self.metrics = RouterMetrics()
        self.index = PrefixIndex(self.registry.client, self.model_id)
        self.chooser = PrefillChooser(self.index, self.model_id, self.metrics, config.policy)
        self.view = WorkerView(self.registry, self.index, self.model_id, self.metrics)
        self._live: dict[str, Live] = {}
        self._lock = threading.Lock()

    # -- public RPCs -----------------------------------------------------------------------------

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        received_s = time.monotonic()
        try:
            built = build_request(request, self.tokenizer, self.limits)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        client_id = request.request_id or f"req-{uuid.uuid4().hex}"
        live = Live(client_id)
        with self._lock:
            if client_id in self._live:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"request_id={client_id!r} is invalid: must not be the id of a live request")
            self._live[client_id] = live
        if not context.add_callback(lambda: live.cancel(abort=False)):
            live.cancel(abort=False)  # the client is gone already
        status = "OK"
        try:
            yield from self._generate(client_id, built, request.cache_salt, live, context, received_s)
        except Failed as f:
            status = f.code.name
            if f.trailers:
                context.set_trailing_metadata(f.trailers)
            log.info("request=%s event=failed status=%s message=%s", client_id, f.code.name, f.message)
            context.abort(f.code, f.message)
        finally:
            self.metrics.requests.labels("CANCELLED" if live.cancelled else status).inc()
            with self._lock:
                self._live.pop(client_id, None)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        with self._lock:
            live = self._live.get(request.request_id)
        if live is not None:
            live.cancel(abort=True)
        return pb.AbortResponse(found=live is not None)

    def ExplainRoute(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.RouteExplanation:
        try:
            built = build_request(request, self.tokenizer, self.limits)
            prefills, decodes = self._workers()
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Failed as f:
            context.abort(f.code, f.message)
        choice = self._choose_prefill(built.prompt_token_ids, request.cache_salt, prefills, speculate=False)
        decode_id = rank_decode(self.view.candidates(decodes))[0]
        addresses = {info.worker_id: info.address for info, _, _ in prefills}
        return pb.RouteExplanation(
            prefill_worker=choice.worker.worker_id, branch=choice.decision.branch, decode_worker=decode_id,
            prompt_tokens=len(built.prompt_token_ids), block_size=choice.block_size,
            prompt_blocks=len(choice.block_hashes), index_available=choice.index_available,
            lookup_s=choice.lookup_s, decision_s=choice.decision_s,
            prefill=[pb.WorkerEstimate(worker_id=e.worker_id, address=addresses[e.worker_id],
                                       cached_tokens=e.cached_tokens, queued_tokens=e.queued_tokens,
                                       tokens_per_s=e.tokens_per_s, estimated_ttft_s=e.cost_s, busy=e.busy)
                     for e in choice.decision.estimates],
        )

    # -- one request -----------------------------------------------------------------------------

    def _generate(self, client_id: str, built: BuiltRequest, cache_salt: str, live: Live,
                  context: grpc.ServicerContext, received_s: float) -> Iterator[pb.GenerateResponse]:
        params = built.params
        internal_id = f"{client_id}@{uuid.uuid4().hex[:12]}"  # unique on the workers whatever clients send
        sampling = sampling_to_proto(params)
        prefills, decodes = self._workers()

        reserve_start_s = time.monotonic()
        decode, reservation = self._reserve(internal_id, len(built.prompt_token_ids), decodes, context)
        reserved_s = time.monotonic()
        prefills = self._compatible(prefills, decode, reservation)
        choice = self._choose_prefill(built.prompt_token_ids, cache_salt, prefills)
        prefill = choice.worker
        routed_tokens = len(built.prompt_token_ids) - choice.predicted_cached_tokens
        detok = IncrementalDetokenizer(
            self.tokenizer, built.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
        )
        timing = pb.Timing(reserve_s=reserved_s - reserve_start_s)
        usage = pb.Usage(prompt_tokens=len(built.prompt_token_ids))
        released = False  # until the decode worker ends the request, a failure path releases the reservation
        # (idempotent: once Decode took the reservation, Release finds nothing and the worker aborts the request)

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release(decode, reservation.reservation_id)

        try:
            self.view.track_tokens(prefill.worker_id, routed_tokens)
            try:
                first = self._prefill(prefill, internal_id, built, sampling, cache_salt, decode, reservation, live,
                                      context)
            finally:
                self.view.track_tokens(prefill.worker_id, -routed_tokens)
            self.metrics.prompt_tokens.inc(len(built.prompt_token_ids))
            self.metrics.predicted_cached.inc(choice.predicted_cached_tokens)
            self.metrics.actual_cached.inc(first.cached_tokens)
            timing.queue_s, timing.prefill_s, timing.transfer_s = first.queue_s, first.prefill_s, first.transfer_s
            usage.cached_tokens = first.cached_tokens
            first_sent_s = time.monotonic()
            timing.ttft_s = first_sent_s - received_s
            self.metrics.ttft_s.observe(timing.ttft_s)
            message, done = tokens_message(
                client_id, detok, [first.first_token_id],
                [first.logprob] if first.HasField("logprob") else [], first.finish_reason,
                first.stop_token_id if first.HasField("stop_token_id") else None, usage,
            )
            message.prefill_worker, message.decode_worker = prefill.worker_id, decode.worker_id
            if done:
                release()
                timing.e2e_s = time.monotonic() - received_s
                self.metrics.e2e_s.observe(timing.e2e_s)
                message.usage.CopyFrom(usage)
                message.timing.CopyFrom(timing)
                yield message
                return
            yield message

            decode_req = wpb.DecodeRequest(
                request_id=internal_id, reservation_id=reservation.reservation_id,
                prompt_token_ids=built.prompt_token_ids, first_token_id=first.first_token_id,
                sampling=sampling, cache_salt=cache_salt,
            )
            stub = wpb_grpc.DecodeWorkerStub(self.view.channel(decode.address))
            stream = stub.Decode(decode_req, timeout=self._remaining(context))
            live.set_call(stream)
            self.view.track_requests(decode.worker_id, +1)
            try:
                for reply in stream:
                    if timing.first_decode_s == 0 and reply.token_ids:
                        timing.first_decode_s = time.monotonic() - first_sent_s
                    message, done = tokens_message(
                        client_id, detok, list(reply.token_ids), list(reply.logprobs), reply.finish_reason,
                        reply.stop_token_id if reply.HasField("stop_token_id") else None, usage,
                    )
                    if reply.finish_reason:
                        released = True  # the request ran on the decode worker and ended there
                    if done:
                        stream.cancel()  # a stop string: the decode worker aborts and frees the blocks
                        timing.e2e_s = time.monotonic() - received_s
                        self.metrics.e2e_s.observe(timing.e2e_s)
                        message.usage.CopyFrom(usage)
                        message.timing.CopyFrom(timing)
                        yield message
                        return
                    if message.token_ids or message.text:
                        yield message
                raise Failed(grpc.StatusCode.INTERNAL, f"decode worker {decode.worker_id} ended the stream early")
            except grpc.RpcError as e:
                if live.aborted:
                    yield abort_message(client_id, detok, usage, timing, received_s)
                    return
                if live.cancelled:
                    return
                self.view.on_worker_error(decode, e)
                raise Failed(downstream_code(e), f"decode worker {decode.worker_id}: {e.details()}") from None
            finally:
                self.view.track_requests(decode.worker_id, -1)
        finally:
            release()

    # -- downstream calls ------------------------------------------------------------------------

    def _reserve(self, internal_id: str, num_prompt_tokens: int, decodes: list, context) -> tuple:
        ranked = without(rank_decode(self.view.candidates(decodes)), self.view.active_suspects())
        by_id = {info.worker_id: info for info, _, _ in decodes}
        exhausted, pushback_ms = [], 0
        for worker_id in ranked:
            info = by_id[worker_id]
            stub = wpb_grpc.DecodeWorkerStub(self.view.channel(info.address))
            try:
                reply = stub.Reserve(
                    wpb.ReserveRequest(request_id=internal_id, num_prompt_tokens=num_prompt_tokens,
                                       ttl_s=self.config.reservation_ttl_s),
                    timeout=min(RESERVE_TIMEOUT_S, self._remaining(context)),
                )
                return info, reply
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    exhausted.append(worker_id)
                    for key, value in e.trailing_metadata() or ():
                        if key == "grpc-retry-pushback-ms":
                            pushback_ms = max(pushback_ms, int(value))
                    continue
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise Failed(code, e.details()) from None
                if not context.is_active():
                    raise Failed(grpc.StatusCode.CANCELLED, "request cancelled") from None
                self.view.on_worker_error(info, e)  # unreachable or slow: try the next one
        if exhausted:
            raise Failed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no decode worker can admit {num_prompt_tokens} prompt tokens now ({len(exhausted)} full); "
                f"retry after {pushback_ms or 200} ms",
                (("grpc-retry-pushback-ms", str(pushback_ms or 200)),),
            )
        raise Failed(grpc.StatusCode.UNAVAILABLE, f"no decode worker for model {self.model_id} answered")

    def _prefill(self, prefill: WorkerInfo, internal_id, built, sampling, cache_salt, decode, reservation, live,
                 context) -> wpb.PrefillResponse:
        stub = wpb_grpc.PrefillWorkerStub(self.view.channel(prefill.address))
        future = stub.Prefill.future(
            wpb.PrefillRequest(
                request_id=internal_id, prompt_token_ids=built.prompt_token_ids, sampling=sampling,
                cache_salt=cache_salt,
                target=wpb.KVTarget(kv_address=reservation.kv_address, reservation_id=reservation.reservation_id,
                                    kv_addresses=reservation.kv_addresses),
            ),
            timeout=self._remaining(context),
        )
        live.set_call(future)
        self.view.track_requests(prefill.worker_id, +1)
        try:
            return future.result()
        except grpc.FutureCancelledError:
            raise Failed(grpc.StatusCode.CANCELLED, "request cancelled") from None
        except grpc.RpcError as e:
            if live.cancelled or live.aborted:
                raise Failed(grpc.StatusCode.CANCELLED, "request cancelled") from None
            self.view.on_worker_error(prefill, e)
            raise Failed(downstream_code(e), f"prefill worker {prefill.worker_id}: {e.details()}") from None
        finally:
            self.view.track_requests(prefill.worker_id, -1)

    def _release(self, decode: WorkerInfo, reservation_id: int) -> None:
        """Best effort: if the decode worker is unreachable, the reservation expires there on its own."""
        stub = wpb_grpc.DecodeWorkerStub(self.view.channel(decode.address))
        try:
            stub.Release(wpb.ReleaseRequest(reservation_id=reservation_id), timeout=2.0)
        except grpc.RpcError as e:
            log.info("worker=%s event=release_failed reservation=%d status=%s", decode.worker_id, reservation_id,
                     e.code().name)

    def _workers(self) -> tuple[list, list]:
        try:
            return self.view.workers()
        except NoWorkers as e:
            raise Failed(grpc.StatusCode.UNAVAILABLE, str(e)) from None

    def _compatible(self, prefills: list, decode, reservation) -> list:
        """The prefill workers whose KV layout (model, dtype, block size, TP size) the decode worker takes."""
        fits = [w for w in prefills if not w[0].kv_layout or not decode.kv_layout or w[0].kv_layout == decode.kv_layout]
        if prefills and not fits:
            self._release(decode, reservation.reservation_id)
            raise Failed(grpc.StatusCode.FAILED_PRECONDITION,
                         f"no prefill worker can send KV to decode worker {decode.worker_id} (tp_size="
                         f"{decode.tp_size}): prefill workers run tp_size {sorted({w[0].tp_size for w in prefills})} "
                         "or another KV layout; prefill and decode workers need the same --tp, dtype and block size")
        return fits

    def _choose_prefill(self, prompt: list[int], cache_salt: str, prefills: list, speculate: bool = True):
        return self.chooser.choose(prompt, cache_salt, self.view.healthy(prefills), self.view.inflight_tokens(),
                                   speculate=speculate)

    def _remaining(self, context: grpc.ServicerContext) -> float:
        remaining = context.time_remaining()  # None, or a huge number, when the client set no deadline
        return DEFAULT_TIMEOUT_S if remaining is None else max(0.001, min(remaining, DEFAULT_TIMEOUT_S))


class RouterServer:
    """The router process: the Generation service with health, reflection, optional auth and TLS."""

    def __init__(self, config: RouterConfig):
        self.router = Router(config)
        self.server = grpc_plumbing.make_server(config.max_concurrent_streams, grpc_plumbing.PUBLIC_MAX_MESSAGE_BYTES,
                                          config.auth_token)
        pb_grpc.add_GenerationServicer_to_server(self.router, self.server)
        self.health = grpc_plumbing.add_health_and_reflection(self.server, [SERVICE_NAME])
        self.port = grpc_plumbing.bind(self.server, config.host, config.port, config.tls_cert, config.tls_key)
        self.address = f"{config.host}:{self.port}"
        self.metrics_port = None
        if config.metrics_port is not None:
            self.metrics_port = self.router.metrics.serve(config.metrics_port, config.host)
        self.http = None
        if config.http_port is not None:
            from router.openai_http import OpenAIHTTPServer

            local = f"127.0.0.1:{self.port}" if config.host in ("0.0.0.0", "::") else self.address
            self.http = OpenAIHTTPServer(local, self.router.model_id, self.router.metrics.registry, config.host,
                                         config.http_port, config.auth_token)

    def start(self) -> None:
        self.server.start()
        if self.http is not None:
            self.http.start()
        grpc_plumbing.set_serving(self.health, [SERVICE_NAME], True)
        log.info("router address=%s model=%s event=serving", self.address, self.router.model_id)

    def stop(self, grace_s: float = 2.0) -> None:
        grpc_plumbing.set_serving(self.health, [SERVICE_NAME], False)
        if self.http is not None:
            self.http.stop()
        self.server.stop(grace_s).wait(grace_s + 1)

