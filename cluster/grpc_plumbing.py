"""gRPC plumbing shared by the router and the workers: servers with bounded messages, health, reflection,
an optional bearer-token check, TLS (public, or the internal plane's mutual TLS), and channels to peers.

Message sizes are bounded on both ends: a message over the limit is refused by gRPC itself with
RESOURCE_EXHAUSTED before any of our code runs.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterable
from concurrent import futures
from pathlib import Path

import grpc
import grpc.experimental
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster import cluster_secret as cluster_secret_module
from cluster import reflection_v1
from cluster.internal_tls import InternalTLS
from engine.cpu_threads import confine_to_one_cpu_thread

log = logging.getLogger("duet.grpc")

# HTTP/2 keepalive on channels to peers: a peer that stops answering (hung, SIGSTOPped, its host gone without
# a FIN) fails the calls in flight with UNAVAILABLE after KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS, so the
# router migrates the request instead of waiting on a stream that never moves. Servers accept pings that often.
KEEPALIVE_TIME_MS = 4000
KEEPALIVE_TIMEOUT_MS = 4000
# Servers probe their callers too, less often (public clients sit behind proxies and slow links): a worker whose
# router vanished without closing its connections (host lost) cancels that router's calls and frees their
# blocks within SERVER_KEEPALIVE_MS x 2, so a gateway's retry on another router replica finds nothing stale.
SERVER_KEEPALIVE_MS = 10000
PUBLIC_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a 32k-token prompt as ids is ~0.3 MB
INTERNAL_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# the public bearer token, where `duet router` and `duet up` read it when --auth-token is not given (`duet up`
# hands it to its router there: a command line is readable by every local user)
AUTH_TOKEN_ENV_VAR = "DUET_AUTH_TOKEN"
_UNAUTHENTICATED_PATHS = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # probes carry no token
# Trailing metadata by which a worker's error says whose fault it is, when not the worker's own:
#   request    the request's own (its sampling failed): the router fails that request (retrying elsewhere
#              would fail the same way) and keeps routing to the worker, which is healthy
#   kv-target  the decode worker the KV went to (gone, restarted, a transfer that broke or arrived corrupt):
#              the router blames that decode worker, not this prefill worker, and hands the request off again
FAULT_KEY = "duet-fault"
REQUEST_FAULT = (FAULT_KEY, "request")
KV_TARGET_FAULT = (FAULT_KEY, "kv-target")


def is_request_fault(error: grpc.RpcError) -> bool:
    return REQUEST_FAULT in tuple(error.trailing_metadata() or ())


def is_kv_target_fault(error: grpc.RpcError) -> bool:
    return KV_TARGET_FAULT in tuple(error.trailing_metadata() or ())


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuse calls without `authorization: Bearer <token>` (UNAUTHENTICATED), except health and reflection;
    `on_denied(method)` is told of each refused call (the router counts refused requests)."""

    def __init__(self, token: str, on_denied: Callable[[str], None] | None = None):
        self._expected = f"Bearer {token}".encode()
        self._on_denied = on_denied

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token in 'authorization'")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(_UNAUTHENTICATED_PATHS):
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization" and hmac.compare_digest(value.encode(), self._expected):
                return continuation(handler_call_details)
        if self._on_denied is not None:
            self._on_denied(handler_call_details.method)
        handler = continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


class _Undecodable:
    """What a request that failed to decode becomes, so its handler can answer INVALID_ARGUMENT."""

    def __init__(self, error: Exception):
        self.error = error


