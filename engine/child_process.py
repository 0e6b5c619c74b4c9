"""Child processes that die with the process that started them (tensor-parallel follower ranks here; the
local cluster's components and redis-server in deploy/)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def parent_death_preexec() -> Callable[[], None] | None:
    """A `preexec_fn` that SIGKILLs the child when the launcher dies, or None where that is unavailable.

    Linux only. PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so it is used only when
    called from the main thread (whose exit is the process's). The child checks its parent is still the
    launcher after arming, which closes the race where the launcher dies between fork and prctl.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork: the child only calls it
    except (OSError, AttributeError):
        return None
    launcher_pid = os.getpid()
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != launcher_pid:
            os._exit(1)

    return preexec
