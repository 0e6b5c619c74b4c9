"""`duet up` and `duet client` as a user runs them: real processes, stdout parsed, signals sent."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
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


@dataclass
class Up:
    popen: subprocess.Popen
    address: str  # the router's gRPC host:port
    api_base: str | None  # the OpenAI API's base URL (http://host:port/v1), None when off
    metrics_url: str | None
    said: list[str]  # the lines before and including the ready line


READY_LINE = re.compile(r"duet ready: router at ([^\s,]+)(?:, OpenAI API at ([^\s,]+))?(?:, metrics at ([^\s,]+))? "
                        r"\(1 prefill, 1 decode, redis at 127\.0\.0\.1:\d+\)\n")


def start_up(model_dir: Path, tmp: Path, *extra: str) -> Up:
    """`duet up` on a free gRPC port and (unless `extra` says otherwise) a free HTTP port, until it is ready."""
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    http = [] if {"--http-port", "--no-http"} & set(extra) else ["--http-port", "0"]
    up = subprocess.Popen(
        [sys.executable, "-m", "duet", "up", "--model", str(model_dir), "--port", "0", "--num-kv-blocks", "128",
         *http, *extra],
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
            ready = READY_LINE.fullmatch(line)
            assert ready, line
            return Up(up, *ready.groups(), lines)
    up.kill()
    pytest.fail(f"duet up never printed a ready line:\n{''.join(lines)}")


def make_cert(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return cert, key


def test_up_with_every_router_option_then_clients_then_sigterm_leaves_nothing_behind(tiny_llama_dir, tmp_path):
    """`duet up` hands the router its options: the OpenAI API (on by default; the official client), a bearer
    token (gRPC and HTTP refuse calls without it; never on a command line), TLS on gRPC (the HTTP API still
    reaches it) and /metrics, and with --internal-tls runs router -> worker gRPC and the KV transfer over mutual TLS
    (its material in each component's environment); it says what loads before the ready line; SIGTERM stops
    everything."""
    token = "tok-" + os.urandom(8).hex()
    cert, key = make_cert(tmp_path)
    up = start_up(tiny_llama_dir, tmp_path, "--auth-token", token, "--tls-cert", str(cert), "--tls-key", str(key),
                  "--metrics-port", "0", "--internal-tls",
                  "--local-prefill-tokens", "0")  # every prompt through the prefill worker: KV under mutual TLS
    client = [sys.executable, "-m", "duet", "client", "--addr", up.address, "--tls-ca", str(cert)]
    try:
        kids = children_of(up.popen.pid)
        assert len(kids) == 4  # redis, router, prefill, decode
        assert not [k for k in kids if token in Path(f"/proc/{k}/cmdline").read_text()]
        duet_kids = [k for k in kids if "redis-server" not in Path(f"/proc/{k}/cmdline").read_text()]
        assert len(duet_kids) == 3 and all(b"DUET_INTERNAL_TLS_KEY=-----BEGIN PRIVATE KEY" in
                                           Path(f"/proc/{k}/environ").read_bytes() for k in duet_kids)
        assert up.said[:3] == [f"duet: loading {tiny_llama_dir.name} in prefill-0 ...\n",
                               f"duet: loading {tiny_llama_dir.name} in decode-0 ...\n",
                               "duet: starting the router ...\n"]
        serving = [re.fullmatch(r"duet: (\S+) serving \(\d+\.\d s\)\n", line) for line in up.said[3:6]]
        assert sorted(m.group(1) for m in serving) == ["decode-0", "prefill-0", "router"] and len(up.said) == 7

        out = subprocess.run([*client, "--auth-token", token, "--prompt-ids", "5,6,7,8", "--max-tokens", "6",
                              "--ignore-eos", "--json"], capture_output=True, text=True, timeout=60, check=True)
        record = json.loads(out.stdout)
        ref = LLM(tiny_llama_dir, num_kv_blocks=128).generate(
            [[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].outputs[0]
        assert record["token_ids"] == ref.token_ids and record["text"] == ref.text
        assert record["finish_reason"] == "length" and record["cached_tokens"] == 0
        text = subprocess.run([*client, "--auth-token", token, "--prompt", "Hi there", "--max-tokens", "3"],
                              capture_output=True, text=True, timeout=60, check=True).stdout
        assert "tokens=" in text and "ttft=" in text
        refused = subprocess.run([*client, "--prompt", "Hi"], capture_output=True, text=True, timeout=60)
        assert (refused.returncode, refused.stdout) == (1, "")
        assert refused.stderr == "error: UNAUTHENTICATED: missing or wrong bearer token in 'authorization'\n"

        assert up.api_base.startswith("http://127.0.0.1:") and up.api_base.endswith("/v1")
        api = openai.OpenAI(base_url=up.api_base, api_key=token, max_retries=0, timeout=60)
        models = api.models.list()
        assert [m.id for m in models.data] == [tiny_llama_dir.name]
        completion = api.completions.create(model=models.data[0].id, prompt=[5, 6, 7, 8], max_tokens=6,
                                            temperature=0, extra_body={"ignore_eos": True})
        assert completion.choices[0].text == ref.text and completion.choices[0].finish_reason == "length"
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (4, 6)
        with pytest.raises(openai.AuthenticationError) as denied:
            openai.OpenAI(base_url=up.api_base, api_key="wrong", max_retries=0).models.list()
        assert denied.value.status_code == 401
        with urllib.request.urlopen(up.metrics_url, timeout=30) as metrics:
            assert metrics.status == 200 and b"# TYPE " in metrics.read()
    finally:
        up = up.popen
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
    assert not [k for k in kids if alive(k)], "orphan processes after SIGTERM"
    assert not list(tmp_path.glob("duet-*")), "temporary dirs left behind"


def test_up_restarts_a_killed_worker_and_keeps_serving(tiny_llama_dir, tmp_path):
    """issue 16: `duet up` supervises. The only prefill worker, then the only decode worker, is SIGKILLed and a
    request is sent at once: it waits for the worker that is started again on its port (a pause, not an
    error) and gets the undisturbed tokens; only SIGTERM stops the cluster."""
    started = start_up(tiny_llama_dir, tmp_path, "--no-http", "--local-prefill-tokens", "0")  # each needs both
    assert started.api_base is None and started.metrics_url is None
    up, address = started.popen, started.address
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
            {"prompt": [5, 6, 7, 8], "max_tokens": 1000, "ignore_eos": True, "stream": True}),
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
        # UNAVAILABLE, as the stopping gRPC server cuts its own calls: the client may retry elsewhere
        assert events[-1] == {"error": {"message": "the router is stopping", "type": "service_unavailable",
                                        "param": None, "code": "UNAVAILABLE"}}, lines[-3:]
        assert all("choices" in e for e in events[:-1])  # the tokens sent before the decode worker stopped
        assert status is not None, f"the router still runs {exit_s:.1f} s after SIGTERM"
        assert (status.si_code, status.si_status) == (os.CLD_EXITED, 0)
        assert grace_s <= cut_s <= exit_s < grace_s + STOP_MARGIN_S + 10
        router_log = Path(next(c.log_path for c in cluster.components if c.name == "router")).read_text()
        assert "router stopping (SIGTERM): requests in flight get 2 s" in router_log
        assert router_log.rstrip().endswith("router stopped")


def test_up_exits_at_once_when_a_port_it_is_asked_for_is_in_use(tiny_llama_dir, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "duet", "up", "--model", str(tiny_llama_dir), "--port", "0",
                            "--http-port", str(port)], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert (r.returncode, r.stderr) == (2, "")
    assert r.stdout == (f"duet up failed: port {port} on 127.0.0.1 (--http-port) is in use: stop what listens there "
                        "or choose another port (--http-port 0 picks a free one)\n")
    assert not list(tmp_path.iterdir())  # nothing was started: no cluster dir, no redis dir
