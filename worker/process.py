"""What every worker process does around its engine: load the runtime, serve gRPC with health and
reflection, register in Redis with a heartbeat carrying its load, publish KV events, stop cleanly on
SIGTERM/SIGINT.

    start:  runtime ─▶ gRPC server (NOT_SERVING) ─▶ heartbeat registered ─▶ SERVING
    stop:   NOT_SERVING ─▶ deregister ─▶ publisher stopped ─▶ server.stop(grace) ─▶ engine, kvtransfer stopped
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc

from cluster import grpc_plumbing
from cluster.cluster_secret import ENV_VAR, grpc_token, kv_handshake_key, load_cluster_secret
from cluster.internal_tls import InternalTLS
from cluster.kv_event_publisher import KVEventPublisher
from cluster.prefix_index import PrefixIndex
from cluster.registry import Heartbeat, WorkerInfo, WorkerLoad, WorkerRegistry
from duet.internal.v1 import workers_pb2 as wpb
from engine.config import EngineConfig
from engine.cpu_threads import call_on_own_thread, confine_to_one_cpu_thread
from engine.default_model import model_or_default
from engine.engine_core import EngineCore
from engine.runtime import Runtime, build_runtime
from engine.stop_signals import StopSignals
from kvtransfer.layout import KVLayout
from worker.engine_thread import EngineThread
from worker.metrics import PER_POSITION, WorkerMetrics
from worker.tp_rank import follower_argv as make_follower_argv
from worker.tp_rank import follower_module

log = logging.getLogger("duet.worker")


@dataclass
class WorkerConfig:
    """A worker's settings; `duet prefill` / `duet decode` flags map onto these fields."""

    role: str  # "prefill" | "decode"
    redis_url: str
    model_dir: Path | None = None  # checkpoint dir or .gguf file; None: the embedded default (engine/default_model.py)
    host: str = "127.0.0.1"
    port: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv_transport: str = "tcp"  # "tcp" | "torch" (torch.distributed: gloo on CPU, NCCL on CUDA)
    kv_checksum: bool = False
    layer_group_size: int = 4  # layers per KV message
    heartbeat_ttl_s: float = 6.0
    max_concurrent_rpcs: int = 256
    advertise_host: str | None = None  # the host others reach this worker at (default: host); e.g. the pod IP
    # decode: the port its KV receiver listens on (tensor-parallel rank r: kv_port + r), so a NetworkPolicy can
    # name it; 0: a free one
    kv_port: int = 0
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: off
    metrics_host: str | None = None  # where /metrics listens (default: host); e.g. the pod IP, or 127.0.0.1
    cluster_secret_file: Path | None = None  # the internal plane's secret (cluster/cluster_secret.py)
    internal_tls_dir: Path | None = None  # mutual TLS on gRPC and KV transfer (cluster/internal_tls.py)

    def __post_init__(self) -> None:
        last_kv_port = self.kv_port + self.engine.tp_size - 1
        if self.kv_port and not (1 <= self.kv_port and last_kv_port <= 65535):
            raise ValueError(f"kv_port={self.kv_port} is invalid: must be 0 (a free port) or 1..65535, and with "
                             f"tp_size={self.engine.tp_size} rank r listens on kv_port + r (last: {last_kv_port})")
        if self.kv_port and self.role != "decode":
            raise ValueError(f"kv_port={self.kv_port} is invalid for a {self.role} worker: only decode workers "
                             "listen for KV transfers")


class EngineLoop(Protocol):
    """A worker kind's engine loop (prefill_worker/prefill_loop.py, decode_worker/decode_loop.py)."""

    thread: EngineThread  # the one thread that steps `core`
    core: EngineCore

    def check_integrity(self) -> None:
        """Block accounting agrees (AssertionError naming what does not); on the engine thread."""


