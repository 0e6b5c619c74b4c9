"""Restarting dead components: when, and in what words. `duet up` (deploy/local_cluster.py) and `duet ray up`
(deploy/ray/launcher.py) both supervise through this, so a dead worker or router comes back after the same
backoff and the same three lines say it:

    duet: component decode-0 was killed by SIGKILL; decode-0 log tail: ...
    duet: restarting decode-0 in 1 s (restart 1 within 300 s)
    duet: decode-0 restarted (pid 4242)
"""

from __future__ import annotations

import signal

RESTART_BACKOFF_S = 1.0  # a dead worker or router is started again after this, doubling with each recent restart
RESTART_WINDOW_S = 300.0  # restarts longer ago than this no longer lengthen the backoff
MAX_RESTART_BACKOFF_S = 30.0


class RestartBackoff:
    """Per component name: a restart is due RESTART_BACKOFF_S after the component was found dead, doubled for
    each restart of it within the last RESTART_WINDOW_S, at most MAX_RESTART_BACKOFF_S. `schedule` it when it is
    found dead, start it when `take_due` names it (that counts as its restart), `cancel` it if the component is
    stopped for good meanwhile. Times are the caller's monotonic clock."""

    def __init__(self, base_s: float = RESTART_BACKOFF_S, window_s: float = RESTART_WINDOW_S,
                 max_s: float = MAX_RESTART_BACKOFF_S):
        if not 0 < base_s <= max_s or window_s <= 0:
            raise ValueError(f"base_s={base_s:g}, max_s={max_s:g}, window_s={window_s:g} are invalid: "
                             "need 0 < base_s <= max_s and window_s > 0")
        self.base_s, self.window_s, self.max_s = base_s, window_s, max_s
        self._restarted_at: dict[str, list[float]] = {}
        self._due_at: dict[str, float] = {}

    def is_scheduled(self, name: str) -> bool:
        return name in self._due_at

    def schedule(self, name: str, now_s: float) -> str:
        """Plan the restart of `name`, found dead at `now_s`; returns the line that says when."""
        recent = [t for t in self._restarted_at.get(name, []) if now_s - t < self.window_s]
        self._restarted_at[name] = recent
        delay_s = min(self.max_s, self.base_s * 2 ** len(recent))
        self._due_at[name] = now_s + delay_s
        return f"duet: restarting {name} in {delay_s:g} s (restart {len(recent) + 1} within {self.window_s:g} s)"

    def take_due(self, now_s: float) -> list[str]:
        """The components whose restart is due by `now_s`, in the order they died; each counts as restarted."""
        due = [name for name, t in self._due_at.items() if t <= now_s]
        for name in due:
            del self._due_at[name]
            self._restarted_at.setdefault(name, []).append(now_s)
        return due

    def cancel(self, name: str) -> None:
        self._due_at.pop(name, None)


def death_line(name: str, how: str, log_tail: str) -> str:
    """`how` as describe_returncode words it."""
    return f"duet: component {name} {how}; {log_tail}"


def restarted_line(name: str, pid: int) -> str:
    return f"duet: {name} restarted (pid {pid})"


def describe_returncode(code: int) -> str:
    """A Popen returncode in words: 'exited with code 1', 'was killed by SIGKILL'."""
    return f"exited with code {code}" if code >= 0 else f"was killed by {signal_name(-code)}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
