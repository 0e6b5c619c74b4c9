"""`duet ray up`: the router and the prefill/decode pools as Ray actors, each pool scaled on its queue depth.

    driver (this process, on the head)
      ├─ redis-server            (deploy.redis_server, loopback; or an external --redis-url for multi-node)
      ├─ control loop thread     every poll_interval_s: registry loads -> deploy.autoscaler.decide per pool
      ├─ router    actor  ──────  child `python -m duet router ...`        on the head node
      ├─ prefill-i actor  ──────  child `python -m duet prefill ...`        in placement group pg-i
      └─ decode-j  actor  ──────  child `python -m duet decode ...`         in placement group pg-j

One worker = one STRICT_PACK placement group with one bundle per tensor-parallel rank (all on one node):

    bundle 0: {CPU: c, GPU: g, duet_<role>: 1}   <- the ComponentActor that runs the worker process
    bundle r: {CPU: c, GPU: g}                   <- a RankHolder per extra rank: holds the GPU, reports its id

The actor sets CUDA_VISIBLE_DEVICES of its child to the GPU ids of every bundle, so the worker's own rank
processes see exactly the GPUs Ray reserved for it. `duet_<role>` is the custom resource a node of that pool
offers (deploy/ray/cluster.yaml); a pending actor asking for it is what makes Ray's autoscaler add a node.

Each component runs as a child process of its actor (its own session, so torch and gRPC threads never live in
Ray's worker process); readiness is grpc.health.v1 SERVING, checked by the actor on its own node. Stopping
one: SIGTERM the child (the worker deregisters from Redis), SIGKILL its process group after timeout_s, then
ray.kill the actor and remove its placement group. stop() stops the loop, the router, the workers, redis.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deploy.autoscaler import PoolPolicy, PoolState, decide
from deploy.redis_server import RedisServer, parent_death_preexec, pick_free_port, tail_file
from router.registry import WorkerRegistry

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
_PROJECT_ROOT = str(Path(__file__).resolve().parents[1])
_HEALTH_RPC_TIMEOUT_S = 0.5


@dataclass
class PoolConfig:
    min_replicas: int = 1
    max_replicas: int = 1
    target_per_replica: float = 8192.0  # prefill: waiting tokens + running; decode: running + waiting requests
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 120.0

    def policy(self) -> PoolPolicy:
        return PoolPolicy(target_per_replica=self.target_per_replica, min_replicas=self.min_replicas,
                          max_replicas=self.max_replicas, scale_up_cooldown_s=self.scale_up_cooldown_s,
                          scale_down_cooldown_s=self.scale_down_cooldown_s)


@dataclass
class RayLauncherConfig:
    model_dir: str | None = None
    model_id: str | None = None  # default: the model directory's name (as the workers register)
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=lambda: PoolConfig(target_per_replica=32.0))
    router_host: str = "0.0.0.0"
    port: int = 50051  # router port; 0 = a free one on the head
    redis_url: str | None = None  # None: a private redis-server in the driver (single-node clusters)
    tp: int = 1  # tensor-parallel ranks per worker: bundles in its placement group
    num_cpus_per_rank: float = 1.0
    num_gpus_per_rank: float = 0.0
    custom_resources: bool = True  # ask for duet_prefill / duet_decode: 1 (the nodes of cluster.yaml offer them)
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    poll_interval_s: float = 2.0
    ready_timeout_s: float = 300.0

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"tp={self.tp} is invalid: must be >= 1")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is invalid: must be in [0, 65535] (0 picks a free one)")
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s={self.poll_interval_s} is invalid: must be > 0")
        for role in ROLES:
            self.pool(role).policy()  # validates min/max/target

    def pool(self, role: str) -> PoolConfig:
        return self.prefill if role == "prefill" else self.decode

    @property
    def resolved_model_id(self) -> str:
        if self.model_id is not None:
            return self.model_id
        if self.model_dir is None:
            raise ValueError("model_dir or model_id is required to read the registry")
        return Path(self.model_dir).name


def pool_load(role: str, loads) -> float:
    """The queue metric of one pool (deploy/autoscaler.py): prefill = waiting prompt tokens + running requests,
    decode = running + waiting requests, summed over the pool's registered workers."""
    if role == "prefill":
        return float(sum(w.num_waiting_tokens + w.num_running for w in loads))
    return float(sum(w.num_running + w.num_waiting for w in loads))


