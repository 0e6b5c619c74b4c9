"""The router: the public `duet.v1.Generation` service. Per request:

    validate + tokenize ─▶ pick decode D (load) ─▶ D.Reserve ─▶ pick prefill P ─▶ P.Prefill(target = D's
    reservation) ─▶ first token to the client ─▶ D.Decode ─▶ tokens to the client (detokenized here, stop
    strings cut here) ─▶ final message with usage and timing

Every downstream call gets the client's remaining deadline, and a client cancel (or `Abort`) cancels the
call in flight; workers abort the request and free its blocks. A reservation that will not be decoded is
released at once (it would expire on its own anyway). A worker that fails to answer is avoided for
`SUSPECT_S` seconds, so new requests route around it before its registry entry expires.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis

from duet import serving
from duet.internal.v1 import workers_pb2 as wpb
from duet.internal.v1 import workers_pb2_grpc as wpb_grpc
from duet.v1 import generation_pb2 as pb
from duet.v1 import generation_pb2_grpc as pb_grpc
from duet.wire import sampling_to_proto
from engine.config import ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.tokenizer import Tokenizer
from router.load_policy import Candidate, rank_decode, without
from router.metrics import RouterMetrics
from router.prefill_chooser import PrefillChooser
from router.prefix_index import PrefixIndex
from router.prefix_policy import PolicyConfig
from router.registry import WorkerInfo, WorkerRegistry
from router.request_builder import BuiltRequest, ModelLimits, build_request

log = logging.getLogger("duet.router")
SUSPECT_S = 10.0
REGISTRY_CACHE_S = 0.5
RESERVE_TIMEOUT_S = 5.0
DEFAULT_TIMEOUT_S = 3600.0
SERVICE_NAME = "duet.v1.Generation"
INDEX_SIZE_EVERY_S = 30.0


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
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: off
    policy: PolicyConfig | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None


@dataclass
class _Live:
    """A request in flight: what to cancel when the client goes away or calls Abort."""

    request_id: str
    call: grpc.Future | grpc.Call | None = None
    aborted: bool = False
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set_call(self, call) -> None:
        with self.lock:
            self.call = call
            stop = self.aborted or self.cancelled
        if stop:
            call.cancel()

    def cancel(self, abort: bool) -> None:
        with self.lock:
            if abort:
                self.aborted = True
            else:
                self.cancelled = True
            call = self.call
        if call is not None:
            call.cancel()


class _Failed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, trailers: tuple = ()):
        super().__init__(message)
        self.code, self.message, self.trailers = code, message, trailers


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
        self._channels: dict[str, grpc.Channel] = {}
        self._suspects: dict[str, float] = {}  # worker_id -> avoid until (monotonic)
        self._inflight: dict[str, int] = {}
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._workers_cache: tuple[float, list] = (0.0, [])
        self._registry_down = False
        self._last_purge_s = 0.0
        self._last_size_s = 0.0
        self._inflight_tokens: dict[str, int] = {}  # prefill work this router sent and has not seen done
        self.metrics = RouterMetrics()
        self.index = PrefixIndex(self.registry.client, self.model_id)
        self.chooser = PrefillChooser(self.index, self.model_id, self.metrics, config.policy)

    # -- public RPCs -----------------------------------------------------------------------------

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        received_s = time.monotonic()
        try:
            built = build_request(request, self.tokenizer, self.limits)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        client_id = request.request_id or f"req-{uuid.uuid4().hex}"
        live = _Live(client_id)
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
        except _Failed as f:
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
        except _Failed as f:
            context.abort(f.code, f.message)
        choice = self._choose_prefill(built.prompt_token_ids, request.cache_salt, prefills, speculate=False)
        decode_id = rank_decode(self._candidates(decodes))[0]
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

    def _generate(self, client_id: str, built: BuiltRequest, cache_salt: str, live: _Live,
                  context: grpc.ServicerContext, received_s: float) -> Iterator[pb.GenerateResponse]:
        params = built.params
        internal_id = f"{client_id}@{uuid.uuid4().hex[:12]}"  # unique on the workers whatever clients send
        sampling = sampling_to_proto(params)
        prefills, decodes = self._workers()

        reserve_start_s = time.monotonic()
        decode, reservation = self._reserve(internal_id, len(built.prompt_token_ids), decodes, context)
        reserved_s = time.monotonic()
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
            self._track_tokens(prefill.worker_id, routed_tokens)
            try:
                first = self._prefill(prefill, internal_id, built, sampling, cache_salt, decode, reservation, live,
                                      context)
            finally:
                self._track_tokens(prefill.worker_id, -routed_tokens)
            self.metrics.prompt_tokens.inc(len(built.prompt_token_ids))
            self.metrics.predicted_cached.inc(choice.predicted_cached_tokens)
            self.metrics.actual_cached.inc(first.cached_tokens)
            timing.queue_s, timing.prefill_s, timing.transfer_s = first.queue_s, first.prefill_s, first.transfer_s
            usage.cached_tokens = first.cached_tokens
            first_sent_s = time.monotonic()
            timing.ttft_s = first_sent_s - received_s
            self.metrics.ttft_s.observe(timing.ttft_s)
            message, done = self._tokens_message(
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
            stub = wpb_grpc.DecodeWorkerStub(self._channel(decode.address))
            stream = stub.Decode(decode_req, timeout=self._remaining(context))
            live.set_call(stream)
            self._track(decode.worker_id, +1)
            try:
                for reply in stream:
                    if timing.first_decode_s == 0 and reply.token_ids:
                        timing.first_decode_s = time.monotonic() - first_sent_s
                    message, done = self._tokens_message(
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
                raise _Failed(grpc.StatusCode.INTERNAL, f"decode worker {decode.worker_id} ended the stream early")
            except grpc.RpcError as e:
                if live.aborted:
                    yield self._abort_message(client_id, detok, usage, timing, received_s)
                    return
                if live.cancelled:
                    return
                self._on_worker_error(decode, e)
                raise _Failed(_downstream_code(e), f"decode worker {decode.worker_id}: {e.details()}") from None
            finally:
                self._track(decode.worker_id, -1)
        finally:
            release()

    def _tokens_message(self, client_id: str, detok: IncrementalDetokenizer, token_ids: list[int], logprobs: list,
                        finish_reason: str, stop_token_id: int | None, usage: pb.Usage) -> tuple:
        """The client message for new tokens; done=True when the request ends with them."""
        message = pb.GenerateResponse(request_id=client_id)
        text = []
        for i, token_id in enumerate(token_ids):
            usage.completion_tokens += 1
            message.token_ids.append(token_id)
            if i < len(logprobs):
                message.logprobs.append(logprobs[i])
            text.append(detok.add_token(token_id))
            if detok.stop_matched is not None:
                message.text = "".join(text)
                message.finish_reason = "stop"
                message.stop_string = detok.stop_matched
                return message, True
        if finish_reason:
            text.append(detok.flush())
            message.finish_reason = finish_reason
            if stop_token_id is not None:
                message.stop_token_id = stop_token_id
        message.text = "".join(text)
        return message, bool(finish_reason)

    def _abort_message(self, client_id, detok, usage, timing, received_s) -> pb.GenerateResponse:
        timing.e2e_s = time.monotonic() - received_s
        return pb.GenerateResponse(request_id=client_id, text=detok.flush(), finish_reason="abort", usage=usage,
                                   timing=timing)

    # -- downstream calls ------------------------------------------------------------------------

    def _reserve(self, internal_id: str, num_prompt_tokens: int, decodes: list, context) -> tuple:
        ranked = without(rank_decode(self._candidates(decodes)), self._active_suspects())
        by_id = {info.worker_id: info for info, _, _ in decodes}
        exhausted, pushback_ms = [], 0
        for worker_id in ranked:
            info = by_id[worker_id]
            stub = wpb_grpc.DecodeWorkerStub(self._channel(info.address))
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
                    raise _Failed(code, e.details()) from None
                if not context.is_active():
                    raise _Failed(grpc.StatusCode.CANCELLED, "request cancelled") from None
                self._on_worker_error(info, e)  # unreachable or slow: try the next one
        if exhausted:
            raise _Failed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no decode worker can admit {num_prompt_tokens} prompt tokens now ({len(exhausted)} full); "
                f"retry after {pushback_ms or 200} ms",
                (("grpc-retry-pushback-ms", str(pushback_ms or 200)),),
            )
        raise _Failed(grpc.StatusCode.UNAVAILABLE, f"no decode worker for model {self.model_id} answered")

    def _prefill(self, prefill: WorkerInfo, internal_id, built, sampling, cache_salt, decode, reservation, live,
                 context) -> wpb.PrefillResponse:
        stub = wpb_grpc.PrefillWorkerStub(self._channel(prefill.address))
        future = stub.Prefill.future(
            wpb.PrefillRequest(
                request_id=internal_id, prompt_token_ids=built.prompt_token_ids, sampling=sampling,
                cache_salt=cache_salt,
                target=wpb.KVTarget(kv_address=reservation.kv_address, reservation_id=reservation.reservation_id),
            ),
            timeout=self._remaining(context),
        )
        live.set_call(future)
        self._track(prefill.worker_id, +1)
        try:
            return future.result()
        except grpc.FutureCancelledError:
            raise _Failed(grpc.StatusCode.CANCELLED, "request cancelled") from None
        except grpc.RpcError as e:
            if live.cancelled or live.aborted:
                raise _Failed(grpc.StatusCode.CANCELLED, "request cancelled") from None
            self._on_worker_error(prefill, e)
            raise _Failed(_downstream_code(e), f"prefill worker {prefill.worker_id}: {e.details()}") from None
        finally:
            self._track(prefill.worker_id, -1)

    def _release(self, decode: WorkerInfo, reservation_id: int) -> None:
        """Best effort: if the decode worker is unreachable, the reservation expires there on its own."""
        stub = wpb_grpc.DecodeWorkerStub(self._channel(decode.address))
        try:
            stub.Release(wpb.ReleaseRequest(reservation_id=reservation_id), timeout=2.0)
        except grpc.RpcError as e:
            log.info("worker=%s event=release_failed reservation=%d status=%s", decode.worker_id, reservation_id,
                     e.code().name)

    # -- workers ---------------------------------------------------------------------------------

    def _workers(self) -> tuple[list, list]:
        """Live workers from the registry (cached REGISTRY_CACHE_S). With Redis down, the last list seen:
        workers keep serving without Redis, and their failures mark them suspect here."""
        now = time.monotonic()
        cached_at, workers = self._workers_cache
        if now - cached_at > REGISTRY_CACHE_S:
            try:
                workers = self.registry.list_workers(self.model_id)
                if self._registry_down:
                    log.warning("router event=registry_up")
                    self._registry_down = False
                self._workers_cache = (now, workers)
                self._purge_dead(workers, now)
            except (redis.RedisError, OSError) as e:
                if not workers:
                    raise _Failed(grpc.StatusCode.UNAVAILABLE, f"worker registry (redis) unreachable: {e}") from None
                if not self._registry_down:
                    log.warning("router event=registry_down using=last_known_workers error=%s", e)
                    self._registry_down = True
                self._workers_cache = (now, workers)
        prefills = [w for w in workers if w[0].role == "prefill"]
        decodes = [w for w in workers if w[0].role == "decode"]
        for role, found in (("prefill", prefills), ("decode", decodes)):
            if not found:
                raise _Failed(grpc.StatusCode.UNAVAILABLE, f"no {role} worker is up for model {self.model_id}")
        return prefills, decodes

    def _purge_dead(self, workers: list, now: float) -> None:
        """Forget index entries of prefill workers that stopped heartbeating (every few seconds)."""
        if now - self._last_purge_s < 5.0:
            return
        self._last_purge_s = now
        purged = self.index.purge_missing([info.worker_id for info, _, _ in workers if info.role == "prefill"])
        for worker_id in purged:
            log.info("router event=index_purge worker=%s", worker_id)
        if now - self._last_size_s >= INDEX_SIZE_EVERY_S:  # a SCAN of the model's keys: not on every request
            self._last_size_s = now
            self.metrics.index_block_keys.set(self.index.stats()["num_block_keys"])

    def _choose_prefill(self, prompt: list[int], cache_salt: str, prefills: list, speculate: bool = True):
        suspects = self._active_suspects()
        healthy = [w for w in prefills if w[0].worker_id not in suspects] or prefills
        with self._lock:
            inflight = dict(self._inflight_tokens)
        return self.chooser.choose(prompt, cache_salt, healthy, inflight, speculate=speculate)

    def _track_tokens(self, worker_id: str, delta: int) -> None:
        with self._lock:
            self._inflight_tokens[worker_id] = self._inflight_tokens.get(worker_id, 0) + delta

    def _candidates(self, workers: list) -> list[Candidate]:
        with self._lock:
            return [Candidate(info.worker_id, load.num_waiting, load.num_running, load.num_free_blocks,
                              load.num_waiting_tokens, self._inflight.get(info.worker_id, 0))
                    for info, load, _ in workers]

    def _active_suspects(self) -> dict[str, float]:
        now = time.monotonic()
        with self._lock:
            for worker_id in [w for w, until in self._suspects.items() if until < now]:
                del self._suspects[worker_id]
            return dict(self._suspects)

    def _on_worker_error(self, info: WorkerInfo, error: grpc.RpcError) -> None:
        if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            with self._lock:
                self._suspects[info.worker_id] = time.monotonic() + SUSPECT_S
            log.warning("worker=%s event=suspect status=%s", info.worker_id, error.code().name)

    def _track(self, worker_id: str, delta: int) -> None:
        with self._lock:
            self._inflight[worker_id] = self._inflight.get(worker_id, 0) + delta

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = serving.channel(address)
            return ch

    def _remaining(self, context: grpc.ServicerContext) -> float:
        remaining = context.time_remaining()  # None, or a huge number, when the client set no deadline
        return DEFAULT_TIMEOUT_S if remaining is None else max(0.001, min(remaining, DEFAULT_TIMEOUT_S))


def _downstream_code(error: grpc.RpcError) -> grpc.StatusCode:
    """A worker's status as the client should see it: a worker's own failure is UNAVAILABLE to the client."""
    code = error.code()
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DATA_LOSS):
        return code
    return grpc.StatusCode.UNAVAILABLE


class RouterServer:
    """The router process: the Generation service with health, reflection, optional auth and TLS."""

    def __init__(self, config: RouterConfig):
        self.router = Router(config)
        self.server = serving.make_server(config.max_concurrent_streams, serving.PUBLIC_MAX_MESSAGE_BYTES,
                                          config.auth_token)
        pb_grpc.add_GenerationServicer_to_server(self.router, self.server)
        self.health = serving.add_health_and_reflection(self.server, [SERVICE_NAME])
        self.port = serving.bind(self.server, config.host, config.port, config.tls_cert, config.tls_key)
        self.address = f"{config.host}:{self.port}"
        self.metrics_port = None
        if config.metrics_port is not None:
            self.metrics_port = self.router.metrics.serve(config.metrics_port, config.host)

    def start(self) -> None:
        self.server.start()
        serving.set_serving(self.health, [SERVICE_NAME], True)
        log.info("router address=%s model=%s event=serving", self.address, self.router.model_id)

    def stop(self, grace_s: float = 2.0) -> None:
        serving.set_serving(self.health, [SERVICE_NAME], False)
        self.server.stop(grace_s).wait(grace_s + 1)

