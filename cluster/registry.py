"""The worker registry in Redis: workers write their address, shape and load; routers read it.

Key layout (every per-model key carries the hash tag `{<model_id>}`, so on Redis Cluster all of one model's
keys land in one slot and a MULTI over them is legal):

    duet:models                               SET   model ids that have had a registered worker (not pruned;
                                                    list_models() keeps only those with live workers)
    duet:{<model_id>}:workers                 ZSET  worker_id -> expiry time (writer's unix seconds); an index
         │                                          only: members whose hash is gone are skipped, and pruned
         │                                          once their score is _INDEX_PRUNE_GRACE_S in the past
         └─▶ duet:{<model_id>}:worker:<worker_id>
                                              HASH  info        JSON of WorkerInfo
                                                    load        JSON of WorkerLoad
                                                    ttl_ms      the TTL the writer set (int)
                                                    reported_at writer's unix time of this report (float)
                                                    with PEXPIRE ttl_ms, refreshed by every heartbeat

Liveness is the hash's TTL, which Redis counts on its own clock; the age of a load report is
`ttl_ms - PTTL`, also on Redis's clock, so clock skew between hosts affects neither. Clocks matter only for
pruning dead members out of the index, which tolerates skew up to _INDEX_PRUNE_GRACE_S. Values are plain
strings and JSON, never pickle; unknown JSON fields are ignored, so a newer writer does not break an older
reader.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from cluster.cluster_secret import mac, verify

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
MODELS_KEY = "duet:models"
_INDEX_PRUNE_GRACE_S = 60.0


def workers_key(model_id: str) -> str:
    return f"duet:{{{model_id}}}:workers"


def worker_key(model_id: str, worker_id: str) -> str:
    return f"duet:{{{model_id}}}:worker:{worker_id}"


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker is: fixed for its process lifetime."""

    worker_id: str  # unique per process lifetime, e.g. f"{role}-{uuid4().hex[:8]}"
    role: str  # "prefill" | "decode"
    address: str  # gRPC host:port
    model_id: str
    block_size: int  # tokens per KV block
    num_kv_blocks: int
    tp_size: int = 1
    kv_address: str = ""  # decode: its kvtransfer receiver endpoint host:port; prefill: ""
    kv_layout: str = ""  # kvtransfer layout fingerprint (hex)

    def __post_init__(self):
        if not self.worker_id:
            raise ValueError("worker_id is empty: must be a non-empty string unique per worker process")
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} is invalid: must be one of {ROLES}")
        if not self.model_id:
            raise ValueError("model_id is empty: must be non-empty (it is the Redis hash tag)")
        if not self.address:
            raise ValueError("address is empty: must be the worker's gRPC host:port")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} is invalid: must be >= 1")
        if self.num_kv_blocks < 0:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} is invalid: must be >= 0")
        if self.tp_size < 1:
            raise ValueError(f"tp_size={self.tp_size} is invalid: must be >= 1")


@dataclass(frozen=True)
class WorkerLoad:
    """How busy a worker is: reported with every heartbeat."""

    num_waiting: int = 0  # requests queued
    num_running: int = 0
    num_free_blocks: int = 0
    num_waiting_tokens: int = 0  # prompt tokens queued but not computed (prefill work)
    prefill_tokens_per_s: float = 0.0  # measured prefill speed (decayed tokens / decayed step time); 0: unknown

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name}={getattr(self, f.name)} is invalid: must be >= 0")


@dataclass(frozen=True)
class LiveWorker:
    """A registered worker as the registry saw it just now: who it is, its last load report, and how old
    that report is (heartbeats are ttl_s/3 apart, so a load is up to that stale)."""

    info: WorkerInfo
    load: WorkerLoad
    load_age_s: float

    @property
    def worker_id(self) -> str:
        return self.info.worker_id


def _to_json(obj) -> str:
    return json.dumps(dataclasses.asdict(obj), separators=(",", ":"), sort_keys=True)


def _from_json(cls, text: str):
    data = json.loads(text)
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})


def _text(value) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


