"""A channel to a peer (cluster/grpc_plumbing.channel, the router's to every worker) tries a peer that is down
again at least about every second. `duet up` restarts a dead worker on the same port; under gRPC's default
reconnect backoff (1 s growing x1.6 to 120 s) the router's channel kept failing calls at once for seconds after
the worker served again (benchmarks/chaos.py: requests refused 3-6 s after a restarted prefill worker was
back, with "failed to connect to all addresses")."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import grpc_plumbing

OUTAGE_S = 8.0  # the default backoff's third wait (2.56 s +-20%) begins within it
MAX_GAP_S = 1.5  # the cap (1 s) plus its jitter (20%) and scheduling on a busy machine


def test_a_peer_that_stays_down_is_tried_again_at_least_every_second():
    # a peer that accepts TCP and hangs up: every connection attempt is one accept, and each fails
    listener = socket.create_server(("127.0.0.1", 0))
    attempts_s: list[float] = []

    def accept_and_hang_up() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # the listener was closed
            attempts_s.append(time.monotonic())
            conn.close()

    acceptor = threading.Thread(target=accept_and_hang_up, daemon=True)
    acceptor.start()
    channel = grpc_plumbing.channel(f"127.0.0.1:{listener.getsockname()[1]}")
    stub = health_pb2_grpc.HealthStub(channel)
    start_s = time.monotonic()
    try:
        while time.monotonic() - start_s < OUTAGE_S:  # calls keep coming, as the router's requests do
            with pytest.raises(grpc.RpcError):
                stub.Check(health_pb2.HealthCheckRequest(), timeout=0.2)
            time.sleep(0.05)
        end_s = time.monotonic()
    finally:
        channel.close()
        listener.close()
    times_s = [start_s, *attempts_s, end_s]
    gaps_s = [round(b - a, 2) for a, b in zip(times_s, times_s[1:])]
    assert len(attempts_s) >= 2 and max(gaps_s) <= MAX_GAP_S, gaps_s


CALLER = """
import sys, grpc
with grpc.insecure_channel(sys.argv[1]) as ch:
    for _ in ch.unary_stream("/t.T/Stream")(b"", timeout=300):
        print("streaming", flush=True)
"""


def test_a_server_cancels_the_calls_of_a_caller_that_stops_answering(tmp_path):
    """A caller frozen mid-stream (its host lost: no FIN, no RST; SIGSTOP here) has its call cancelled by the
    server's keepalive (grpc_plumbing.SERVER_KEEPALIVE_MS), so a worker frees what a vanished router held."""
    import os
    import signal
    import subprocess
    import sys

    cancelled = threading.Event()

    def stream(request, context):
        context.add_callback(cancelled.set)
        while context.is_active():
            yield b"x"
            time.sleep(0.05)

    keepalive_ms = 2000  # the workers' SERVER_KEEPALIVE_MS (10 s) works the same, 5x slower to test
    server = grpc_plumbing.make_server(4, 1 << 20, keepalive_ms=keepalive_ms)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.T", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})])
    port = grpc_plumbing.bind(server, "127.0.0.1", 0)
    server.start()
    caller = subprocess.Popen([sys.executable, "-c", CALLER, f"127.0.0.1:{port}"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert caller.stdout.readline() == "streaming\n"
        os.kill(caller.pid, signal.SIGSTOP)
        stopped_s = time.monotonic()
        assert cancelled.wait(3 * keepalive_ms / 1000 + 10), "the call was never cancelled"
        assert time.monotonic() - stopped_s >= keepalive_ms / 1000 / 2  # by keepalive, not EOF
    finally:
        caller.kill()
        caller.wait()
        server.stop(0)
