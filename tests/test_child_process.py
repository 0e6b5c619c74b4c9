"""engine/child_process.py: children started through `die_with_parent` run their command as themselves, die with
their launcher, and start reliably from a process whose gRPC channels are busy (a preexec_fn did not)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest

from engine.child_process import die_with_parent

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@linux
def test_the_command_runs_as_the_started_process_with_its_output_and_exit_code():
    proc = subprocess.run(die_with_parent([sys.executable, "-c", "import sys; print('hi'); sys.exit(3)"]),
                          capture_output=True, text=True)
    assert (proc.returncode, proc.stdout) == (3, "hi\n")
    popen = subprocess.Popen(die_with_parent([shutil.which("sleep"), "30"]))
    try:
        deadline = time.monotonic() + 10
        while open(f"/proc/{popen.pid}/cmdline").read().split("\0")[0] != shutil.which("sleep"):
            assert time.monotonic() < deadline, "the trampoline never exec'd the command"
            time.sleep(0.01)
    finally:
        popen.kill()
        popen.wait()


@linux
def test_the_child_refuses_to_run_when_its_parent_is_not_the_launcher(tmp_path):
    cmd = die_with_parent(["touch", str(tmp_path / "ran")])
    cmd[cmd.index("-c") + 2] = "1"  # as if the launcher had died and the child been re-parented to init
    assert subprocess.run(cmd).returncode == 1
    assert not (tmp_path / "ran").exists()


@linux
def test_the_child_dies_with_a_sigkilled_launcher(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys\n"
                               "from engine.child_process import die_with_parent\n"
                               "child = subprocess.Popen(die_with_parent(['sleep', '60']))\n"
                               "print(child.pid, flush=True)\n"
                               "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child_pid = int(launcher.stdout.readline())
    assert _alive(child_pid)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while _alive(child_pid):
        assert time.monotonic() < deadline, f"child {child_pid} outlived its launcher"
        time.sleep(0.02)


def test_off_the_main_thread_the_command_is_left_as_it_is():
    out = []
    thread = threading.Thread(target=lambda: out.append(die_with_parent(["redis-server", "x.conf"])))
    thread.start()
    thread.join()
    assert out == [["redis-server", "x.conf"]]


@linux
def test_children_start_while_grpc_channels_are_busy():
    """With a preexec_fn (fork, gRPC's fork handlers in the child) ~1 spawn in 5 aborted here (grpcio 1.85); 60
    spawns all succeed now (vfork: no fork handlers run)."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                try:
                    grpc.channel_ready_future(channel).result(timeout=1)
                except grpc.FutureTimeoutError:
                    pass

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        codes = [subprocess.run(die_with_parent(["true"]), start_new_session=True).returncode for _ in range(60)]
    finally:
        stop.set()
        thread.join(timeout=5)
        server.stop(None)
    assert codes == [0] * 60
