"""The process supervisor behind `duet up`: redis-server, prefill and decode workers and a router on one host.

    launcher (this process)            each child: its own session (Ctrl-C reaches only the launcher),
      ├─ redis-server   private port     PYTHONUNBUFFERED=1, stdout+stderr → <log_dir>/<name>.log,
      ├─ prefill-0..N   gRPC :port       PR_SET_PDEATHSIG on Linux (dies if the launcher is SIGKILLed)
      ├─ decode-0..M    gRPC :port
      └─ router         gRPC :port       ← clients

Start order: first a check that the router's requested ports (gRPC, HTTP, metrics) are free (PortInUseError
before anything starts), then redis, workers, router; ready when every gRPC component answers grpc.health.v1
Check("") with SERVING (a TLS router: when it prints that it serves, as the probe cannot verify its
certificate); deploy/startup_progress.py says what is loading meanwhile. Stop order: router, then workers
(which can still deregister from Redis), then redis; a component that ignores SIGTERM for timeout_s is
SIGKILLed together with its whole process group, so nothing it spawned (e.g. tensor-parallel ranks) is left
behind.

Supervision: wait() restarts a component that dies (a worker, the router, redis), on its port, after a backoff
that grows with its recent restarts; the others keep serving. Only a signal (or a redis that cannot be
restarted) ends it.

Signals: run_up() and wait() turn SIGINT/SIGTERM into an orderly stop while they run. A program that drives
LocalCluster itself should stop it in a `with` block or `finally`; PR_SET_PDEATHSIG covers a launcher that
dies outright (Linux, when started from the main thread).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import internal_tls
from cluster.cluster_secret import ENV_VAR, generate_cluster_secret
from cluster.grpc_plumbing import AUTH_TOKEN_ENV_VAR, dial
from cluster.internal_tls import InternalTLS
from deploy.redis_server import RedisServer, tail_file
from deploy.restarts import RestartBackoff, death_line, describe_returncode, restarted_line, signal_name
from deploy.startup_progress import StartupProgress
from engine.child_process import die_with_parent
from engine.ports import is_port_free, pick_free_ports

log = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.2
_HEALTH_RPC_TIMEOUT_S = 0.5
# Retry a refused connection quickly: gRPC's default backoff grows to minutes while a model loads.
_PROBE_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
_ROUTER_SERVING_LINE = b"router serving at "  # `duet router` prints it once its health says SERVING
PORT_IN_USE_EXIT_CODE = 2  # run_up: a port the command line asked for is taken (as argparse's usage errors)
# ClusterConfig's router ports and the `duet up` flags that set them
_ROUTER_PORT_FLAGS = {"port": "--port", "http_port": "--http-port", "metrics_port": "--metrics-port"}
# OpenMP threads of co-located components spin this many times (~10 us here) after a parallel region before they
# sleep (libgomp's default is 300,000, ~6 ms). The workers of `duet up` share the host's cores, and a pool spinning
# in an idle prefill worker takes them from a decoding one: on the 2-core VM with libgomp's default everywhere, 16
# concurrent chats decoded at 30-33 tok/s where 500 gave 192 (2026-11-28, `duet bench serve`, benchmarks/RESULTS.md).
# A lone decode worker keeps the default: its pool is the one that should spin (it works step after step, and a
# short spin makes each of a step's ~250 parallel regions start with a futex wake: one chat at a time, 9.2-9.4 ms a
# token with 500 vs 7.4-7.9 with the default, default model), and 16 chats decode as fast either way (2026-11-28,
# later). Two or more decode workers would take the cores from each other, so they get the short spin too.
# Deployments with one worker per host (the chart, Ray) keep libgomp's default.
CO_LOCATED_SPIN_COUNT = 500


class ClusterInterrupted(RuntimeError):
    """start() was interrupted by SIGINT/SIGTERM (or request_stop()); everything has been stopped."""


class PortInUseError(OSError):
    """A router port the config asks for by number is taken; raised by start() before anything starts."""


@dataclass
class ClusterConfig:
    model_dir: str | None = None
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"  # the router's bind host; workers always bind 127.0.0.1
    port: int = 0  # router port, 0 = pick a free one
    redis_password: str | None = None  # None: a generated one (the private redis-server always requires one)
    worker_args: list[str] = field(default_factory=list)  # extra args for prefill+decode
    prefill_args: list[str] = field(default_factory=list)  # extra args for prefill workers only (after worker_args)
    decode_args: list[str] = field(default_factory=list)  # ... decode workers only
    router_args: list[str] = field(default_factory=list)  # extra router args (after the settings below)
    http_port: int | None = None  # the router's OpenAI HTTP API; 0 = a free one, None = off
    metrics_port: int | None = None  # the router's Prometheus /metrics; 0 = a free one, None = off
    auth_token: str | None = None  # the router's bearer token, handed over in its environment, not its argv
    tls_cert: Path | None = None  # the router's gRPC TLS (both or neither)
    tls_key: Path | None = None
    internal_tls: bool = False  # mutual TLS between the components under a CA made for this cluster
    ready_timeout_s: float = 180.0
    log_dir: str | None = None  # component stdout/stderr go to files here (default: inside the cluster's temp dir)

    def __post_init__(self):
        if self.num_prefill < 0 or self.num_decode < 0 or self.num_prefill + self.num_decode < 1:
            raise ValueError(f"num_prefill={self.num_prefill}, num_decode={self.num_decode} are invalid: "
                             "each must be >= 0 and together >= 1")
        for name in _ROUTER_PORT_FLAGS:
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name}={port} is invalid: must be in [0, 65535] (0 picks a free one)")
        asked = [(name, getattr(self, name)) for name in _ROUTER_PORT_FLAGS if getattr(self, name)]
        for i, (name, port) in enumerate(asked):
            for other, other_port in asked[i + 1:]:
                if port == other_port:
                    raise ValueError(f"{name}={port} and {other}={other_port} are invalid: must differ")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"tls_cert={self.tls_cert}, tls_key={self.tls_key} are invalid: give both or neither")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}={path} is invalid: no such file")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s={self.ready_timeout_s} is invalid: must be > 0")


@dataclass(frozen=True)
class ComponentInfo:
    name: str  # "redis", "prefill-0", "decode-1", "router"
    pid: int
    address: str  # host:port
    log_path: str


class _Process:
    """One supervised child, leader of its own process group.

    Exit is detected with waitid(WNOWAIT), which leaves the child a zombie: while it is unreaped its pid (and
    so its process group id) cannot be reused, so killpg() in kill_group_and_reap() can never hit a stranger.
    """

    def __init__(self, name: str, address: str, log_path: Path, popen: subprocess.Popen, log_start_bytes: int = 0):
        self.name = name
        self.address = address
        self.log_path = log_path
        self.popen = popen
        self.log_start_bytes = log_start_bytes  # where this run's output begins in the (appended) log
        self._exit: os.waitid_result | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exited(self) -> bool:
        if self._exit is None and self.popen.returncode is None:
            try:
                self._exit = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return True
        return self._exit is not None or self.popen.returncode is not None

    def describe_exit(self) -> str:
        if self._exit is None:
            return "exited" if self.popen.returncode is None else describe_returncode(self.popen.returncode)
        if self._exit.si_code == os.CLD_EXITED:
            return describe_returncode(self._exit.si_status)
        return describe_returncode(-self._exit.si_status)

    def terminate(self) -> None:
        if not self.exited():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def kill_group_and_reap(self) -> None:
        if self.popen.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait()


def _probe_address(address: str) -> str:
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in ("0.0.0.0", "::", "[::]", "") else address


def _is_serving(channel: grpc.Channel, service: str = "") -> bool:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=_HEALTH_RPC_TIMEOUT_S)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class LocalCluster:
    """redis-server + workers + router as local processes. Not restartable: after stop(), make a new one."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self._redis: RedisServer | None = None
        self._redis_info: ComponentInfo | None = None
        self._workers: list[_Process] = []
        self._router: _Process | None = None
        self._tmp_dir: Path | None = None
        self._router_ports: dict[str, int] = {}  # ClusterConfig's router port fields, 0s resolved; off ones absent
        self._started = False
        self._stopped = False
        # the internal plane's secret, handed to every component in its environment (never on a command line);
        # $DUET_CLUSTER_SECRET, when set, is the documented override
        self.cluster_secret = os.environ.get(ENV_VAR) or generate_cluster_secret()
        # the internal plane's TLS material, handed over the same way ($DUET_INTERNAL_TLS_* override it); the CA's
        # key is not kept, so no other certificate for this cluster can be made
        self.internal_tls = InternalTLS.load() or (internal_tls.generate() if config.internal_tls else None)
        self._stop_signal: int | None = None  # set by request_stop(); plain int so a signal handler may set it

    # ------------------------------------------------------------------------------------------------ start

    def start(self, print_fn: Callable[[str], None] | None = None) -> LocalCluster:
        """Start redis, the workers, then the router, and wait until every component reports SERVING, saying
        what loads through `print_fn` meanwhile (deploy/startup_progress.py; None: silent).

        A router port asked for by number that is taken raises PortInUseError before anything starts. On
        failure everything is stopped and RuntimeError names the component and shows its log tail; on
        request_stop() (e.g. from a signal handler) during the wait, ClusterInterrupted is raised instead.
        """
        if self._started:
            raise RuntimeError("LocalCluster.start() called twice: make a new LocalCluster")
        self._started = True
        cfg = self.config
        self._check_ports_free()
        model_name = Path(cfg.model_dir).name if cfg.model_dir is not None else "the default model"
        progress = StartupProgress(print_fn, model_name)
        try:
            self._tmp_dir = Path(tempfile.mkdtemp(prefix="duet-cluster-"))
            log_dir = Path(cfg.log_dir) if cfg.log_dir is not None else self._tmp_dir / "logs"
            log_dir.mkdir(parents=True, exist_ok=True)
            password = cfg.redis_password if cfg.redis_password is not None else secrets.token_urlsafe(24)
            self._redis = RedisServer(password=password).start()
            self._redis_info = ComponentInfo("redis", self._redis.pid, f"{self._redis.host}:{self._redis.port}",
                                             str(self._redis.log_path))
            roles = ["prefill"] * cfg.num_prefill + ["decode"] * cfg.num_decode
            asked = {name: getattr(cfg, name) for name in _ROUTER_PORT_FLAGS if getattr(cfg, name) is not None}
            ports = pick_free_ports(len(roles) + sum(port == 0 for port in asked.values()))
            self._router_ports = {name: port or ports.pop() for name, port in asked.items()}
            counts = {"prefill": 0, "decode": 0}
            for role, port in zip(roles, ports):
                name = f"{role}-{counts[role]}"
                counts[role] += 1
                self._workers.append(self._launch(name, role, "127.0.0.1", port, log_dir))
                progress.started(name)
            self._router = self._launch("router", "router", cfg.host, self._router_ports["port"], log_dir)
            progress.started("router")
            self._wait_serving(progress)
        except BaseException:
            self.stop()
            raise
        return self

    def _check_ports_free(self) -> None:
        cfg = self.config
        for name, flag in _ROUTER_PORT_FLAGS.items():
            port = getattr(cfg, name)
            if port and not is_port_free(port, cfg.host):
                raise PortInUseError(f"port {port} on {cfg.host} ({flag}) is in use: stop what listens there or "
                                     f"choose another port ({flag} 0 picks a free one)")

    def component_command(self, role: str, host: str, port: int, redis_url: str) -> list[str]:
        """The command line of one component (tests override it to run stand-ins)."""
        cmd = [sys.executable, "-m", "duet", role, "--host", host, "--port", str(port), "--redis-url", redis_url]
        if self.config.model_dir is not None:
            cmd += ["--model", str(self.config.model_dir)]
        if role == "router":
            for name in ("http_port", "metrics_port"):
                if name in self._router_ports:
                    cmd += [_ROUTER_PORT_FLAGS[name], str(self._router_ports[name])]
            if self.config.tls_cert is not None:
                cmd += ["--tls-cert", str(self.config.tls_cert), "--tls-key", str(self.config.tls_key)]
            return cmd + list(self.config.router_args)
        own = self.config.prefill_args if role == "prefill" else self.config.decode_args
        return cmd + list(self.config.worker_args) + list(own)

    def _launch(self, name: str, role: str, host: str, port: int, log_dir: Path) -> _Process:
        log_path = log_dir / f"{name}.log"
        cmd = self.component_command(role, host, port, self.redis_url)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{ENV_VAR: self.cluster_secret})
        if role != "decode" or self.config.num_decode > 1:  # see CO_LOCATED_SPIN_COUNT
            env.setdefault("GOMP_SPINCOUNT", str(CO_LOCATED_SPIN_COUNT))  # a value the user set wins
        if self.internal_tls is not None:
            env.update(self.internal_tls.env())
        env.pop(AUTH_TOKEN_ENV_VAR, None)  # the config is the one source: the router gets its token or none
        if role == "router" and self.config.auth_token:
            env[AUTH_TOKEN_ENV_VAR] = self.config.auth_token
        with open(log_path, "ab") as log_file:
            log_start_bytes = log_file.tell()
            popen = subprocess.Popen(die_with_parent(cmd), stdin=subprocess.DEVNULL, stdout=log_file,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.info("local_cluster: started %s pid=%d address=%s:%d log=%s", name, popen.pid, host, port, log_path)
        return _Process(name, f"{host}:{port}", log_path, popen, log_start_bytes)

    def _reports_serving(self, proc: _Process, channel: grpc.Channel) -> bool:
        if proc.name == "router" and self.config.tls_cert is not None:
            # a plaintext probe cannot reach a TLS port, nor can this one verify a certificate whose CA and
            # names are the user's: the router's own line (printed once its health says SERVING) tells
            with open(proc.log_path, "rb") as f:
                f.seek(proc.log_start_bytes)
                return _ROUTER_SERVING_LINE in f.read()
        # The router's "" turns SERVING once it sees a worker of each role (started before it here): ready then
        # means requests are served, not refused for want of a worker the router has not seen yet.
        return _is_serving(channel)

    def _probe_channel(self, proc: _Process) -> grpc.Channel:
        tls = None if proc.name == "router" else self.internal_tls  # the router's public port is not internal
        return dial(_probe_address(proc.address), _PROBE_CHANNEL_OPTIONS, tls)

    def _wait_serving(self, progress: StartupProgress) -> None:
        timeout_s = self.config.ready_timeout_s
        pending = {p.name: p for p in self._grpc_processes()}
        channels = {name: self._probe_channel(p) for name, p in pending.items()}
        deadline = time.monotonic() + timeout_s
        try:
            while pending:
                if self._stop_signal is not None:
                    raise ClusterInterrupted(f"start interrupted by {signal_name(self._stop_signal)}; "
                                             "all components stopped")
                if self._redis is not None and self._redis.returncode() is not None:
                    raise RuntimeError(self._death_report("redis").removeprefix("duet: component "))
                for name, proc in list(pending.items()):
                    if proc.exited():
                        raise RuntimeError(f"{name} {proc.describe_exit()} before reporting SERVING; "
                                           f"{self._log_tail(proc)}")
                    if self._reports_serving(proc, channels[name]):
                        log.info("local_cluster: %s is SERVING at %s", name, proc.address)
                        progress.serving(name)
                        del pending[name]
                progress.waiting(list(pending))
                if pending and time.monotonic() > deadline:
                    tails = "\n".join(self._log_tail(p) for p in pending.values())
                    raise RuntimeError(f"{', '.join(pending)} did not report SERVING within {timeout_s} s; "
                                       f"{tails}")
                if pending:
                    time.sleep(_POLL_INTERVAL_S)
        finally:
            for channel in channels.values():
                channel.close()

    def _log_tail(self, proc: _Process, max_lines: int = 40) -> str:
        where = f" ({proc.log_path})" if self.config.log_dir is not None else ""
        return f"{proc.name} log tail{where}:\n{tail_file(proc.log_path, max_lines=max_lines)}"

    def _grpc_processes(self) -> list[_Process]:
        return self._workers + ([self._router] if self._router is not None else [])

    # ------------------------------------------------------------------------------------------- accessors

    @property
    def router_address(self) -> str:
        if not self._router_ports:
            raise RuntimeError("the cluster has not been started")
        return f"{self.config.host}:{self._router_ports['port']}"

    @property
    def http_url(self) -> str | None:
        """http://host:port of the router's OpenAI API (its routes under /v1), None when off."""
        if not self._router_ports:
            raise RuntimeError("the cluster has not been started")
        port = self._router_ports.get("http_port")
        return None if port is None else f"http://{_url_host(self.config.host)}:{port}"

    @property
    def metrics_url(self) -> str | None:
        """The router's Prometheus endpoint, None when off."""
        if not self._router_ports:
            raise RuntimeError("the cluster has not been started")
        port = self._router_ports.get("metrics_port")
        return None if port is None else f"http://{_url_host(self.config.host)}:{port}/metrics"

    @property
    def redis_url(self) -> str:
        if self._redis is None:
            raise RuntimeError("the cluster has not been started")
        return self._redis.url

    @property
    def components(self) -> list[ComponentInfo]:
        """redis, then workers, then the router; pids stay listed after stop() (for post-mortems and tests)."""
        out = [self._redis_info] if self._redis_info is not None else []
        out += [ComponentInfo(p.name, p.pid, p.address, str(p.log_path)) for p in self._grpc_processes()]
        return out

    # ------------------------------------------------------------------------------------------ supervision

    def poll(self) -> str | None:
        """The name of a component that has died, else None."""
        if self._redis_died():
            return "redis"
        for proc in self._grpc_processes():
            if proc.exited():
                return proc.name
        return None

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask start()/wait() to return (safe to call from a signal handler or another thread)."""
        self._stop_signal = int(signum)

    @contextlib.contextmanager
    def handle_stop_signals(self) -> Iterator[None]:
        """While inside, SIGINT and SIGTERM call request_stop() instead of killing the launcher.

        Only the main thread can install signal handlers; elsewhere this does nothing. The previous handlers
        are restored on exit.
        """
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            signal.signal(sig, lambda signum, _frame: self.request_stop(signum))
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def wait(self, print_fn: Callable[[str], None] = print) -> int:
        """Supervise until SIGINT/SIGTERM (or request_stop()): a component that dies (a worker, the router or
        redis) is restarted on its port after a backoff (deploy/restarts.py: 1 s, doubling with each restart of
        that component within 300 s, up to 30 s), with a line saying which, how it died and when it comes back;
        the rest keep serving meanwhile (the router routes to the workers it last saw while redis is away, and
        the workers re-register in the new, empty one). Returns 0 for a signal; 1 when redis cannot be restarted
        (its port taken meanwhile), after printing why. Does not stop the cluster."""
        backoff = RestartBackoff()
        with self.handle_stop_signals():
            try:
                while self._stop_signal is None:
                    now = time.monotonic()
                    for name in self._dead_components():
                        if backoff.is_scheduled(name):
                            continue
                        print_fn(f"{self._death_report(name)}\n{backoff.schedule(name, now)}")
                        if name != "redis":
                            self._process(name).kill_group_and_reap()  # what it spawned (TP ranks) goes with it
                    for name in backoff.take_due(now):
                        try:
                            pid = self._restart(name)
                        except RuntimeError as e:  # redis only: a process is started whatever then happens to it
                            print_fn(f"duet: cannot restart {name}: {e}")
                            return 1
                        print_fn(restarted_line(name, pid))
                    time.sleep(_POLL_INTERVAL_S)
            except KeyboardInterrupt:  # handlers could not be installed (not the main thread)
                self._stop_signal = signal.SIGINT
        return 0

    def _dead_components(self) -> list[str]:
        dead = ["redis"] if self._redis_died() else []
        return dead + [p.name for p in self._grpc_processes() if p.exited()]

    def _process(self, name: str) -> _Process:
        return next(p for p in self._grpc_processes() if p.name == name)

    def _restart(self, name: str) -> int:
        """Start a dead component again, on the same host and port; its pid. A worker registers again itself;
        redis comes back empty, on its port with its password."""
        if name == "redis":
            assert self._redis is not None
            self._redis.restart()
            self._redis_info = dataclasses.replace(self._redis_info, pid=self._redis.pid)
            return self._redis.pid
        old = self._process(name)
        host, port = old.address.rsplit(":", 1)
        role = "router" if name == "router" else name.split("-")[0]
        proc = self._launch(name, role, host, int(port), old.log_path.parent)
        if name == "router":
            self._router = proc
        else:
            self._workers[self._workers.index(old)] = proc
        return proc.pid

    def _redis_died(self) -> bool:
        return self._redis is not None and self._redis.data_dir is not None and self._redis.returncode() is not None

    def _death_report(self, name: str) -> str:
        if name == "redis":
            assert self._redis is not None
            how = describe_returncode(self._redis.returncode())
            return death_line("redis", how, f"redis log tail:\n{tail_file(self._redis.log_path)}")
        proc = self._process(name)
        return death_line(name, proc.describe_exit(), self._log_tail(proc))

    # ------------------------------------------------------------------------------------------------ stop

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the router, then the workers, then redis; SIGKILL (the whole process group of) anything
        still running after timeout_s per stage; remove the temp dir. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for stage in ([self._router] if self._router is not None else [], self._workers):
            _terminate_stage(stage, timeout_s)
        if self._redis is not None:
            self._redis.stop(timeout_s)
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None

    def __enter__(self) -> LocalCluster:
        return self if self._started else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _terminate_stage(procs: list[_Process], timeout_s: float) -> None:
    """SIGTERM all, wait up to timeout_s for them together, then SIGKILL every process group and reap."""
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + timeout_s
    while any(not p.exited() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for proc in procs:
        if not proc.exited():
            log.warning("local_cluster: %s (pid %d) ignored SIGTERM for %.1f s; killing it", proc.name, proc.pid,
                        timeout_s)
        proc.kill_group_and_reap()


def run_up(config: ClusterConfig, print_fn: Callable[[str], None] = print) -> int:
    """`duet up`: start the cluster (saying what loads), print one line containing `ready` and the router's
    addresses, supervise it (dead components restarted, see `LocalCluster.wait`) until SIGINT/SIGTERM, stop
    everything. Returns the exit code: 0 after a signal, PORT_IN_USE_EXIT_CODE (2) when a port asked for is
    taken (one line naming it and its flag, nothing started), 1 if a component failed to start or redis could
    not be restarted.

        duet ready: router at 127.0.0.1:50051, OpenAI API at http://127.0.0.1:8000/v1 (1 prefill, 1 decode,
        redis at 127.0.0.1:40123)
    """
    cluster = LocalCluster(config)
    with cluster.handle_stop_signals():
        try:
            try:
                cluster.start(print_fn)
            except PortInUseError as e:
                print_fn(f"duet up failed: {e}")
                return PORT_IN_USE_EXIT_CODE
            except ClusterInterrupted:
                print_fn("duet: interrupted during startup; everything stopped")
                return 0
            except RuntimeError as e:
                print_fn(f"duet up failed: {e}")
                return 1
            redis_address = cluster.components[0].address
            served = [f"router at {cluster.router_address}"]
            if cluster.http_url is not None:
                served.append(f"OpenAI API at {cluster.http_url}/v1")
            if cluster.metrics_url is not None:
                served.append(f"metrics at {cluster.metrics_url}")
            print_fn(f"duet ready: {', '.join(served)} ({config.num_prefill} prefill, {config.num_decode} decode, "
                     f"redis at {redis_address})")
            code = cluster.wait(print_fn=print_fn)
            if code == 0:
                print_fn(f"duet: stopping ({signal_name(cluster._stop_signal or signal.SIGTERM)})")
            return code
        finally:
            cluster.stop()
