"""Which threads of a worker process may run OpenMP parallel regions: the engine thread alone.

Why: OpenMP (libgomp, torch's and the C kernels' runtime) keeps a pool of worker threads for every thread that ever
ran a parallel region, for as long as that thread lives. Once a process holds more pool threads than it has CPUs,
libgomp throttles every pool: its workers stop spinning after a region and sleep, so each of a decode step's ~150
regions (one per C kernel call) starts with a futex wake-up. On the 2-core VM a small GEMV costs 18 us called
from the thread that loaded the model and ~65 us from a second thread once the loader's pool exists; the default
model's decode step went from 6.1 ms to 9.7 ms per token (2026-11-28). A serving worker loads its model on one
thread and steps it on another (worker/engine_thread.py), so:

- `call_on_own_thread` runs the loading on a thread that ends: its pool goes with it;
- `confine_to_one_cpu_thread` makes a helper thread (KV receive, gRPC handlers) run torch's ops on itself alone, so
  it never starts a pool of its own.

The offline `LLM` loads and steps on the caller's thread: one pool, nothing to do.

`name_os_thread` names the engine thread for the OS, and so its pool: Python (before 3.14) leaves every thread the
process's name, so `top -H`, perf and /proc could not tell the engine's threads from a gRPC handler's.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def call_on_own_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on a new thread, waited for: its result, or the exception it raised."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            outcome.append((False, e))

    thread = threading.Thread(target=run, name=f"{threading.current_thread().name}-load")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def confine_to_one_cpu_thread() -> None:
    """Make the calling thread's torch ops single-threaded (no OpenMP pool of its own); other threads keep theirs.

    torch reads the calling thread's OpenMP thread count (`omp_get_max_threads`) when it decides to go parallel, and
    sets it from the process-wide count on the thread's first such question: ask once, then set it to 1."""
    import torch  # here: the router's gRPC server confines its threads too, and needs no torch before

    torch.get_num_threads()  # torch's per-thread initialisation, which would overwrite the 1 below
    openmp = _openmp()
    if openmp is not None:
        openmp.omp_set_num_threads(1)


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` (its first 15 bytes: the kernel's limit) as its OS name (/proc/PID/task/TID/comm),
    which threads it starts afterwards inherit, an OpenMP pool's workers among them. Linux only; elsewhere nothing."""
    if sys.platform != "linux":
        return
    pr_set_name = 15
    ctypes.CDLL(None).prctl(pr_set_name, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (by its soname: the one already in the process), or None where torch runs on
    another (a build without libgomp: nothing to confine)."""
    try:
        return ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return None
