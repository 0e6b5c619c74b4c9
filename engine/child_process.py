"""Child processes that die with the process that started them (tensor-parallel follower ranks here; the
local cluster's components, redis-server and the Ray actors' components in deploy/)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1

# Runs in the child before its real command: arm PR_SET_PDEATHSIG, check the parent is still the launcher (it may
# have died before the arming: the signal would then never come), then become the command (same pid; the setting
# survives exec). -S: no site import, ~15 ms.
_TRAMPOLINE = (
    "import ctypes, os, sys\n"
    f"ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, {int(signal.SIGKILL)}, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def die_with_parent(cmd: Sequence[str]) -> list[str]:
    """`cmd` as a command line whose process is SIGKILLed when this process dies: the same command behind a short
    trampoline that arms PR_SET_PDEATHSIG and execs it (same pid, so the caller's Popen tracks the command itself).
    Unchanged off Linux, and off the main thread: PR_SET_PDEATHSIG fires when the *thread* that started the child
    exits, and only the main thread's exit is the process's.

    Why not a `preexec_fn` doing the same: it makes subprocess fork() instead of vfork(), and fork() in a process
    that uses gRPC runs gRPC's fork handlers in the child, which then aborts before exec (SIGABRT, "epoll_wait
    error: Bad file descriptor"; ~1 spawn in 5 while channels are busy, grpcio 1.85: tests/test_child_process.py)."""
    cmd = list(cmd)
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return cmd
    return [sys.executable, "-S", "-c", _TRAMPOLINE, str(os.getpid()), *cmd]
