"""The router: the public `duet.v1.Generation` service, a gRPC adapter over the request orchestrator.

    Generate: validate + tokenize (router/request_builder.py, the only place a request is judged)
              ─▶ RequestOrchestrator.run (router/orchestrator.py: reserve, plan, prefill, decode)
              ─▶ its messages streamed to the client; a `Failed` becomes the call's status (+ trailers)
    Abort:    cancels the live request with that id (the orchestrator ends its stream with "abort")
    ExplainRoute: where a request would go now, without sending it
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
from grpc_health.v1 import health_pb2

from cluster import grpc_plumbing
from cluster.cluster_secret import ENV_VAR, load_cluster_secret
from cluster.internal_tls import InternalTLS
from cluster.prefix_index import PrefixIndex
from cluster.registry import WorkerRegistry
from duet.v1 import generation_pb2 as pb
from duet.v1 import generation_pb2_grpc as pb_grpc
from engine.config import ModelConfig
from engine.default_model import model_or_default
from engine.errors import InvalidRequestError
from engine.tokenizer import Tokenizer
from router.admission_policy import AdmissionConfig
from router.metrics import RouterMetrics
from router.orchestrator import RequestOrchestrator, RoutedRequest
from router.prefill_chooser import PrefillChooser
from router.prefix_policy import PolicyConfig
from router.request_builder import ModelLimits, RequestBuilder, TokenizeTimeout
from router.request_stream import Failed, Live
from router.speculative_writer import SpeculativeWriter
from router.worker_view import NoWorkers, WorkerView

log = logging.getLogger("duet.router")
SERVICE_NAME = "duet.v1.Generation"
GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"
HEALTH_POLL_S = 0.5  # how often the router checks that a worker of each role is up (its health follows)
SHUTDOWN_GRACE_S = 5.0  # on stop, requests in flight get this long to finish, then are cut (--shutdown-grace)
# Conditional disaggregation's threshold (--local-prefill-tokens). Off (0): a router alone does not know its
# deployment (pools on separate hosts, a real network, GPUs), and one request alone showed no crossover on CPU
# (benchmarks/RESULTS.md, 2026-11-28); a local prefill also delays the decode worker's running requests. `duet up`,
# all pools on one host, sets its own measured value (duet/cli_serving.py, ONE_HOST_LOCAL_PREFILL_TOKENS).
DEFAULT_LOCAL_PREFILL_TOKENS = 0
DEFAULT_MAX_CONCURRENT_STREAMS = 256
STOP_MARGIN_S = 3.0  # past the grace: the HTTP cut, closing, flushing; `duet router` has exited by grace + this


@dataclass
class RouterConfig:
    """The router's settings; `duet router` flags map onto these fields."""

    redis_url: str
    model_dir: Path | None = None  # for the tokenizer, chat template and limits; None: the embedded default
    model_id: str | None = None  # the workers' model id; None: the model directory's name
    host: str = "127.0.0.1"
    port: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_logprobs: int = 20
    reservation_ttl_s: float = 60.0  # reserve -> KV complete; Decode then has the worker's grace period
    worker_wait_s: float = 20.0  # a request whose workers are restarting waits this long for one (in its deadline)
    # conditional disaggregation: a prompt whose uncached part on the chosen decode worker is shorter than this is
    # prefilled there, with no prefill worker or KV transfer (0: never). See DEFAULT_LOCAL_PREFILL_TOKENS.
    local_prefill_tokens: int = DEFAULT_LOCAL_PREFILL_TOKENS
    # SLO-aware admission (router/admission_policy.py): a request predicted to miss this TTFT because of the queue
    # is refused with RESOURCE_EXHAUSTED and a retry hint (None: never refused); goodput is counted against it and
    # slo_tpot_s (which admission does not judge)
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # requests served at once on each API (gRPC, and the in-process HTTP's calls): each holds a handler thread; past
    # it a request is refused at once (RESOURCE_EXHAUSTED / HTTP 429), never queued (--max-concurrent-streams)
    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS
    auth_token: str | None = None
    http_port: int | None = None  # OpenAI-compatible HTTP (router/openai_http.py); None: off
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: off
    policy: PolicyConfig | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    cluster_secret_file: Path | None = None  # the internal plane's secret (cluster/cluster_secret.py)
    internal_tls_dir: Path | None = None  # mutual TLS to the workers (cluster/internal_tls.py); None: plaintext
    shutdown_grace_s: float = SHUTDOWN_GRACE_S

    def __post_init__(self):
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s={self.shutdown_grace_s} is invalid: must be >= 0")
        if self.worker_wait_s < 0:
            raise ValueError(f"worker_wait_s={self.worker_wait_s} is invalid: must be >= 0 (0: never wait)")
        for name in ("slo_ttft_s", "slo_tpot_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value} is invalid: must be > 0 (None: no SLO)")
        if self.max_concurrent_streams < 1:
            raise ValueError(f"max_concurrent_streams={self.max_concurrent_streams} is invalid: must be >= 1")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens={self.local_prefill_tokens} is invalid: must be >= 0 "
                             "(0: never prefill on the decode worker)")


