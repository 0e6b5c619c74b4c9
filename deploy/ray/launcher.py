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

Supervision, as `duet up`'s: the control loop finds a router or worker whose process died, and its actor starts
it again on its port after the shared backoff (deploy/restarts.py), printing the same lines; the actor and its
placement group stay. A worker whose actor itself is lost (its node gone) is replaced by a new actor at once.
Files: config.py (what to run), component_actor.py (the actors), this file (placement, scaling, lifecycle).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster import internal_tls
from cluster.cluster_secret import ENV_VAR, generate_cluster_secret
from cluster.internal_tls import InternalTLS
from cluster.registry import WorkerRegistry
from deploy.autoscaler import PoolState, decide
from deploy.ray.component_actor import ComponentActor, RankHolder
from deploy.ray.config import ROLES, RayLauncherConfig, pool_load
from deploy.redis_server import RedisServer
from deploy.restarts import RestartBackoff, death_line, describe_returncode, restarted_line

log = logging.getLogger(__name__)


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
    """Router + prefill/decode pools on the connected Ray cluster (call ray.init first). Not restartable.
    `print_fn` gets the supervision lines (a component died, when it restarts, that it did), from the control
    loop's thread."""

    def __init__(self, config: RayLauncherConfig, print_fn: Callable[[str], None] = print):
        self.config = config
        self.print_fn = print_fn
        self.backoff = RestartBackoff()  # the control loop's alone
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
        # the internal plane's secret ($DUET_CLUSTER_SECRET overrides): every component actor gets it in its
        # runtime env, and its process inherits it (cluster/cluster_secret.py)
        self.cluster_secret = os.environ.get(ENV_VAR) or generate_cluster_secret()
        self._runtime_env = {"env_vars": {ENV_VAR: self.cluster_secret}}
        # and its TLS material, the same way ($DUET_INTERNAL_TLS_* override; cluster/internal_tls.py)
        self.internal_tls = InternalTLS.load() or (internal_tls.generate() if config.internal_tls else None)
        if self.internal_tls is not None:
            self._runtime_env["env_vars"].update(self.internal_tls.env())

    # ------------------------------------------------------------------------------------------------ start

    def start(self) -> RayLauncher:
        """Redis, the minimum of each pool (in parallel), the router, then the control loop. On failure
        everything started is stopped and the error re-raised."""
        cfg = self.config
        try:
            if self.redis_url is None:
                self.redis = RedisServer(password=secrets.token_urlsafe(24)).start()
                self.redis_url = self.redis.url
            self._registry = WorkerRegistry.from_url(self.redis_url, cluster_secret=self.cluster_secret.encode())
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
                                       runtime_env=self._runtime_env,
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
            runtime_env=self._runtime_env,
        ).remote(name)
        extra_gpus = [g for ids in ray.get([h.gpu_ids.remote() for h in holders]) for g in ids] if holders else []
        tp_args = ["--tp", str(cfg.tp)] if cfg.tp > 1 else []
        args = self._model_args() + tp_args + cfg.worker_args + cfg.pool(role).args  # the pool's own flags last
        ref = actor.start.remote(role, args, "0.0.0.0", None, 0, extra_gpus, cfg.ready_timeout_s)
        return name, role, actor, pg, holders, ref

    def _finish_launches(self, pending) -> list[Component]:
        """Wait for every pending launch; if any fails, or stop() is called meanwhile, undo all of them and
        raise (the first error, or RuntimeError for the stop)."""
        started, error = [], None
        for name, role, actor, pg, holders, ref in pending:
            try:
                while not ray.wait([ref], timeout=0.2)[0]:
                    if self._stop_event.is_set():
                        raise RuntimeError(f"{name}: launcher stopping during startup")
                address = ray.get(ref)
                comp = Component(name, role, actor, address, ray.get(actor.pid.remote()), pg, holders)
                self.child_pids.append(comp.pid)
                started.append(comp)
                log.info("ray_launcher: %s SERVING at %s (pid %d)", name, address, comp.pid)
            except BaseException as e:  # noqa: BLE001 - undo all, then re-raise the first
                error = error or e
                with contextlib.suppress(Exception):
                    pid = ray.get(actor.pid.remote(), timeout=5)
                    if pid is not None:
                        self.child_pids.append(pid)
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
        """Supervision (dead processes restarted, lost actors replaced), then one autoscaling decision per pool
        from the registry's load reports, applied. Returns the pool sizes after it."""
        model_id = self.config.resolved_model_id
        self._supervise()
        for role in ROLES:
            if self._stop_event.is_set():
                break
            if len(self.pools[role]) < self.states[role].replicas:  # a lost actor: a new one in its place
                self._resize(role, self.states[role].replicas, {})
            workers = self._registry.list_workers(model_id, role)
            load = pool_load(role, [w.load for w in workers])
            with self._lock:
                before = self.states[role].replicas
                decision = decide(self.policies[role], self.states[role], load,
                                  time.monotonic() if now_s is None else now_s)
            if decision.replicas != before:
                self.decisions.append((time.monotonic(), role, decision.replicas, decision.reason, load))
                log.info("ray_launcher: pool=%s event=scale replicas=%d->%d reason=%s load=%.0f", role, before,
                         decision.replicas, decision.reason, load)
                loads = {w.info.address: pool_load(role, [w.load]) for w in workers}
                self._resize(role, decision.replicas, loads)
                if decision.replicas > before and now_s is None:
                    # the cooldowns count from when the new replicas serve, not from the decision: a pool that
                    # took seconds to grow is not judged (and shrunk) on the load of the moment it is ready
                    with self._lock:
                        self.states[role].last_up_s = time.monotonic()
        return self.pool_sizes()

    def _supervise(self) -> None:
        """A router or worker whose process died: reaped (its process group with it) and started again by its
        actor, on its port, once the backoff allows, each step printed as `duet up` prints it. A worker whose
        actor is gone (node lost, OOM) leaves its pool (step() starts a new one); a router whose actor is gone
        is run_ray_up's to notice."""
        now_s = time.monotonic()
        components = [self.router] if self.router is not None else []
        components += [comp for role in ROLES for comp in self.pools[role]]
        for comp in components:
            if self.backoff.is_scheduled(comp.name):
                continue
            try:
                alive = ray.get(comp.actor.alive.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - the actor itself died
                if comp.role != "router":
                    log.warning("ray_launcher: pool=%s worker=%s event=actor_lost; replacing it", comp.role,
                                comp.name)
                    self.pools[comp.role].remove(comp)
                    self._release(comp, graceful=False)
                continue
            if not alive:
                code = ray.get(comp.actor.stop.remote(0.0), timeout=10)
                tail = f"{comp.name} log tail:\n{ray.get(comp.actor.log_tail.remote(), timeout=10)}"
                self.print_fn(f"{death_line(comp.name, describe_returncode(code), tail)}\n"
                              f"{self.backoff.schedule(comp.name, now_s)}")
        for name in self.backoff.take_due(now_s):
            comp = next(c for c in components if c.name == name)  # one scaled down meanwhile was cancelled
            comp.pid = ray.get(comp.actor.relaunch.remote(), timeout=30)
            self.child_pids.append(comp.pid)
            self.print_fn(restarted_line(name, comp.pid))

    def _resize(self, role: str, replicas: int, loads: dict[str, float]) -> None:
        """Start or stop workers until the pool has `replicas`; stops the least loaded first (by the last
        load report per address; a worker without one counts as idle), the newest among equals."""
        pool = self.pools[role]
        if replicas > len(pool):
            pending = [self._launch_worker(role) for _ in range(replicas - len(pool))]
            try:
                pool.extend(self._finish_launches(pending))
            except Exception:  # noqa: BLE001
                log.exception("ray_launcher: pool=%s event=scale_up_failed", role)
        while len(pool) > replicas:
            victim = min(reversed(pool), key=lambda c: loads.get(c.address, 0.0))
            pool.remove(victim)
            self.backoff.cancel(victim.name)
            self._release(victim)
        with self._lock:
            self.states[role].replicas = len(pool)

    def router_actor_alive(self) -> bool:
        """The router's actor answers; its process may be down, between a death and its restart."""
        if self.router is None:
            return False
        try:
            ray.get(self.router.actor.pid.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - the actor died
            return False
        return True

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
    RAY_AUTH_MODE=disabled where Ray's token auth is not set up), start everything, print a `ready` line, run
    until SIGINT/SIGTERM (0) or the router's actor is lost (1), stop everything. A dead router or worker process
    is restarted meanwhile (RayLauncher._supervise), its lines printed."""
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
    launcher = RayLauncher(config, print_fn=print_fn)
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
            if not launcher.router_actor_alive():  # its process is the control loop's to restart; not its actor
                print_fn("duet: the router's actor is gone (its node lost?); stopping")
                return 1
        print_fn("duet: stopping")
        return 0
    finally:
        launcher.stop()
        if owns_ray:
            ray.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
