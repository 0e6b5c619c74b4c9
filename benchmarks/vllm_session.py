"""A peer engine as a benchmark session: a worker script in the peer's own venv (`vllm_worker.py --serve`,
`llama_cpp_worker.py --serve`), one timed cell per request.

    with VllmSession(cmd) as vllm:        # cmd ends in --serve; returns once the engine is built and warm
        rate = vllm.cell(batch=8, repeat=0)   # output tokens/s of one timed generate call
    with PeerSession(cmd, LLAMA_READY, LLAMA_CELL) as llama:
        reply = llama.ask(batch=8, repeat=0)  # the worker's JSON answer for that cell

offline_throughput.py alternates these cells with duet's, so both engines see the same machine: on a
shared machine whose speed drifts by 20-30 % over minutes, timing one engine's whole matrix and then the
other's measures the drift as much as the engines. The protocol is one JSON line each way (see
vllm_worker.py); vLLM's logs go to a temporary file whose tail is quoted if the worker fails.

Between cells the worker's whole process group is stopped (SIGSTOP, SIGCONT before the next cell): an idle
vLLM still polls its queues (~7 % of a core here), which would be taken from the engine being timed.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import tempfile
import time

from vllm_worker import CELL_PREFIX, READY_PREFIX


class VllmSessionError(RuntimeError):
    pass


class PeerSession:
    """A worker speaking the protocol: one `ready_prefix` JSON line once warm, then per stdin line
    `{"batch": B, "repeat": R}` one `cell_prefix` JSON line echoing both."""

    def __init__(self, cmd: list[str], ready_prefix: str, cell_prefix: str, ready_timeout_s: float = 3600.0,
                 cell_timeout_s: float = 1800.0):
        self.ready_prefix, self.cell_prefix = ready_prefix, cell_prefix
        self.cell_timeout_s = cell_timeout_s
        self._log = tempfile.TemporaryFile(mode="w+")
        self._pending = b""
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      text=True, bufsize=1, start_new_session=True)  # its own group: see pause
        self._paused = False
        try:
            ready = self._read(ready_prefix, ready_timeout_s)
        except BaseException:
            self.close()
            raise
        self.pause()
        self.ready: dict = ready
        self.startup_s: float = ready["startup_s"]
        self.check_token_ids: list[int] = ready["check_token_ids"]
        self.env: dict = ready["env"]

    def pause(self) -> None:
        """Stop every process of the worker (vLLM's engine core and model worker included) until `resume`."""
        if not self._paused and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        if self._paused:
            os.killpg(self._proc.pid, signal.SIGCONT)
            self._paused = False
            time.sleep(0.5)  # let its processes get back to waiting on the queue before the timed call

    def ask(self, batch: int, repeat: int, **fields) -> dict:
        """The worker's answer for one timed cell (batch, repeat, and any `fields` the worker reads)."""
        self.resume()
        self._proc.stdin.write(json.dumps({"batch": batch, "repeat": repeat, **fields}) + "\n")
        self._proc.stdin.flush()
        try:
            got = self._read(self.cell_prefix, self.cell_timeout_s)
        finally:
            self.pause()
        if (got["batch"], got["repeat"]) != (batch, repeat):
            raise VllmSessionError(f"asked for batch {batch} repeat {repeat}, got {got}")
        return got

    def close(self) -> None:
        """End the worker: stdin closed, up to 60 s to exit, then its process group is killed (what is left of it)."""
        self.resume()
        if self._proc.stdin and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:  # the whole group: vLLM's engine-core and model-worker processes can outlive the worker script
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait()
        self._log.close()

    def __enter__(self) -> PeerSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self, prefix: str, timeout_s: float) -> dict:
        """The JSON after `prefix` on the worker's next such stdout line, within timeout_s. Reads the pipe's file
        descriptor itself: a buffered reader could hold a complete line that select() would never report."""
        deadline = time.monotonic() + timeout_s
        fd = self._proc.stdout.fileno()
        while True:
            while b"\n" not in self._pending:
                left = deadline - time.monotonic()
                ready, _, _ = select.select([fd], [], [], max(left, 0))
                if not ready:
                    raise VllmSessionError(f"no {prefix.strip()} line from the worker within {timeout_s:.0f} s"
                                           f"{self._log_tail()}")
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise VllmSessionError(f"the worker exited {self._proc.wait()}{self._log_tail()}")
                self._pending += chunk
            line, _, self._pending = self._pending.partition(b"\n")
            text = line.decode(errors="replace")
            if text.startswith(prefix):
                return json.loads(text.removeprefix(prefix))

    def _log_tail(self, lines: int = 3) -> str:
        self._log.flush()
        self._log.seek(0)
        tail = [line.strip() for line in self._log.read().splitlines() if line.strip()][-lines:]
        return f": {' | '.join(tail)}" if tail else ""


class VllmSession(PeerSession):
    """vllm_worker.py --serve: `cell` is the output tokens/s of one timed `generate` of the benchmark's prompts."""

    def __init__(self, cmd: list[str], ready_timeout_s: float = 3600.0, cell_timeout_s: float = 1800.0):
        super().__init__(cmd, READY_PREFIX, CELL_PREFIX, ready_timeout_s, cell_timeout_s)

    def cell(self, batch: int, repeat: int) -> float:
        return float(self.ask(batch, repeat)["output_tokens_per_s"])