class WorkerProcess:
    """Shared lifecycle; a role supplies its servicer (`add_services`), its load (`load`) and, in its
    `__init__`, its `loop`."""

    service_names: tuple[str, ...] = ()
    loop: EngineLoop

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.worker_id = f"{config.role}-{uuid.uuid4().hex[:8]}"
        model_dir = model_or_default(config.model_dir)
        self.advertise_host = config.advertise_host or config.host
        self.cluster_secret = load_cluster_secret(config.cluster_secret_file)
        self.kv_handshake_key = kv_handshake_key(self.cluster_secret) if self.cluster_secret is not None else None
        self.internal_tls = InternalTLS.load(config.internal_tls_dir)
        if self.internal_tls is not None and config.kv_transport == "torch":
            raise ValueError("--kv-transport=torch cannot be used with internal TLS: its payloads travel outside the "
                             "encrypted connection; use --kv-transport=tcp, or no internal TLS on a private network")
        if self.cluster_secret is None:
            log.warning("worker=%s event=internal_plane_open: no cluster secret (--cluster-secret-file or %s): "
                        "anyone who reaches this worker's ports can call it", self.worker_id, ENV_VAR)
        self.tp_size = config.engine.tp_size
        self.tp_store = None  # tensor parallelism: rank 0 hosts the store its follower ranks meet it in
        follower_argv: list[str] = []
        tp_module = follower_module(config.role)
        if self.tp_size > 1:
            from datetime import timedelta

            import torch.distributed as dist

            self.tp_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                          timeout=timedelta(seconds=60))
            follower_argv = make_follower_argv(
                self.tp_store.port, model_id=config.engine.model_id or Path(model_dir).resolve().name,
                host=config.host, advertise_host=self.advertise_host, kv_transport=config.kv_transport,
                kv_checksum=config.kv_checksum, layer_group_size=config.layer_group_size,
                cluster_secret_file=config.cluster_secret_file, internal_tls_dir=config.internal_tls_dir,
                kv_port=config.kv_port)
        # loaded on a thread that ends, so that only the engine thread keeps an OpenMP pool (engine/cpu_threads.py)
        self.rt: Runtime = call_on_own_thread(build_runtime, model_dir, config.engine, tp_module, follower_argv)
        confine_to_one_cpu_thread()  # this thread only serves from here on
        self.layout = KVLayout.for_caches(self.rt.model_id, self.rt.kv_caches, self.tp_size, 0,
                                          self.rt.drafter.draft_id if self.rt.draft_ships_kv else "",
                                          self.rt.transfer_draft_caches)
        self.registry = WorkerRegistry.from_url(config.redis_url, ttl_s=config.heartbeat_ttl_s,
                                                cluster_secret=self.cluster_secret)
        self.redis = self.registry.client
        # both kinds are indexed: the router routes prefills by prefix, and decodes by the prefix they hold from
        # earlier turns (decode_worker/decode_loop.py)
        self.publisher = KVEventPublisher(self.redis, self.rt.model_id, self.worker_id,
                                          index=PrefixIndex(self.redis, self.rt.model_id), snapshot=self.pool_snapshot)
        self.rt.block_pool.subscribe(self.publisher.on_event)
        self.server = grpc_plumbing.make_server(
            config.max_concurrent_rpcs, grpc_plumbing.INTERNAL_MAX_MESSAGE_BYTES,
            grpc_token(self.cluster_secret) if self.cluster_secret is not None else None)
        self.add_services(self.server)
        self.health = grpc_plumbing.add_health_and_reflection(self.server, self.service_names)
        self.port = grpc_plumbing.bind(self.server, config.host, config.port,
                                       self.internal_tls.server_credentials() if self.internal_tls else None)
        self.address = f"{self.advertise_host}:{self.port}"
        self.metrics = WorkerMetrics(config.role, self.rt.model_id, self.metric_values, self.cache_config_info())
        self.metrics_port: int | None = None
        self.heartbeat: Heartbeat | None = None
        self._stopped = threading.Event()

    # -- role hooks ------------------------------------------------------------------------------

    def add_services(self, server: grpc.Server) -> None:
        raise NotImplementedError

    def load(self) -> WorkerLoad:
        raise NotImplementedError

    def kv_address(self) -> str:
        return ""

    def pool_snapshot(self) -> tuple[int, int, list[int]]:
        """The block pool's (epoch, sequence, cached hashes), read on the engine thread."""
        return self.engine_thread().call(self.rt.block_pool.snapshot)

    def engine_thread(self) -> EngineThread:
        return self.loop.thread

    def engine_core(self) -> EngineCore:
        """The worker's engine core (its counts are plain reads, safe from any thread)."""
        return self.loop.core

    def start_engine(self) -> None:
        raise NotImplementedError

    def stop_engine(self) -> None:
        raise NotImplementedError

    # -- lifecycle -------------------------------------------------------------------------------

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.worker_id, role=self.config.role, address=self.address, model_id=self.rt.model_id,
            block_size=self.rt.block_size, num_kv_blocks=self.rt.num_kv_blocks, tp_size=self.tp_size,
            kv_address=self.kv_address(), kv_layout=self.layout.fingerprint(),
        )

    def metric_values(self) -> dict[str, float]:
        """The numbers Prometheus reads at scrape time (plain attribute reads: safe from any thread)."""
        load, core, pool = self.load(), self.engine_core(), self.rt.block_pool
        speculation = core.speculation
        return {
            "spec_decode_num_drafts": speculation.num_drafts, "spec_decode_num_draft_tokens":
                speculation.num_draft_tokens, "spec_decode_num_accepted_tokens": speculation.num_accepted_tokens,
            PER_POSITION: speculation.num_accepted_per_position,
            "draft_computed_tokens": self.rt.drafter.num_fed_tokens if self.rt.drafter is not None else 0,
            "draft_prompt_catch_up_tokens":
                self.rt.drafter.num_prompt_catch_up_tokens if self.rt.drafter is not None else 0,
            "num_requests_waiting": load.num_waiting, "num_requests_running": load.num_running,
            "num_waiting_tokens": load.num_waiting_tokens, "kv_cache_usage_perc": pool.usage(),
            "prefix_cache_queries": core.num_prefix_query_tokens, "prefix_cache_hits": core.num_prefix_hit_tokens,
            "prompt_tokens": core.num_prompt_tokens, "generation_tokens": core.num_generation_tokens,
            "num_preemptions": core.num_preemptions,
            "kv_events_dropped": self.publisher.num_dropped, "prefix_index_resyncs": self.publisher.num_resyncs,
        }

    def cache_config_info(self) -> dict[str, str]:
        """The KV cache's settings, under vLLM's names for `duet_cache_config_info` (num_gpu_blocks: the blocks
        on the worker's device, whichever it is)."""
        return {
            "block_size": str(self.rt.block_size), "num_gpu_blocks": str(self.rt.num_kv_blocks),
            "cache_dtype": str(self.rt.dtype).removeprefix("torch."),
            "enable_prefix_caching": str(self.rt.config.enable_prefix_caching),
        }

    def start(self) -> None:
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.metrics_port,
                                                   self.config.metrics_host or self.config.host)
        self.start_engine()
        self.server.start()
        self.heartbeat = Heartbeat(self.registry, self.info(), self.load)
        self.heartbeat.start()
        if not self.heartbeat.wait_registered(30.0):
            log.warning("worker=%s registry unreachable at start; serving anyway, retrying", self.worker_id)
        self.publisher.start()  # after registering: routers purge index entries of unregistered workers
        grpc_plumbing.set_serving(self.health, self.service_names, True)
        log.info("worker=%s role=%s address=%s model=%s event=serving", self.worker_id, self.config.role,
                 self.address, self.rt.model_id)

    def stop(self, grace_s: float = 2.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        grpc_plumbing.set_serving(self.health, self.service_names, False)
        if self.heartbeat is not None:
            self.heartbeat.stop()
        # deregistered: routers purge this worker's index entries, so what it would publish from here is moot; and
        # the publisher reads the engine's cache (a resync's snapshot), so it stops before the engine does
        self.publisher.stop()
        self.server.stop(grace_s).wait(grace_s + 1)
        self.stop_engine()
        self.rt.close()  # tensor-parallel follower ranks
        log.info("worker=%s event=stopped", self.worker_id)

    def serve_until_signal(self) -> int:
        """Run until SIGTERM/SIGINT or the engine thread dies; returns the exit code."""
        with StopSignals() as stop:
            self.start()
            code = 0
            while stop.wait(0.5) is None:
                if not self.engine_alive():
                    log.error("worker=%s engine thread died: stopping", self.worker_id)
                    code = 1
                    break
                if dead := [p.pid for p in self.rt.followers if p.poll() is not None]:
                    log.error("worker=%s tensor-parallel rank process(es) %s exited: stopping", self.worker_id, dead)
                    code = 1
                    break
            self.stop()
        return code

    def engine_alive(self) -> bool:
        return self.loop.thread.alive

    def role_stats(self) -> dict[str, int]:
        """The `WorkerStats` fields only this worker kind reports."""
        return {}

    def Stats(self, request: wpb.StatsRequest, context: grpc.ServicerContext) -> wpb.WorkerStats:
        return self.engine_thread().call(self._stats, request.check_integrity)

    def _stats(self, check: bool) -> wpb.WorkerStats:
        error = ""
        if check:
            try:
                self.loop.check_integrity()
            except AssertionError as e:
                error = str(e) or "integrity check failed"
        core, rt = self.engine_core(), self.rt
        return wpb.WorkerStats(
            worker_id=self.worker_id, role=self.config.role, num_kv_blocks=rt.num_kv_blocks,
            num_free_blocks=rt.block_pool.num_free_blocks, num_running=core.num_running,
            num_waiting=core.num_waiting, integrity_error=error, prefix_query_tokens=core.num_prefix_query_tokens,
            prefix_hit_tokens=core.num_prefix_hit_tokens, num_kv_events_published=self.publisher.num_published,
            num_kv_events_dropped=self.publisher.num_dropped, num_index_resyncs=self.publisher.num_resyncs,
            kv_event_lag_s=self.publisher.last_lag_s, **self.role_stats(),
        )


def abort_with(context: grpc.ServicerContext, code: grpc.StatusCode, message: str,
               fault: tuple[str, str] | None = None) -> None:
    """context.abort, logged; never returns. `fault`: whose the failure is when not this worker's
    (grpc_plumbing.REQUEST_FAULT or KV_TARGET_FAULT), so the router does not avoid this worker for it."""
    log.info("rpc status=%s message=%s", code.name, message)
    if fault is not None:
        context.set_trailing_metadata((fault,))
    context.abort(code, message)


def remaining_s(context: grpc.ServicerContext, default_s: float) -> float:
    remaining = context.time_remaining()
    return default_s if remaining is None else max(0.0, min(remaining, default_s))


OnCancel = Callable[[], None]
