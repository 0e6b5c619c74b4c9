"""One duet component as a Ray actor: the actor runs `python -m duet <role> ...` as its child process.

The child gets its own session (torch and gRPC threads never live in Ray's worker process) and dies with the
actor's process (PR_SET_PDEATHSIG where available). Readiness is grpc.health.v1 SERVING, checked by the actor
on its own node, so it works whatever the node's network looks like from the driver.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ray

from cluster.grpc_plumbing import LIVENESS_SERVICE, health_check
from cluster.internal_tls import InternalTLS
from deploy.redis_server import tail_file
from engine.child_process import die_with_parent
from engine.ports import pick_free_port

log = logging.getLogger(__name__)

_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
_HEALTH_RPC_TIMEOUT_S = 0.5




@ray.remote
class RankHolder:
    """Holds one extra tensor-parallel rank's bundle (its GPU) in a worker's placement group."""

    def gpu_ids(self) -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]


@ray.remote
class ComponentActor:
    """One duet component (`python -m duet <role> ...`) as a child process of this actor.

    start() returns the component's address once it reports SERVING, or raises RuntimeError with its log
    tail; stop() always leaves no child behind (SIGTERM, then SIGKILL of its process group); relaunch() starts
    the same command again, on the same port, after stop() (the launcher's restart of a dead component)."""

    def __init__(self, name: str):
        self.name = name
        self.popen: subprocess.Popen | None = None
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"duet-ray-{name}-{os.getpid()}.log"
        self._cmd: list[str] = []
        self._env: dict[str, str] = {}

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
        self._cmd, self._env = cmd, env
        self._spawn()
        deadline = time.monotonic() + ready_timeout_s
        # a router's "" is NOT_SERVING while no worker of a role is up (a pool may start at 0): its process health
        service = LIVENESS_SERVICE if role == "router" else ""
        # a worker under internal TLS answers only a client with the cluster's certificate (this actor's runtime
        # env holds it); the router's port is public
        tls = None if role == "router" else InternalTLS.load()
        while not health_check(f"127.0.0.1:{port}", _HEALTH_RPC_TIMEOUT_S, service, tls):
            exited = self._exited()
            if exited or time.monotonic() > deadline:
                code = self.stop(timeout_s=0.0)
                how = f"exited with code {code}" if exited else f"was not SERVING within {ready_timeout_s} s"
                raise RuntimeError(f"{self.name} {how}; log tail:\n{tail_file(self.log_path)}")
            time.sleep(0.2)
        return f"{host}:{port}"

    def _spawn(self) -> None:
        with open(self.log_path, "ab") as log_file:
            self.popen = subprocess.Popen(die_with_parent(self._cmd), stdin=subprocess.DEVNULL, stdout=log_file,
                                          stderr=subprocess.STDOUT, env=self._env, cwd=_PROJECT_ROOT,
                                          start_new_session=True)  # dies with this actor's process

    def relaunch(self) -> int:
        """Start the command of start() again (same port, same environment, same log file) and return the new
        child's pid at once: readiness is the component's own business, as after `duet up` restarts one.
        Only after stop() has reaped the previous child."""
        if self.popen is None or self.popen.returncode is None:
            raise RuntimeError(f"{self.name}: relaunch() needs a started, stopped component")
        self._spawn()
        return self.popen.pid

    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def log_tail(self) -> str:
        return tail_file(self.log_path)

    def alive(self) -> bool:
        return self.popen is not None and not self._exited()

    def _exited(self) -> bool:
        """Without reaping: an unreaped child's pid, and so its process group id, cannot be reused, so the
        killpg in stop() can never hit a stranger."""
        if self.popen is None or self.popen.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, up to timeout_s for a graceful exit, then SIGKILL of the child's whole process group (its
        own session: anything it spawned goes too); reaps it. The child's exit code (negative: the signal
        that ended it), None if it was never started."""
        if self.popen is None:
            return None
        if not self._exited():
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while not self._exited() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self._exited() and timeout_s > 0:
            log.warning("ray_launcher: %s ignored SIGTERM for %.1f s; killing it", self.name, timeout_s)
        if self.popen.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        return self.popen.wait()