class WorkerRegistry:
    """Reads and writes worker entries. Thread-safe as far as the redis client is (redis.Redis is).

    Give the client socket timeouts (from_url does), or a hung Redis can block a heartbeat forever.
    """

    def __init__(self, client: redis.Redis, ttl_s: float = 6.0, cluster_secret: bytes | None = None):
        """With `cluster_secret`, entries are written signed and read only if their signature verifies (a
        Redis client without the secret cannot make the router send it traffic)."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s={ttl_s} is invalid: must be > 0")
        self.client = client
        self.ttl_s = ttl_s
        self.cluster_secret = cluster_secret
        self._refused: set[str] = set()  # entries already logged as unverifiable

    @classmethod
    def from_url(cls, url: str, ttl_s: float = 6.0, timeout_s: float = 2.0,
                 cluster_secret: bytes | None = None) -> WorkerRegistry:
        """A registry on a fresh client with socket timeouts and a short retry (so an outage fails fast)."""
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                      retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 2))
        return cls(client, ttl_s=ttl_s, cluster_secret=cluster_secret)

    def _signature(self, key: str, info_json: str, load_json: str, ttl_ms: str) -> str:
        return mac(self.cluster_secret, "registry", key, info_json, load_json, ttl_ms)

    # --------------------------------------------------------------------------------------------- writers

    def register(self, info: WorkerInfo, load: WorkerLoad) -> None:
        """Create or overwrite the worker's entry, live for ttl_s."""
        self._write(info, load)

    def heartbeat(self, info: WorkerInfo, load: WorkerLoad) -> None:
        """Refresh the TTL and the load; re-creates the entry if it expired (or Redis restarted empty)."""
        self._write(info, load)

    def _write(self, info: WorkerInfo, load: WorkerLoad) -> None:
        now = time.time()
        ttl_ms = max(1, round(self.ttl_s * 1000))
        key = worker_key(info.model_id, info.worker_id)
        # One MULTI: the hash never exists without its TTL, and the index never lags a new hash.
        pipe = self.client.pipeline(transaction=True)
        fields = {"info": _to_json(info), "load": _to_json(load), "ttl_ms": str(ttl_ms), "reported_at": repr(now)}
        if self.cluster_secret is not None:
            fields["sig"] = self._signature(key, fields["info"], fields["load"], fields["ttl_ms"])
        pipe.hset(key, mapping=fields)
        pipe.pexpire(key, ttl_ms)
        pipe.zadd(workers_key(info.model_id), {info.worker_id: now + self.ttl_s})
        pipe.sadd(MODELS_KEY, info.model_id)
        pipe.execute()

    def deregister(self, info: WorkerInfo) -> None:
        """Remove the worker's entry now (instead of waiting for its TTL)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(worker_key(info.model_id, info.worker_id))
        pipe.zrem(workers_key(info.model_id), info.worker_id)
        pipe.execute()

    # --------------------------------------------------------------------------------------------- readers

    def list_workers(self, model_id: str, role: str | None = None) -> list[LiveWorker]:
        """Live workers of `model_id` (optionally of one role), sorted by worker_id. Two round trips: the
        index (pruning dead members), then every member's hash."""
        if role is not None and role not in ROLES:
            raise ValueError(f"role={role!r} is invalid: must be None or one of {ROLES}")
        index = workers_key(model_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.zremrangebyscore(index, "-inf", time.time() - _INDEX_PRUNE_GRACE_S)
        pipe.zrange(index, 0, -1)
        _, members = pipe.execute()
        worker_ids = sorted(_text(m) for m in members)
        if not worker_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for worker_id in worker_ids:
            key = worker_key(model_id, worker_id)
            pipe.hmget(key, ["info", "load", "ttl_ms", "sig"])
            pipe.pttl(key)
        replies = pipe.execute()
        workers = []
        for worker_id, (fields, pttl_ms) in zip(worker_ids, zip(replies[0::2], replies[1::2])):
            info_json, load_json, ttl_ms, sig = (_text(v) for v in fields)
            if info_json is None or load_json is None or pttl_ms == -2:
                continue  # expired or deregistered; the index member is pruned later
            key = worker_key(model_id, worker_id)
            if self.cluster_secret is not None and not verify(
                    self.cluster_secret, "registry", sig, key, info_json, load_json, ttl_ms or ""):
                if key not in self._refused:
                    self._refused.add(key)
                    log.warning("registry: ignoring %s: its signature does not verify with the cluster secret "
                                "(written without it, or forged)", key)
                continue
            try:
                info = _from_json(WorkerInfo, info_json)
                load = _from_json(WorkerLoad, load_json)
            except (ValueError, TypeError) as e:
                log.warning("registry: skipping unreadable entry %s: %s", worker_key(model_id, worker_id), e)
                continue
            if role is not None and info.role != role:
                continue
            age_s = max(0.0, (int(ttl_ms) - pttl_ms) / 1000) if ttl_ms is not None and pttl_ms >= 0 else 0.0
            workers.append(LiveWorker(info, load, age_s))
        return workers

    def server_id(self) -> str:
        """The Redis server's run id: it changes when Redis restarts (and, without persistence, comes back
        empty), which tells a reader that missing entries are being written again, not gone."""
        return str(self.client.info("server")["run_id"])

    def list_models(self) -> list[str]:
        """Model ids with at least one live worker, sorted."""
        models = sorted(_text(m) for m in self.client.smembers(MODELS_KEY))
        return [m for m in models if self.list_workers(m)]


class Heartbeat:
    """Background thread: register, then heartbeat every ttl_s/3 with load_fn().

    Keeps retrying through a Redis outage, logging one line when Redis becomes unreachable and one when it
    is back (the entry is re-created then), not one per attempt. stop() ends the thread, then deregisters
    (best effort). If load_fn raises, the last good load is reported and the error is logged once.
    """

    def __init__(self, registry: WorkerRegistry, info: WorkerInfo, load_fn: Callable[[], WorkerLoad],
                 interval_s: float | None = None):
        self.registry = registry
        self.info = info
        self.load_fn = load_fn
        self.interval_s = interval_s if interval_s is not None else registry.ttl_s / 3
        if self.interval_s <= 0:
            raise ValueError(f"interval_s={self.interval_s} is invalid: must be > 0")
        self._stop = threading.Event()
        self._registered = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_load = WorkerLoad()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"heartbeat for {self.info.worker_id} already started")
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.info.worker_id}", daemon=True)
        self._thread.start()

    def wait_registered(self, timeout_s: float) -> bool:
        """True once the first registration has reached Redis (False if not within timeout_s)."""
        return self._registered.wait(timeout_s)

    def stop(self) -> None:
        """Stop heartbeating, then deregister (best effort). Idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join()
        try:
            self.registry.deregister(self.info)
        except (redis.RedisError, OSError) as e:
            log.warning("registry: deregister %s failed (its entry expires in %.1f s): %s",
                        self.info.worker_id, self.registry.ttl_s, e)

    def _current_load(self, load_failing: bool) -> tuple[WorkerLoad, bool]:
        try:
            self._last_load = self.load_fn()
            return self._last_load, False
        except Exception:
            if not load_failing:
                log.exception("registry: load_fn for %s failed; reporting the last load", self.info.worker_id)
            return self._last_load, True

    def _run(self) -> None:
        redis_down = False
        load_failing = False
        while True:
            load, load_failing = self._current_load(load_failing)
            try:
                self.registry.heartbeat(self.info, load)
                if redis_down:
                    log.warning("registry: Redis reachable again; %s re-registered", self.info.worker_id)
                elif not self._registered.is_set():
                    log.info("registry: %s registered role=%s model=%s address=%s", self.info.worker_id,
                             self.info.role, self.info.model_id, self.info.address)
                redis_down = False
                self._registered.set()
            except (redis.RedisError, OSError) as e:
                if not redis_down:
                    log.warning("registry: Redis unreachable, %s keeps retrying every %.1f s: %s",
                                self.info.worker_id, self.interval_s, e)
                redis_down = True
            if self._stop.wait(self.interval_s):
                return
