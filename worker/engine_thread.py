"""The one thread that owns a worker's engine (scheduler, block pool, KV cache tensors' writers).

Other threads (gRPC handlers) never touch engine state: they `post` a function, which runs on the engine
thread between two steps, and wait on the returned future. So the engine needs no locks, and every
mutation is ordered with the steps.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from engine.cpu_threads import name_os_thread

log = logging.getLogger("duet.engine_thread")


class EngineThread:
    def __init__(
        self,
        name: str,
        has_work: Callable[[], bool],
        step: Callable[[], None],
        tick: Callable[[], None] | None = None,
        tick_interval_s: float = 0.05,
    ):
        self._has_work = has_work
        self._step = step
        self._tick = tick
        self._tick_interval_s = tick_interval_s
        self._calls: queue.SimpleQueue[tuple[Future, Callable, tuple]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None  # set if a step raised: the worker is broken

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._calls.put((Future(), lambda: None, ()))  # wake it
        self._thread.join(timeout=timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def post(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run fn(*args) on the engine thread before its next step; the future holds the result or error."""
        future: Future = Future()
        if not self.alive:
            future.set_exception(RuntimeError(f"engine thread is down: {self.error!r}"))
            return future
        self._calls.put((future, fn, args))
        return future

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 30.0) -> Any:
        return self.post(fn, *args).result(timeout=timeout_s)

    def _run_calls(self, block: bool) -> None:
        try:
            item = self._calls.get(timeout=self._tick_interval_s) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while True:
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - the caller gets it
                    future.set_exception(e)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        name_os_thread(self._thread.name)  # before the first step: its OpenMP pool takes the name too
        while not self._stop.is_set():
            try:
                self._run_calls(block=not self._has_work())
                if self._tick is not None:
                    self._tick()
                if self._has_work() and not self._stop.is_set():
                    self._step()
            except BaseException as e:  # noqa: BLE001
                log.exception("engine thread failed: %r", e)
                self.error = e
                break
        # fail whatever is still queued, so no caller waits forever
        while True:
            try:
                future, _, _ = self._calls.get_nowait()
            except queue.Empty:
                break
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("engine thread stopped"))
