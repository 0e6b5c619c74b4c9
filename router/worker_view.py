"""The router's view of the workers: who is live (the registry, cached briefly), who just failed (avoided
for a while), what this router has in flight where, and one gRPC channel per worker.

Only caches with short lifetimes: routers stay stateless replicas. If Redis is unreachable the last list
seen is used (workers keep serving without Redis; one that fails is marked suspect here), and it is said
once in the log when the registry goes down and once when it comes back. When Redis comes back empty (it
restarted: its run id changed), the workers last seen stay in the list for REJOIN_GRACE_S while they
re-register (each does within a heartbeat), so no request meets an empty registry; routing by prefix falls
back to load until the workers have resynced their index entries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import grpc
import redis

from cluster import grpc_plumbing
from cluster.internal_tls import InternalTLS
from cluster.prefix_index import PrefixIndex
from cluster.registry import LiveWorker, WorkerInfo, WorkerRegistry
from router.load_policy import Candidate
from router.metrics import RouterMetrics

log = logging.getLogger("duet.router")
SUSPECT_S = 10.0  # a worker that failed a call is avoided this long (its registry entry may still be live)
REGISTRY_CACHE_S = 0.5
PURGE_EVERY_S = 5.0
INDEX_SIZE_EVERY_S = 30.0  # a SCAN of the model's keys: not on every request
REJOIN_GRACE_S = 10.0  # after a Redis restart: workers heartbeat every ~2 s (registry TTL / 3)
SEEN_LATELY_S = 60.0  # a role that had a worker this recently is restarting, not absent
REQUEST_LOG_S = 10.0  # request starts and ends kept this long: past any live report's age (registry TTL 6 s)


class NoWorkers(Exception):
    """No live worker of a role (or no registry and no worker seen before). `seen_lately`: the role had a
    worker within SEEN_LATELY_S (it is likely restarting, or re-registering in a restarted Redis)."""

    def __init__(self, message: str, seen_lately: bool = False):
        super().__init__(message)
        self.seen_lately = seen_lately


class WorkerView:
    def __init__(self, registry: WorkerRegistry, index: PrefixIndex, model_id: str, metrics: RouterMetrics,
                 cluster_secret: bytes | None = None, internal_tls: InternalTLS | None = None):
        self.registry, self.index, self.model_id, self.metrics = registry, index, model_id, metrics
        self._cluster_secret = cluster_secret  # every call to a worker carries its token
        self._internal_tls = internal_tls  # and, with it, goes over mutual TLS
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._suspects: dict[str, float] = {}  # worker_id -> avoid until (monotonic)
        self._inflight: dict[str, int] = {}  # requests this router has on a decode/prefill worker
        self._request_log: dict[str, deque[tuple[float, int]]] = {}  # worker_id -> (monotonic s, +1 start / -1 end)
        self._reported_s: dict[str, float] = {}  # worker_id -> when its last listed load report was taken
        self._inflight_tokens: dict[str, int] = {}  # prefill work this router sent and has not seen done
        self._cache: tuple[float, list[LiveWorker]] = (0.0, [])
        self._registry_down = False
        self._last_seen_s: dict[str, float] = {}  # role -> when a worker of it was last listed (monotonic)
        self._id_at: dict[str, str] = {}  # address -> the worker id last registered there
        self._server_id: str | None = None  # Redis's run id when last read
        self._rejoining: tuple[float, list[LiveWorker]] = (0.0, [])  # (until, workers seen before a restart)
        self._last_purge_s = 0.0
        self._last_size_s = 0.0

    def workers(self) -> tuple[list[LiveWorker], list[LiveWorker]]:
        """(prefill, decode) live workers; raises NoWorkers naming the role that has none."""
        now = time.monotonic()
        cached_at, workers = self._cache
        if now - cached_at > REGISTRY_CACHE_S:
            try:
                listed = self.registry.list_workers(self.model_id)
                with self._lock:  # only listed workers keep their report time and request log: ids churn
                    self._reported_s = {w.worker_id: now - w.load_age_s for w in listed}
                    for worker_id in self._request_log.keys() - self._reported_s.keys():
                        del self._request_log[worker_id]
                workers = self._with_rejoining(listed, workers, now)
                if self._registry_down:
                    log.warning("router event=registry_up")
                    self._registry_down = False
                self._cache = (now, workers)
                self._count_restarts(workers)
                self._maintain_index(workers, now)
            except (redis.RedisError, OSError) as e:
                if not workers:
                    raise NoWorkers(f"worker registry (redis) unreachable: {e}") from None
                if not self._registry_down:
                    log.warning("router event=registry_down using=last_known_workers error=%s", e)
                    self._registry_down = True
                self._cache = (now, workers)
        prefills = [w for w in workers if w.info.role == "prefill"]
        decodes = [w for w in workers if w.info.role == "decode"]
        for role, found in (("prefill", prefills), ("decode", decodes)):
            if found:
                self._last_seen_s[role] = now
            else:
                raise NoWorkers(f"no {role} worker is up for model {self.model_id}",
                                seen_lately=now - self._last_seen_s.get(role, -SEEN_LATELY_S) < SEEN_LATELY_S)
        return prefills, decodes

    def _with_rejoining(self, listed: list[LiveWorker], last_seen: list[LiveWorker], now: float) -> list[LiveWorker]:
        """`listed`, plus the workers seen before a Redis restart that have not re-registered yet (for
        REJOIN_GRACE_S after the restart is noticed)."""
        server_id = self.registry.server_id()
        if self._server_id is not None and server_id != self._server_id:
            log.warning("router event=registry_restarted keeping=%d last_seen_workers grace_s=%g", len(last_seen),
                        REJOIN_GRACE_S)
            self._rejoining = (now + REJOIN_GRACE_S, last_seen)
        self._server_id = server_id
        until, before = self._rejoining
        if now >= until:
            return listed
        listed_addresses = {w.info.address for w in listed}  # one there again (maybe a new process) supersedes
        return listed + [w for w in before if w.info.address not in listed_addresses]

    def _count_restarts(self, workers: list[LiveWorker]) -> None:
        """A worker id is one process lifetime: a new id at a known address is that worker restarted."""
        for w in workers:
            before = self._id_at.get(w.info.address)
            if before != w.worker_id:
                if before is not None:
                    log.info("router event=worker_restarted address=%s role=%s was=%s now=%s", w.info.address,
                             w.info.role, before, w.worker_id)
                    self.metrics.worker_restarted(w.info.role)
                self._id_at[w.info.address] = w.worker_id

    def _maintain_index(self, workers: list[LiveWorker], now: float) -> None:
        """Forget index entries of workers (prefill and decode) that stopped heartbeating; refresh the index
        size gauge."""
        if now - self._last_purge_s < PURGE_EVERY_S:
            return
        self._last_purge_s = now
        purged = self.index.purge_missing([w.worker_id for w in workers])
        for worker_id in purged:
            log.info("router event=index_purge worker=%s", worker_id)
        if now - self._last_size_s >= INDEX_SIZE_EVERY_S:
            self._last_size_s = now
            self.metrics.index_block_keys.set(self.index.stats()["num_block_keys"])

    def healthy(self, workers: list[LiveWorker]) -> list[LiveWorker]:
        """Workers not suspect; all of them if every one is (a suspect worker beats no worker)."""
        suspects = self.active_suspects()
        return [w for w in workers if w.worker_id not in suspects] or workers

    def any_healthy(self, workers: list[LiveWorker]) -> bool:
        suspects = self.active_suspects()
        return any(w.worker_id not in suspects for w in workers)

    def candidates(self, workers: list[LiveWorker]) -> list[Candidate]:
        """Each worker's load report, this router's requests in flight there, and its request starts and ends
        there since the report was taken (see load_policy)."""
        with self._lock:
            return [Candidate(w.worker_id, w.load.num_waiting, w.load.num_running, w.load.num_free_blocks,
                              w.load.num_waiting_tokens, self._inflight.get(w.worker_id, 0),
                              self._since_report(w.worker_id)) for w in workers]

    def _since_report(self, worker_id: str) -> int:
        reported_s = self._reported_s.get(worker_id)
        if reported_s is None:
            return 0
        return sum(delta for at_s, delta in self._request_log.get(worker_id, ()) if at_s > reported_s)

    def active_suspects(self) -> dict[str, float]:
        now = time.monotonic()
        with self._lock:
            for worker_id in [w for w, until in self._suspects.items() if until < now]:
                del self._suspects[worker_id]
            return dict(self._suspects)

    def on_worker_error(self, info: WorkerInfo, error: grpc.RpcError) -> None:
        if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            with self._lock:
                self._suspects[info.worker_id] = time.monotonic() + SUSPECT_S
            log.warning("worker=%s event=suspect status=%s", info.worker_id, error.code().name)

    def track_requests(self, worker_id: str, delta: int) -> None:
        """A request of this router's starts (+1) or ends (-1) on a worker."""
        now = time.monotonic()
        with self._lock:
            self._inflight[worker_id] = self._inflight.get(worker_id, 0) + delta
            events = self._request_log.setdefault(worker_id, deque())
            events.append((now, delta))
            while events[0][0] < now - REQUEST_LOG_S:
                events.popleft()

    def track_tokens(self, worker_id: str, delta: int) -> None:
        with self._lock:
            self._inflight_tokens[worker_id] = self._inflight_tokens.get(worker_id, 0) + delta

    def inflight_tokens(self) -> dict[str, int]:
        with self._lock:
            return dict(self._inflight_tokens)

    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = grpc_plumbing.channel(
                    address, cluster_secret=self._cluster_secret, tls=self._internal_tls)
            return ch
