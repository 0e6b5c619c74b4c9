"""Helpers for tests that run a real local cluster (redis-server, router, workers as processes)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from cluster import grpc_plumbing
from cluster.cluster_secret import load_cluster_secret
from duet.internal.v1 import workers_pb2 as wpb
from duet.internal.v1 import workers_pb2_grpc as wpb_grpc


def internal_channel(address: str, tls=None) -> grpc.Channel:
    """A channel to a worker that carries the session's cluster secret (tests/conftest.py); `tls`: the
    cluster's InternalTLS where it runs with internal TLS."""
    return grpc_plumbing.channel(address, cluster_secret=load_cluster_secret(), tls=tls)


def worker_stats(address: str, role: str, check: bool = True, tls=None) -> wpb.WorkerStats:
    with internal_channel(address, tls) as ch:
        stub = wpb_grpc.PrefillWorkerStub(ch) if role == "prefill" else wpb_grpc.DecodeWorkerStub(ch)
        return stub.Stats(wpb.StatsRequest(check_integrity=check), timeout=10)


def worker_components(cluster):
    return [c for c in cluster.components if c.name.startswith(("prefill", "decode"))]


def wait_idle(cluster, timeout_s: float = 20.0, skip: tuple[str, ...] = ()) -> dict[str, wpb.WorkerStats]:
    """Until every live worker holds no block, request or reservation and its integrity check passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats, busy = {}, []
        for c in worker_components(cluster):
            if c.name in skip:
                continue
            s = worker_stats(c.address, c.name.split("-")[0], tls=getattr(cluster, "internal_tls", None))
            stats[c.name] = s
            assert s.integrity_error == "", f"{c.name}: {s.integrity_error}"
            if s.num_free_blocks != s.num_kv_blocks or s.num_running or s.num_waiting or s.num_reservations:
                busy.append((c.name, s))
        if not busy:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"workers not idle after {timeout_s}s: {busy}")
        time.sleep(0.05)


def rpc_error(fn) -> grpc.RpcError:
    try:
        fn()
    except grpc.RpcError as e:
        return e
    raise AssertionError("expected an RpcError")


def children(pid: int) -> list[int]:
    """Live (not zombie) child processes of pid, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@contextlib.contextmanager
def supervised(config) -> Iterator[tuple[object, list[str]]]:
    """A LocalCluster under `duet up`'s supervision (LocalCluster.wait, in a thread: dead components are
    restarted), and the lines the supervisor printed."""
    from deploy.local_cluster import LocalCluster

    printed: list[str] = []
    with LocalCluster(config).start() as cluster:
        supervisor = threading.Thread(target=cluster.wait, kwargs={"print_fn": printed.append})
        supervisor.start()
        try:
            yield cluster, printed
        finally:
            cluster.request_stop()
            supervisor.join(30)
