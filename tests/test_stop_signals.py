"""engine/stop_signals.py in a real process: the kernel may hand SIGTERM to any thread that does not block it;
here the main thread blocks it, so it surely lands on another one, as it did on a busy router."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import signal, threading, time
    from engine.stop_signals import StopSignals

    with StopSignals() as stop:
        assert stop.wait(0.05) is None  # nothing yet: the timeout passes
        bystander = threading.Thread(target=time.sleep, args=(60,), daemon=True)
        bystander.start()  # started before the mask below, so it takes SIGTERM
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # this thread only
        print("ready", flush=True)
        started = time.monotonic()
        print("stop.wait", stop.wait(30.0), flush=True)
        print("woke_after_s", round(time.monotonic() - started), flush=True)
        assert stop.wait(0) == signal.SIGTERM  # the first stop signal is kept
""")


def run_child() -> list[str]:
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, out
    return out.splitlines()


def test_stop_signals_wake_the_main_thread_when_another_thread_takes_sigterm():
    assert run_child() == [f"stop.wait {int(signal.SIGTERM)}", "woke_after_s 0"]