class Router(pb_grpc.GenerationServicer):
    def __init__(self, config: RouterConfig):
        self.config = config
        model_dir = model_or_default(config.model_dir)
        self.tokenizer = Tokenizer.from_path(model_dir)  # a checkpoint directory or a .gguf file
        model_config = ModelConfig.from_path(model_dir)
        self.model_id = config.model_id or Path(model_dir).resolve().name
        self.limits = ModelLimits(
            vocab_size=model_config.vocab_size,
            max_model_len=config.max_model_len or model_config.max_position_embeddings,
            max_logprobs=config.max_logprobs,
        )
        self.builder = RequestBuilder(self.tokenizer, self.limits)
        self.cluster_secret = load_cluster_secret(config.cluster_secret_file)
        if self.cluster_secret is None:
            log.warning("router event=internal_plane_open: no cluster secret (--cluster-secret-file or %s): "
                        "calls to workers are unauthenticated and any registry entry is trusted", ENV_VAR)
        self.registry = WorkerRegistry.from_url(config.redis_url, cluster_secret=self.cluster_secret)
        self.metrics = RouterMetrics(self.model_id, config.slo_ttft_s, config.slo_tpot_s)
        self.index = PrefixIndex(self.registry.client, self.model_id)
        self.speculative = SpeculativeWriter(self.index, on_drop=self.metrics.speculative_dropped.inc)
        self.chooser = PrefillChooser(self.index, self.model_id, self.metrics, self.speculative, config.policy)
        self.internal_tls = InternalTLS.load(config.internal_tls_dir)
        self.view = WorkerView(self.registry, self.index, self.model_id, self.metrics, self.cluster_secret,
                               self.internal_tls)
        self.orchestrator = RequestOrchestrator(self.view, self.chooser, self.metrics, self.tokenizer,
                                                self.model_id, config.reservation_ttl_s, config.worker_wait_s,
                                                config.local_prefill_tokens, AdmissionConfig(config.slo_ttft_s))
        self._live: dict[str, Live] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop the background speculative writer (what it has queued is written first, briefly)."""
        self.speculative.close()

    # -- public RPCs -----------------------------------------------------------------------------

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        try:
            routed, live = self.admit(request, context.time_remaining())
        except Failed as f:
            context.abort(f.code, f.message)
        if not context.add_callback(lambda: live.cancel(abort=False)):
            live.cancel(abort=False)  # the client is gone already
        try:
            yield from self.stream(routed, live)
        except Failed as f:
            if f.trailers:
                context.set_trailing_metadata(f.trailers)
            context.abort(f.code, f.message)

    def admit(self, request: pb.GenerateRequest, time_remaining_s: float | None) -> tuple[RoutedRequest, Live]:
        """Judge and register a Generate request (`time_remaining_s`: what is left of the client's deadline, None:
        none). Raises `Failed` for one refused before routing (counted by status). The caller must then run
        `stream(routed, live)`, which unregisters it, and cancel `live` when its client goes away."""
        received_s = time.monotonic()
        try:
            built = self.builder.build(request, time_remaining_s)
        except InvalidRequestError as e:
            raise self.refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except TokenizeTimeout as e:
            raise self.refused(grpc.StatusCode.DEADLINE_EXCEEDED, str(e)) from None
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        # None, or a huge number, when the client set no deadline
        live = Live(request_id, None if time_remaining_s is None else received_s + time_remaining_s)
        with self._lock:
            duplicate = request_id in self._live
            if not duplicate:
                self._live[request_id] = live
        if duplicate:
            raise self.refused(grpc.StatusCode.INVALID_ARGUMENT,
                               f"request_id={request_id!r} is invalid: must not be the id of a live request")
        return RoutedRequest(request_id, built, request.cache_salt, received_s), live

    def stream(self, routed: RoutedRequest, live: Live) -> Iterator[pb.GenerateResponse]:
        """An admitted request's messages (`RequestOrchestrator.run`: raises `Failed` with the status to end it);
        unregisters it when it ends."""
        try:
            yield from self.orchestrator.run(routed, live)
        finally:
            with self._lock:
                self._live.pop(routed.request_id, None)

    def refused(self, code: grpc.StatusCode, message: str) -> Failed:
        """A Generate call refused before routing, counted by status."""
        self.metrics.request_ended(code.name)
        return Failed(code, message)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        with self._lock:
            live = self._live.get(request.request_id)
        if live is not None:
            live.cancel(abort=True)
        return pb.AbortResponse(found=live is not None)

    def ExplainRoute(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.RouteExplanation:
        try:
            built = self.builder.build(request, context.time_remaining())
            preview = self.orchestrator.preview(built, request.cache_salt)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TokenizeTimeout as e:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except Failed as f:
            context.abort(f.code, f.message)
        choice = preview.choice
        addresses = {w.worker_id: w.info.address for w in preview.prefills}
        return pb.RouteExplanation(
            prefill_worker=choice.worker.worker_id, branch=choice.decision.branch,
            decode_worker=preview.decode_worker_id, prompt_tokens=len(built.prompt_token_ids),
            block_size=choice.block_size, prompt_blocks=len(choice.block_hashes),
            index_available=choice.index_available, lookup_s=choice.lookup_s, decision_s=choice.decision_s,
            prefill=[pb.WorkerEstimate(worker_id=e.worker_id, address=addresses[e.worker_id],
                                       cached_tokens=e.cached_tokens, queued_tokens=e.queued_tokens,
                                       tokens_per_s=e.tokens_per_s, estimated_ttft_s=e.cost_s, busy=e.busy)
                     for e in choice.decision.estimates],
        )


class RouterServer:
    """The router process: the Generation service with health, reflection (v1 and v1alpha), optional auth and TLS.

    Health (grpc.health.v1, Check and Watch): "" and duet.v1.Generation are SERVING while the worker registry
    lists at least one prefill and one decode worker for the model (checked every HEALTH_POLL_S), NOT_SERVING
    otherwise and from stop() on: a readiness probe or load balancer sends no request to a router that could
    not serve it. grpc.health.v1.Health is SERVING from start() to stop(): the process is up (a liveness probe
    that must not restart a router only because the workers are away)."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.router = Router(config)
        self.server = grpc_plumbing.make_server(config.max_concurrent_streams,
                                                grpc_plumbing.PUBLIC_MAX_MESSAGE_BYTES, config.auth_token,
                                                on_denied=self._denied)
        pb_grpc.add_GenerationServicer_to_server(self.router, self.server)
        self.health = grpc_plumbing.add_health_and_reflection(self.server, [SERVICE_NAME])
        self._serving = False  # what health says for "" and SERVICE_NAME (a prefill and a decode worker are up)
        self._stopping = threading.Event()
        self._health_lock = threading.Lock()  # a last update never undoes stop()'s NOT_SERVING
        self._health_watch = threading.Thread(target=self._watch_workers, name="router-health", daemon=True)
        self.port = grpc_plumbing.bind(self.server, config.host, config.port,
                                       grpc_plumbing.public_tls_credentials(config.tls_cert, config.tls_key))
        self.address = f"{config.host}:{self.port}"
        self.metrics_port = None
        if config.metrics_port is not None:
            self.metrics_port = self.router.metrics.serve(config.metrics_port, config.host)
        self.http = None
        self.local = None
        if config.http_port is not None:
            from router.local_generation import LocalGeneration
            from router.openai_http import OpenAIHTTPServer

            self.local = LocalGeneration(self.router, config.max_concurrent_streams)
            self.http = OpenAIHTTPServer(self.local, self.router.model_id, self.router.builder, self.router.metrics,
                                         config.host, config.http_port, config.auth_token,
                                         shutdown_grace_s=config.shutdown_grace_s)

    def _denied(self, method: str) -> None:
        if method == GENERATE_METHOD:  # a request refused for its missing or wrong token
            self.router.metrics.request_ended(grpc.StatusCode.UNAUTHENTICATED.name)

    def start(self) -> None:
        self.server.start()
        if self.http is not None:
            self.http.start()
        # the process is up (liveness)
        self.health.set(grpc_plumbing.LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self._update_health()
        self._health_watch.start()
        log.info("router address=%s model=%s event=started", self.address, self.router.model_id)

    def _watch_workers(self) -> None:
        while not self._stopping.wait(HEALTH_POLL_S):
            try:
                self._update_health()
                self.router.orchestrator.measure_queue()  # the gauge follows the queue between requests too
            except Exception:  # noqa: BLE001 - keep watching; the state stays as last known
                log.exception("router event=health_update_failed")

    def _update_health(self) -> None:
        """SERVING ("" and duet.v1.Generation) while the registry lists a prefill and a decode worker."""
        try:
            self.router.view.workers()
            serving, why = True, ""
        except NoWorkers as e:
            serving, why = False, str(e)
        with self._health_lock:
            if self._stopping.is_set() or serving == self._serving:
                return
            self._serving = serving
            grpc_plumbing.set_serving(self.health, [SERVICE_NAME], serving)
        if serving:
            log.info("router address=%s model=%s event=serving", self.address, self.router.model_id)
        else:
            log.warning("router event=not_serving reason=%s", why)

    def stop(self) -> None:
        """Take no new request from now on (health NOT_SERVING, both listeners closed); requests in flight, gRPC
        and HTTP alike, get `config.shutdown_grace_s` together and are then cut: a gRPC client gets a status,
        an HTTP client its error response or SSE error event. Every wait here is bounded (the HTTP side's by the
        grace + 1.5 s); `duet router` holds the whole stop to the grace + STOP_MARGIN_S."""
        grace_s = self.config.shutdown_grace_s
        with self._health_lock:
            self._stopping.set()
            grpc_plumbing.set_serving(self.health, [SERVICE_NAME, grpc_plumbing.LIVENESS_SERVICE], False)
        # both return at once, so both APIs' graces run side by side
        stopped = self.server.stop(grace_s)
        if self.local is not None:
            self.local.stop(grace_s)
        if self.http is not None:
            self.http.stop()
            self.local.close()
        stopped.wait(grace_s + 1)
        if self._health_watch.is_alive():
            self._health_watch.join(HEALTH_POLL_S + 1)
        self.router.close()