def _is_serving(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=_HEALTH_RPC_TIMEOUT_S)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@ray.remote
class RankHolder:
    """Holds one extra tensor-parallel rank's bundle (its GPU) in a worker's placement group."""

    def gpu_ids(self) -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]


@ray.remote
class ComponentActor:
    """One duet component (`python -m duet <role> ...`) as a child process of this actor.

    start() returns the component's address once it reports SERVING, or raises RuntimeError with its log
    tail; stop() always leaves no child behind (SIGTERM, then SIGKILL of its process group)."""

    def __init__(self, name: str):
        self.name = name
        self.popen: subprocess.Popen | None = None
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"duet-ray-{name}-{os.getpid()}.log"

    def start(self, role: str, args: list[str], bind_host: str, advertise_host: str | None, port: int,
              extra_gpu_ids: list[str], ready_timeout_s: float) -> str:
        node_ip = ray.util.get_node_ip_address()
        host = advertise_host or node_ip
        port = port or pick_free_port()
        cmd = [sys.executable, "-m", "duet", role, "--host", bind_host, "--port", str(port), *args]
        if role != "router":
            cmd += ["--advertise-host", host]
        env = dict(os.environ, PYTHONUNBUFFERED="1", GRPC_ENABLE_FORK_SUPPORT="false",
                   PYTHONPATH=os.pathsep.join(p for p in (_PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p))
        gpu_ids = [str(i) for i in ray.get_gpu_ids()] + list(extra_gpu_ids)
        if gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        with open(self.log_path, "ab") as log_file:
            self.popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                          env=env, cwd=_PROJECT_ROOT, start_new_session=True,
                                          preexec_fn=parent_death_preexec())  # dies with this actor's process
        deadline = time.monotonic() + ready_timeout_s
        while not _is_serving(f"127.0.0.1:{port}"):
            code = self.popen.poll()
            if code is not None or time.monotonic() > deadline:
                how = f"exited with code {code}" if code is not None else f"not SERVING in {ready_timeout_s} s"
                self.stop()
                raise RuntimeError(f"{self.name} {how}; log tail:\n{tail_file(self.log_path)}")
            time.sleep(0.2)
        return f"{host}:{port}"

    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """The child's exit code (None if never started)."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("ray_launcher: %s ignored SIGTERM for %.1f s; killing it", self.name, timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # its own session: anything it spawned goes too
        return self.popen.wait()


@dataclass
class Component:
    """A started component: valid until the launcher stops it (then `actor` is dead, `pg` removed)."""

    name: str
    role: str
    actor: ray.actor.ActorHandle
    address: str
    pid: int
    pg: object | None = None  # PlacementGroup (workers)
    rank_holders: list = field(default_factory=list)


class RayLauncher:
    """Router + prefill/decode pools on the connected Ray cluster (call ray.init first). Not restartable."""

    def __init__(self, config: RayLauncherConfig):
        self.config = config
        self.redis: RedisServer | None = None
        self.redis_url: str | None = config.redis_url
        self.router: Component | None = None
        self.pools: dict[str, list[Component]] = {role: [] for role in ROLES}
        self.states = {role: PoolState(replicas=0) for role in ROLES}
        self.policies = {role: config.pool(role).policy() for role in ROLES}
        self.decisions: list[tuple[float, str, int, str, float]] = []  # (time, role, replicas, reason, load)
        self.child_pids: list[int] = []  # every child ever started (for tests and post-mortems)
        self._counters = {role: 0 for role in ROLES}
        self._lock = threading.Lock()  # pools, states
        self._stop_event = threading.Event()
        self._loop: threading.Thread | None = None
        self._registry: WorkerRegistry | None = None

    # ------------------------------------------------------------------------------------------------ start

    def start(self) -> RayLauncher:
        """Redis, the minimum of each pool (in parallel), the router, then the control loop. On failure
        everything started is stopped and the error re-raised."""
        cfg = self.config
        try:
            if self.redis_url is None:
                self.redis = RedisServer().start()
                self.redis_url = self.redis.url
            self._registry = WorkerRegistry.from_url(self.redis_url)
            pending = [self._launch_worker(role) for role in ROLES for _ in range(cfg.pool(role).min_replicas)]
            for comp in self._finish_launches(pending):
                self.pools[comp.role].append(comp)
            for role in ROLES:
                self.states[role].replicas = len(self.pools[role])
            self.router = self._start_router()
            self._loop = threading.Thread(target=self._control_loop, name="duet-ray-autoscaler", daemon=True)
            self._loop.start()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def router_address(self) -> str:
        if self.router is None:
            raise RuntimeError("the launcher has not been started")
        return self.router.address

    def _model_args(self) -> list[str]:
        args = ["--redis-url", self.redis_url]
        if self.config.model_dir is not None:
            args += ["--model", str(self.config.model_dir)]
        if self.config.model_id is not None:
            args += ["--model-id", self.config.model_id]
        return args

    def _start_router(self) -> Component:
        cfg = self.config
        # The head node offers node:__internal_head__; the router and the driver's redis live there.
        actor = ComponentActor.options(num_cpus=0, resources={"node:__internal_head__": 0.001},
                                       name=None).remote("router")
        advertise = "127.0.0.1" if cfg.router_host in ("127.0.0.1", "localhost") else None
        ref = actor.start.remote("router", self._model_args() + cfg.router_args, cfg.router_host, advertise,
                                 cfg.port, [], cfg.ready_timeout_s)
        try:
            address = ray.get(ref)
        except BaseException:
            ray.kill(actor)
            raise
        comp = Component("router", "router", actor, address, ray.get(actor.pid.remote()))
        self.child_pids.append(comp.pid)
        log.info("ray_launcher: router SERVING at %s", address)
        return comp

    def _launch_worker(self, role: str):
        """Reserve the placement group and start the worker's actor; returns a pending launch."""
        cfg = self.config
        name = f"{role}-{self._counters[role]}"
        self._counters[role] += 1
        rank = {"CPU": cfg.num_cpus_per_rank}
        if cfg.num_gpus_per_rank:
            rank["GPU"] = cfg.num_gpus_per_rank
        first = dict(rank, **({f"duet_{role}": 1} if cfg.custom_resources else {}))
        pg = placement_group([first] + [dict(rank) for _ in range(cfg.tp - 1)], strategy="STRICT_PACK",
                             name=f"duet-{name}")
        holders = [RankHolder.options(num_cpus=0, num_gpus=cfg.num_gpus_per_rank,
                                      scheduling_strategy=PlacementGroupSchedulingStrategy(pg, r)).remote()
                   for r in range(1, cfg.tp)]
        actor = ComponentActor.options(
            num_cpus=cfg.num_cpus_per_rank, num_gpus=cfg.num_gpus_per_rank,
            resources={f"duet_{role}": 1} if cfg.custom_resources else {},
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        ).remote(name)
        extra_gpus = [g for ids in ray.get([h.gpu_ids.remote() for h in holders]) for g in ids] if holders else []
        args = self._model_args() + (["--tp", str(cfg.tp)] if cfg.tp > 1 else []) + cfg.worker_args
        ref = actor.start.remote(role, args, "0.0.0.0", None, 0, extra_gpus, cfg.ready_timeout_s)
        return name, role, actor, pg, holders, ref

    def _finish_launches(self, pending) -> list[Component]:
        """Wait for every pending launch; if any fails, undo all of them and raise the first error."""
        started, error = [], None
        for name, role, actor, pg, holders, ref in pending:
            try:
                address = ray.get(ref)
                comp = Component(name, role, actor, address, ray.get(actor.pid.remote()), pg, holders)
                self.child_pids.append(comp.pid)
                started.append(comp)
                log.info("ray_launcher: %s SERVING at %s (pid %d)", name, address, comp.pid)
            except BaseException as e:  # noqa: BLE001 - undo all, then re-raise the first
                error = error or e
                self._release(Component(name, role, actor, "", -1, pg, holders), graceful=False)
        if error is not None:
            for comp in started:
                self._release(comp)
            raise error
        return started

    # ---------------------------------------------------------------------------------------- autoscaling

    def _control_loop(self) -> None:
        while not self._stop_event.wait(self.config.poll_interval_s):
            try:
                self.step()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad poll (e.g. Redis blip)
                log.exception("ray_launcher: autoscaling step failed; retrying next poll")

    def step(self, now_s: float | None = None) -> dict[str, int]:
        """One autoscaling decision per pool from the registry's load reports; applies it. Returns the
        pool sizes after it."""
        model_id = self.config.resolved_model_id
        sizes = {}
        for role in ROLES:
            if self._stop_event.is_set():
                break
            loads = [load for _, load, _ in self._registry.list_workers(model_id, role)]
            load = pool_load(role, loads)
            with self._lock:
                before = self.states[role].replicas
                decision = decide(self.policies[role], self.states[role], load,
                                  time.monotonic() if now_s is None else now_s)
            if decision.replicas != before:
                self.decisions.append((time.monotonic(), role, decision.replicas, decision.reason, load))
                log.info("ray_launcher: pool=%s event=scale replicas=%d->%d reason=%s load=%.0f", role, before,
                         decision.replicas, decision.reason, load)
                self._resize(role, decision.replicas)
            sizes[role] = len(self.pools[role])
        return sizes

    def _resize(self, role: str, replicas: int) -> None:
        pool = self.pools[role]
        if replicas > len(pool):
            pending = [self._launch_worker(role) for _ in range(replicas - len(pool))]
            try:
                pool.extend(self._finish_launches(pending))
            except Exception:  # noqa: BLE001
                log.exception("ray_launcher: pool=%s event=scale_up_failed", role)
        while len(pool) > replicas:
            self._release(pool.pop())  # the newest first
        with self._lock:
            self.states[role].replicas = len(pool)

    def pool_sizes(self) -> dict[str, int]:
        return {role: len(self.pools[role]) for role in ROLES}

    # ------------------------------------------------------------------------------------------------ stop

    def _release(self, comp: Component, graceful: bool = True, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(Exception):
            ray.get(comp.actor.stop.remote(timeout_s if graceful else 0.0), timeout=timeout_s + 10)
        for actor in [comp.actor, *comp.rank_holders]:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        if comp.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(comp.pg)
        if comp.address:
            log.info("ray_launcher: %s event=stopped", comp.name)

    def stop(self, timeout_s: float = 10.0) -> None:
        """The control loop, the router, every worker (in parallel), then redis. Idempotent."""
        self._stop_event.set()
        if self._loop is not None and self._loop is not threading.current_thread():
            self._loop.join()
        if self.router is not None:
            self._release(self.router, timeout_s=timeout_s)
            self.router = None
        workers = [c for role in ROLES for c in self.pools[role]]
        for role in ROLES:
            self.pools[role] = []
        refs = [c.actor.stop.remote(timeout_s) for c in workers]
        with contextlib.suppress(Exception):
            ray.get(refs, timeout=timeout_s + 10)
        for comp in workers:
            self._release(comp, graceful=False)
        if self._registry is not None:
            with contextlib.suppress(Exception):
                self._registry.client.close()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> RayLauncher:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_ray_up(config: RayLauncherConfig, address: str = "auto", print_fn: Callable[[str], None] = print) -> int:
    """`duet ray up`: connect to Ray (address "auto": the running cluster; "local": start one here; set
    RAY_AUTH_MODE=disabled where Ray's token auth is not set up), start
    everything, print a `ready` line, run until SIGINT/SIGTERM, stop everything. Returns the exit code."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    owns_ray = not ray.is_initialized()
    if owns_ray and address == "local":
        # A one-node cluster here: it offers each pool's custom resource up to the pool's maximum.
        resources = {f"duet_{role}": float(config.pool(role).max_replicas) for role in ROLES}
        ray.init(address="local", resources=resources if config.custom_resources else None,
                 include_dashboard=False, log_to_driver=False)
    elif owns_ray:
        ray.init(address=address, log_to_driver=False)
    launcher = RayLauncher(config)
    try:
        try:
            launcher.start()
        except Exception as e:  # noqa: BLE001
            print_fn(f"duet ray up failed: {e}")
            return 1
        sizes = launcher.pool_sizes()
        print_fn(f"duet ready: router at {launcher.router_address} ({sizes['prefill']} prefill, "
                 f"{sizes['decode']} decode, redis at {launcher.redis_url.rpartition('@')[2]})")
        while not stop.wait(0.5):
            pass
        print_fn("duet: stopping")
        return 0
    finally:
        launcher.stop()
        if owns_ray:
            ray.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
