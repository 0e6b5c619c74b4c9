"""SIGTERM and SIGINT as something a server's main thread waits for, whichever thread the kernel hands them to.

Why not `signal.signal(SIGTERM, lambda *_: done.set())` and `done.wait()`: Python runs a handler only in the
main thread, between bytecodes. The kernel gives a process's signal to any thread that does not block it, and
in a router that is often one of gRPC's or uvicorn's busy threads. A main thread asleep in `Event.wait()` (a
futex) is then never woken, so the handler never runs: a router ignored SIGTERM until it was SIGKILLed.
Python's C-level handler, on whichever thread it runs, also writes the signal's number to the wakeup fd
(`signal.set_wakeup_fd`); the main thread sleeps on that fd instead and wakes wherever the signal landed.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Inside `with StopSignals() as stop:` SIGTERM and SIGINT no longer end the process: `stop.wait()` returns
    the first one's number (one sent before `wait` is called is kept). Main thread only (the rule of
    `signal.set_wakeup_fd`); on exit the previous handlers and wakeup fd are back. A signal that arrives after
    the first is absorbed while inside."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.signals = frozenset(int(s) for s in signals)
        self.received: int | None = None
        self._read_fd = self._write_fd = -1
        self._previous_handlers: dict[int, object] = {}
        self._previous_wakeup_fd = -1

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopSignals must be entered from the main thread (signal.set_wakeup_fd's rule)")
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # set_wakeup_fd requires it: a signal handler must never block
        # the fd first: a signal between the two steps still finds its byte written
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for sig in self.signals:
            # the Python-level handler does nothing: the byte in the pipe is what wait() reads
            self._previous_handlers[sig] = signal.signal(sig, lambda *_: None)
        return self

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The number of the first stop signal, once it has arrived (at once if it already had); None when
        `timeout_s` passes first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.received is None:
            remaining_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self._read_fd], [], [], remaining_s)
            if not readable:
                return None
            # bytes of other signals with Python handlers land here too: only ours count
            self.received = next((b for b in os.read(self._read_fd, 64) if b in self.signals), None)
        return self.received

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
