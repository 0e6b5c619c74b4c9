"""What `duet up` says while its components start: model loading takes from seconds (a tiny checkpoint) to
minutes (an 8B model on CPU), and a silent terminal reads as a hang.

    duet: loading SmolLM2-135M-Instruct in prefill-0 ...      one line as each component is started
    duet: starting the router ...
    duet: router serving (1.9 s)                              one line as each reports SERVING
    duet: still waiting for prefill-0 (30 s)                 while any is pending, one line per REMIND_S
    duet: prefill-0 serving (41.2 s)

Plain lines on a terminal and in a log alike: a handful per component, never a redraw, so a non-tty log is
not flooded with progress-bar frames.
"""

from __future__ import annotations

import time
from collections.abc import Callable

REMIND_S = 30.0


class StartupProgress:
    """Prints through `print_fn`; None prints nothing (a program driving LocalCluster itself)."""

    def __init__(self, print_fn: Callable[[str], None] | None, model_name: str,
                 clock: Callable[[], float] = time.monotonic):
        self._print = print_fn
        self._model_name = model_name
        self._clock = clock
        self._started_s = clock()
        self._reminded_s = self._started_s

    def _say(self, line: str) -> None:
        if self._print is not None:
            self._print(line)

    def started(self, name: str) -> None:
        if name == "router":
            self._say("duet: starting the router ...")
        else:
            self._say(f"duet: loading {self._model_name} in {name} ...")

    def serving(self, name: str) -> None:
        self._say(f"duet: {name} serving ({self._clock() - self._started_s:.1f} s)")

    def waiting(self, pending: list[str]) -> None:
        """Called on every poll while components are pending; says so once per REMIND_S."""
        now = self._clock()
        if pending and now - self._reminded_s >= REMIND_S:
            self._reminded_s = now
            self._say(f"duet: still waiting for {', '.join(pending)} ({now - self._started_s:.0f} s)")
