"""`duet up` and `duet client` as a user runs them: real processes, stdout parsed, signals sent."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.local_cluster import ClusterConfig, LocalCluster
from engine import LLM, SamplingParams
from engine.ports import pick_free_ports
from router.server import STOP_MARGIN_S


def children_of(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] if Path(f"/proc/{pid}").exists() else "X"
    return state not in ("Z", "X")


def start_up(model_dir: Path, tmp: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    up = subprocess.Popen(
        [sys.executable, "-m", "duet", "up", "--model", str(model_dir), "--port", "0", "--num-kv-blocks", "128",
         *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    deadline = time.monotonic() + 180
    lines = []
    while time.monotonic() < deadline:
        line = up.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "ready" in line:
            return up, re.search(r"router at (\S+)", line).group(1)
    up.kill()
    pytest.fail(f"duet up never printed a ready line:\n{''.join(lines)}")


def test_up_then_client_then_sigterm_leaves_nothing_behind(tiny_llama_dir, tmp_path):
    up, address = start_up(tiny_llama_dir, tmp_path)
    try:
        kids = children_of(up.pid)
        assert len(kids) == 4  # redis, router, prefill, decode
        out = subprocess.run(
            [sys.executable, "-m", "duet", "client", "--addr", address, "--prompt-ids", "5,6,7,8", "--max-tokens",
             "6", "--ignore-eos", "--json"], capture_output=True, text=True, timeout=60, check=True,
        )
        record = json.loads(out.stdout)
        ref = LLM(tiny_llama_dir, num_kv_blocks=128).generate(
            [[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].outputs[0]
        assert record["token_ids"] == ref.token_ids and record["text"] == ref.text
        assert record["finish_reason"] == "length" and record["cached_tokens"] == 0
        text = subprocess.run([sys.executable, "-m", "duet", "client", "--addr", address, "--prompt", "Hi there",
                               "--max-tokens", "3"], capture_output=True, text=True, timeout=60, check=True).stdout
        assert "tokens=" in text and "ttft=" in text
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
    assert not [k for k in kids if alive(k)], "orphan processes after SIGTERM"
    assert not list(tmp_path.glob("duet-*")), "temporary dirs left behind"


def test_up_restarts_a_killed_worker_and_keeps_serving(tiny_llama_dir, tmp_path):
    """issue 16: `duet up` supervises. The only prefill worker, then the only decode worker, is SIGKILLed and a
    request is sent at once: it waits for the worker that is started again on its port (a pause, not an
    error) and gets the undisturbed tokens; only SIGTERM stops the cluster."""
    up, address = start_up(tiny_llama_dir, tmp_path)
    kids = children_of(up.pid)
    ref = LLM(tiny_llama_dir, num_kv_blocks=128).generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].outputs[0]
    lines: list[str] = []
    try:
        for role in ("prefill", "decode"):
            worker = next(k for k in children_of(up.pid) if role in Path(f"/proc/{k}/cmdline").read_text())
            os.kill(worker, signal.SIGKILL)
            out = subprocess.run(
                [sys.executable, "-m", "duet", "client", "--addr", address, "--prompt-ids", "5,6,7,8", "--max-tokens",
                 "6", "--ignore-eos", "--json"], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stdout + out.stderr
            assert json.loads(out.stdout)["token_ids"] == ref.token_ids
            while not any(f"{role}-0 restarted" in line for line in lines):
                line = up.stdout.readline()
                assert line, f"duet up ended: {''.join(lines)}"
                lines.append(line)
            said = "".join(lines)
            assert f"duet: component {role}-0 was killed by SIGKILL" in said and f"restarting {role}-0 in 1 s" in said
            assert worker not in children_of(up.pid)
        assert up.poll() is None
        kids = children_of(up.pid)  # the restarted workers among them
        assert len(kids) == 4
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
    assert not [k for k in kids if alive(k)]
    assert not list(tmp_path.glob("duet-*"))


def wait_exit(pid: int, timeout_s: float) -> os.waitid_result | None:
    """How the child `pid` ended, once it has (left unreaped, for its owner to reap); None if it runs on."""
    deadline = time.monotonic() + timeout_s
    while (status := os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)) is None:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)
    return status


def test_router_with_http_exits_within_its_grace_on_sigterm_with_a_stream_in_flight_and_an_idle_keep_alive(
        tiny_llama_dir):
    """issue 16: a router with --http-port ignored SIGTERM (its main thread slept in a futex while the signal
    went to another thread) and, once stopping, waited on gRPC handler threads at exit. Now an idle keep-alive
    connection is closed at once, a stream in flight gets the grace and then its error event, and the router
    exits by itself (code 0) right after. The stream is held in flight by stopping its decode worker."""
    grace_s = 2.0
    (http_port,) = pick_free_ports(1)
    config = ClusterConfig(model_dir=str(tiny_llama_dir), worker_args=["--num-kv-blocks", "128"],
                           router_args=["--http-port", str(http_port), "--shutdown-grace", f"{grace_s:g}"])
    with LocalCluster(config) as cluster:
        pids = {c.name: c.pid for c in cluster.components}
        idle = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
        idle.request("GET", "/health")
        health = idle.getresponse()
        assert (health.status, health.read()) == (200, b'{"status":"ok"}')  # the connection stays open, idle
        stream = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
        stream.request("POST", "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 1000, "ignore_eos": True, "stream": True}),
            {"Content-Type": "application/json"})
        response = stream.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: {")
        os.kill(pids["decode-0"], signal.SIGSTOP)  # the stream now waits on its decode worker until it is cut
        try:
            sent_s = time.monotonic()
            os.kill(pids["router"], signal.SIGTERM)
            assert idle.sock.recv(1) == b""  # closed by the router...
            assert wait_exit(pids["router"], 0) is None  # ...while the stream still holds it in its grace
            lines = []
            while line := response.readline():
                lines.append(line)
            cut_s = time.monotonic() - sent_s
            status = wait_exit(pids["router"], grace_s + STOP_MARGIN_S + 10)
            exit_s = time.monotonic() - sent_s
        finally:
            os.kill(pids["decode-0"], signal.SIGCONT)
        events = [json.loads(line[len(b"data: "):]) for line in lines if line.startswith(b"data: {")]
        # gRPC's own words for the calls its stopping server cuts; UNAVAILABLE: the client may retry elsewhere
        assert events[-1] == {"error": {"message": "Cancelling all calls", "type": "service_unavailable",
                                        "param": None, "code": "UNAVAILABLE"}}, lines[-3:]
        assert all("choices" in e for e in events[:-1])  # the tokens sent before the decode worker stopped
        assert status is not None, f"the router still runs {exit_s:.1f} s after SIGTERM"
        assert (status.si_code, status.si_status) == (os.CLD_EXITED, 0)
        assert grace_s <= cut_s <= exit_s < grace_s + STOP_MARGIN_S + 10
        router_log = Path(next(c.log_path for c in cluster.components if c.name == "router")).read_text()
        assert "router stopping (SIGTERM): requests in flight get 2 s" in router_log
        assert router_log.rstrip().endswith("router stopped")
