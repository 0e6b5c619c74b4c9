"""engine/cpu_threads.py: only the engine thread of a worker keeps an OpenMP pool. Each case runs in a fresh
process (pools live as long as their threads, so this test process's own history must not count) and counts the
process's OS threads: a pool adds one worker thread per extra CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.cpu_threads import call_on_own_thread

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2 or sys.platform != "linux",
                                reason="pools need two CPUs to have workers; counted through /proc")

PROBE = r"""
import os, sys, threading
import torch
from engine.cpu_threads import call_on_own_thread, confine_to_one_cpu_thread, name_os_thread
torch.set_num_threads(2)

def threads():
    return len(os.listdir("/proc/self/task"))

def named(name):
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == name for t in os.listdir("/proc/self/task"))

def big_op():
    torch.ones(4_000_000).mul_(2)  # far past torch's grain size: parallel when allowed

def on_thread(fn):  # a long-lived helper thread (it stays alive while counted)
    done, release = threading.Event(), threading.Event()
    def run():
        fn()
        done.set()
        release.wait()
    t = threading.Thread(target=run)
    t.start()
    done.wait()
    return release

mode = sys.argv[1]
before = threads()
if mode == "confined":
    release = on_thread(lambda: (confine_to_one_cpu_thread(), big_op()))
    print(threads() - before - 1)  # less the helper thread itself
elif mode == "named":  # the thread and its pool worker carry the name; the name is cut to 15 bytes
    release = on_thread(lambda: (name_os_thread("decode-engine-of-a-worker"), big_op()))
    print(named("decode-engine-o"))
elif mode == "plain":
    release = on_thread(big_op)
    print(threads() - before - 1)
elif mode == "loaded_off_thread":
    import time
    call_on_own_thread(big_op)  # the loader's pool goes with its thread (its workers exit as it ends)
    deadline = time.monotonic() + 5
    while threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    print(threads() - before)
if mode != "loaded_off_thread":
    release.set()
"""


def pool_threads_added(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_a_confined_thread_starts_no_pool_where_a_plain_one_does():
    assert pool_threads_added("plain") == 1  # two CPUs: the thread itself and one pool worker
    assert pool_threads_added("confined") == 0


def test_loading_on_its_own_thread_leaves_no_pool_behind():
    assert pool_threads_added("loaded_off_thread") == 0


def test_a_named_thread_gives_its_name_to_the_pool_it_starts():
    assert pool_threads_added("named") == 2


def test_call_on_own_thread_returns_or_raises_what_the_call_did():
    assert call_on_own_thread(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(KeyError, match="nope"):
        call_on_own_thread(lambda: {}["nope"])
