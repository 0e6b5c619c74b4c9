"""A private redis-server process: free loopback port, own temporary dir, no persistence.

Used by `duet up` (deploy/local_cluster.py) and by tests that need a real Redis. The server is started in its
own session, so a Ctrl-C in the terminal reaches only the launcher, which stops Redis last. On Linux, when
started from the main thread, it also dies with the launcher (PR_SET_PDEATHSIG), so no redis-server outlives
a killed launcher.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis

from engine.child_process import die_with_parent
from engine.ports import pick_free_port

log = logging.getLogger(__name__)

_HOST = "127.0.0.1"
_MAX_PORT_ATTEMPTS = 5
_PORT_IN_USE_MARKERS = ("Address already in use", "Failed listening on port")


def tail_file(path: str | Path, max_lines: int = 40, max_bytes: int = 16384) -> str:
    """The last lines of a log file ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    lines = data.decode("utf-8", errors="replace").splitlines()
    return "\n".join(lines[-max_lines:])


def _conf_quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class RedisServer:
    """A redis-server on a free loopback port with its own temporary dir; stopped and removed on stop().

    `url` carries the password (URL-quoted), so `redis.Redis.from_url(server.url)` just works. Nothing is
    persisted: no RDB snapshots, no AOF. `port=0` picks a free port and retries with another one if another
    process takes it first; a fixed port (e.g. to restart a server "in place" in a test) is used as given.
    """

    def __init__(self, password: str | None = None, port: int = 0, maxmemory: str | None = "256mb",
                 maxmemory_policy: str = "volatile-lru", executable: str = "redis-server"):
        if not 0 <= port <= 65535:
            raise ValueError(f"port={port} is invalid: must be in [0, 65535] (0 picks a free one)")
        self._password = password
        self._requested_port = port
        self._maxmemory = maxmemory
        self._maxmemory_policy = maxmemory_policy
        self._executable = executable
        self._port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._dir: Path | None = None
        self._log_file = None

    # ----------------------------------------------------------------------------------------------- lifecycle

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING. Raises RuntimeError naming the cause (with the
        server's log tail); on failure nothing is left behind."""
        if self._proc is not None:
            raise RuntimeError(f"redis-server already started (pid {self._proc.pid}, port {self._port})")
        exe = shutil.which(self._executable)
        if exe is None:
            raise RuntimeError(
                f"redis-server not found (executable={self._executable!r}): install it with "
                "`apt-get install -y redis-server` (Debian/Ubuntu) or `brew install redis` (macOS), "
                "or pass the path to a redis-server binary")
        attempts = _MAX_PORT_ATTEMPTS if self._requested_port == 0 else 1
        try:
            for attempt in range(1, attempts + 1):
                port = self._requested_port or pick_free_port()
                error = self._start_once(exe, port, timeout_s)
                if error is None:
                    log.info("redis-server started pid=%d port=%d dir=%s", self.pid, self.port, self._dir)
                    return self
                port_taken = any(m in error for m in _PORT_IN_USE_MARKERS)
                self._stop_process(timeout_s=2.0)
                if not (port_taken and attempt < attempts):
                    raise RuntimeError(error)
                log.info("redis-server port %d was taken (attempt %d/%d); trying another", port, attempt, attempts)
            raise AssertionError("unreachable")
        except BaseException:
            self.stop()
            raise

    def _start_once(self, exe: str, port: int, timeout_s: float) -> str | None:
        """Launch on `port` and wait for PING from *this* process; an error message, or None when up."""
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="duet-redis-"))
        conf_path = self._dir / "redis.conf"
        conf_path.write_text(self._conf_text(port))
        log_path = self.log_path
        self._log_file = open(log_path, "ab")
        self._port = port
        self._proc = subprocess.Popen(die_with_parent([exe, str(conf_path)]), stdin=subprocess.DEVNULL,
                                      stdout=self._log_file, stderr=subprocess.STDOUT, cwd=self._dir,
                                      start_new_session=True)
        client = redis.Redis(host=_HOST, port=port, password=self._password, socket_timeout=1.0,
                             socket_connect_timeout=1.0, retry=None)
        deadline = time.monotonic() + timeout_s
        last_error = "no answer yet"
        try:
            while True:
                code = self._proc.poll()
                if code is not None:
                    return (f"redis-server exited with code {code} during startup (port {port}); "
                            f"log tail:\n{tail_file(log_path)}")
                try:
                    # Ask for the pid: another server that grabbed the port first must not pass for ours.
                    if client.info("server").get("process_id") == self._proc.pid:
                        return None
                    last_error = f"another process answers on port {port}"
                except redis.RedisError as e:
                    last_error = f"{type(e).__name__}: {e}"
                if time.monotonic() > deadline:
                    return (f"redis-server (pid {self._proc.pid}, port {port}) did not answer PING within "
                            f"{timeout_s} s ({last_error}); log tail:\n{tail_file(log_path)}")
                time.sleep(0.02)
        finally:
            client.close()

    def _conf_text(self, port: int) -> str:
        lines = [
            f"port {port}",
            f"bind {_HOST}",
            "protected-mode yes",
            "daemonize no",
            f"dir {_conf_quote(str(self._dir))}",
            'logfile ""',  # stdout, which goes to redis.log
            'save ""',
            "appendonly no",
            f"maxmemory-policy {self._maxmemory_policy}",
        ]
        if self._maxmemory is not None:
            lines.append(f"maxmemory {self._maxmemory}")
        if self._password is not None:
            lines.append(f"requirepass {_conf_quote(self._password)}")
        return "\n".join(lines) + "\n"

    def restart(self, timeout_s: float = 10.0) -> RedisServer:
        """Start a server that died again, on its port with its password; it comes back empty (nothing is
        persisted), and the workers re-register and resync their index entries on their own. RuntimeError
        (with the log tail) if it cannot, e.g. another process took the port meanwhile."""
        if self._port is None or self._dir is None:
            raise RuntimeError("redis-server was never started (or was stopped): start() it instead")
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"redis-server is still running (pid {self._proc.pid})")
        self._stop_process(timeout_s=0.0)  # reap and close the old log handle
        exe = shutil.which(self._executable)
        error = self._start_once(exe, self._port, timeout_s) if exe else f"{self._executable} is gone"
        if error is not None:
            self._stop_process(timeout_s=2.0)
            raise RuntimeError(error)
        log.info("redis-server restarted pid=%d port=%d", self.pid, self.port)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; removes the temporary dir. Idempotent."""
        self._stop_process(timeout_s)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _stop_process(self, timeout_s: float) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("redis-server pid=%d ignored SIGTERM for %.1f s; killing it", proc.pid, timeout_s)
                    proc.kill()
                    proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> RedisServer:
        return self if self._proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----------------------------------------------------------------------------------------------- accessors

    @property
    def password(self) -> str | None:
        return self._password

    @property
    def url(self) -> str:
        """redis://[:password@]127.0.0.1:port/0"""
        auth = f":{quote(self._password, safe='')}@" if self._password is not None else ""
        return f"redis://{auth}{_HOST}:{self.port}/0"

    @property
    def host(self) -> str:
        return _HOST

    @property
    def port(self) -> int:
        if self._port is None or self._proc is None:
            raise RuntimeError("redis-server is not running: call start() first")
        return self._port

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("redis-server is not running: call start() first")
        return self._proc.pid

    @property
    def log_path(self) -> Path:
        if self._dir is None:
            raise RuntimeError("redis-server has no directory: call start() first")
        return self._dir / "redis.log"

    @property
    def data_dir(self) -> Path | None:
        """The temporary dir (config, log); None before start and after stop."""
        return self._dir

    def returncode(self) -> int | None:
        """None while running (or never started), else the exit code (negative: killed by that signal)."""
        return None if self._proc is None else self._proc.poll()