class DecodeErrorInterceptor(grpc.ServerInterceptor):
    """A request message that does not decode (invalid UTF-8 in a string field, truncated or garbled bytes)
    gets INVALID_ARGUMENT saying so, instead of gRPC's INTERNAL 'Exception deserializing request!' (which
    reads as a server fault). Unary-request methods only: every duet method is one."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        decode, method = handler.request_deserializer, handler_call_details.method

        def decode_or_mark(data: bytes):
            try:
                return decode(data)
            except Exception as e:  # noqa: BLE001 - any decoding failure is the sender's
                return _Undecodable(e)

        def guarded(behavior):
            def run(request, context):
                if isinstance(request, _Undecodable):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"the request to {method} does not decode: {request.error} (string fields must "
                                  "be valid UTF-8)")
                return behavior(request, context)
            return run

        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        return handler._replace(request_deserializer=decode_or_mark, **{kind: guarded(getattr(handler, kind))})


def make_server(max_workers: int, max_message_bytes: int, auth_token: str | None = None,
                on_denied: Callable[[str], None] | None = None,
                keepalive_ms: int = SERVER_KEEPALIVE_MS) -> grpc.Server:
    """A server; with `auth_token`, calls without it are refused (`on_denied(method)` told of each). A caller
    that stops answering keepalive pings for ~2 x `keepalive_ms` has its calls cancelled."""
    interceptors = [DecodeErrorInterceptor()]
    if auth_token:
        interceptors.insert(0, BearerTokenInterceptor(auth_token, on_denied))
    return grpc.server(
        # handlers never start OpenMP pools of their own: the engine thread's alone spins (engine/cpu_threads.py)
        futures.ThreadPoolExecutor(max_workers=max_workers, initializer=confine_to_one_cpu_thread),
        interceptors=interceptors,
        maximum_concurrent_rpcs=max_workers,  # beyond it: RESOURCE_EXHAUSTED at once, not a silent queue
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),  # two servers must never share a port by accident
            ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS),
            ("grpc.http2.max_ping_strikes", 0),  # a peer's keepalive is never a reason to hang up on it
            ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_timeout_ms", keepalive_ms),
            ("grpc.http2.ping_timeout_ms", keepalive_ms),
        ],
    )


def bind(server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
    """Listen on host:port (0 picks a free port); TLS with `credentials` (`public_tls_credentials`, or
    InternalTLS.server_credentials for a worker). Returns the port."""
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {address}: the port is in use or the host is not local")
    return bound


def public_tls_credentials(tls_cert: Path | None, tls_key: Path | None) -> grpc.ServerCredentials | None:
    """The router's public TLS (--tls-cert/--tls-key), or None when neither is given."""
    if not (tls_cert or tls_key):
        return None
    if not (tls_cert and tls_key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    return grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])


def add_health_and_reflection(server: grpc.Server, service_names: Iterable[str]) -> health.HealthServicer:
    """Serve grpc.health.v1 (NOT_SERVING until `set_serving`) and server reflection, v1 and v1alpha."""
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    for name in ["", *names]:
        servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflected = [*names, reflection.SERVICE_NAME, reflection_v1.SERVICE_NAME]
    reflection.enable_server_reflection(reflected, server)
    reflection_v1.enable_server_reflection_v1(reflected, server)
    return servicer


def set_serving(servicer: health.HealthServicer, service_names: Iterable[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        servicer.set(name, status)


class _MetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds fixed metadata (the internal bearer token) to every call on a channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self._metadata = metadata

    def _details(self, details):
        return details._replace(metadata=(*(details.metadata or ()), *self._metadata))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def channel(address: str, max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES,
            cluster_secret: bytes | None = None, tls: InternalTLS | None = None) -> grpc.Channel:
    """A channel to a peer; with `cluster_secret`, every call carries the internal bearer token; with `tls`,
    the channel is mutual TLS under the cluster's CA (cluster/internal_tls.py)."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.enable_retries", 0),  # the router decides what to retry
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.max_pings_without_data", 0),  # a stalled stream sends no data: keep probing it
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # gRPC core waits on this one (default 60 s)
        # a peer that is down is tried again at least every second: `duet up` restarts a dead worker on
        # its port, and gRPC's default backoff (growing to 120 s) kept failing calls for seconds after
        # the worker served again (benchmarks/chaos.py)
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        # a stream (the router's Decode) is read on the thread that iterates it, which polls the call itself:
        # by default a channel thread polls and wakes the reader, one more thread hand-off a token
        (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
    ]
    ch = dial(address, options, tls)
    if cluster_secret is None:
        return ch
    token = (("authorization", f"Bearer {cluster_secret_module.grpc_token(cluster_secret)}"),)
    return grpc.intercept_channel(ch, _MetadataInterceptor(token))


def dial(address: str, options: list[tuple[str, object]], tls: InternalTLS | None = None) -> grpc.Channel:
    """A plain channel, or a mutual-TLS one under the cluster's CA (checking its SERVER_NAME) with `tls`."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=[*options, *tls.CHANNEL_OPTIONS])


# The router's process health: SERVING from its start to its stop, whatever the workers (its "" and
# duet.v1.Generation are NOT_SERVING while no worker of a role is up). What liveness and readiness probes ask.
LIVENESS_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name  # "grpc.health.v1.Health"


def health_check(address: str, timeout_s: float = 1.0, service: str = "", tls: InternalTLS | None = None) -> bool:
    """True if the server at `address` says SERVING for `service` (`tls`: a worker serving internal TLS)."""
    with dial(address, [], tls) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
