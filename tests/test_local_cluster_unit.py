"""deploy/local_cluster.py with stand-in components: a tiny gRPC health server takes the place of
`python -m duet prefill|decode|router`, so supervision (readiness, failure reports, stop order, no orphans) is
tested here without models; the end-to-end test with the real components lives elsewhere."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cluster import grpc_plumbing
from deploy.local_cluster import PORT_IN_USE_EXIT_CODE, ClusterConfig, LocalCluster, run_up
from deploy.startup_progress import StartupProgress

REPO_ROOT = Path(__file__).resolve().parents[1]

FAKE_COMPONENT = textwrap.dedent('''
    import argparse, os, signal, subprocess, sys, time
    from concurrent import futures
    import grpc, redis
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    p = argparse.ArgumentParser()
    p.add_argument("role")
    for flag in ("--host", "--redis-url", "--model", "--events", "--grandchild-pidfile", "--http-port",
                 "--metrics-port"):
        p.add_argument(flag)
    p.add_argument("--port", type=int)
    for flag in ("--fail", "--never-serving", "--ignore-sigterm"):
        p.add_argument(flag, action="store_true")
    args = p.parse_args()
    print("argv", sys.argv[1:], "unbuffered", os.environ.get("PYTHONUNBUFFERED"),
          "auth", os.environ.get("DUET_AUTH_TOKEN"))
    if args.fail:
        print("boom: cannot load the model")
        sys.exit(3)
    stopping = []
    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_sigterm else lambda *a: stopping.append(1))
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    # grpc's HealthServicer answers SERVING for "" until told otherwise
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING if args.never_serving
                 else health_pb2.HealthCheckResponse.SERVING)
    if args.grandchild_pidfile:
        child = subprocess.Popen(["sleep", "600"])
        with open(f"{args.grandchild_pidfile}.{os.getpid()}", "w") as f:
            f.write(str(child.pid))
    while not stopping:
        time.sleep(0.02)
    if args.events:
        redis_ok = redis.Redis.from_url(args.redis_url, socket_timeout=1).ping()
        with open(args.events, "a") as f:
            f.write(f"{args.role} {time.monotonic()} redis_ok={redis_ok}\\n")
    server.stop(0)
''')


class FakeCluster(LocalCluster):
    fake_path: Path

    def component_command(self, role, host, port, redis_url):
        cmd = super().component_command(role, host, port, redis_url)
        assert cmd[:3] == [sys.executable, "-m", "duet"]
        return [sys.executable, str(self.fake_path)] + cmd[3:]


@pytest.fixture(scope="module")
def fake_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("fake") / "fake_component.py"
    path.write_text(FAKE_COMPONENT)
    FakeCluster.fake_path = path
    return path


def _dead(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (a container's PID 1 may never reap adopted children)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_dead(pids, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(_dead(p) for p in pids):
        assert time.monotonic() < deadline, f"still alive: {[p for p in pids if not _dead(p)]}"
        time.sleep(0.02)


def test_component_command_lines():
    cluster = LocalCluster(ClusterConfig(model_dir="/models/tiny", worker_args=["--block-size", "8"],
                                         router_args=["--policy", "load"]))
    url = "redis://:pw@127.0.0.1:6400/0"
    assert cluster.component_command("prefill", "127.0.0.1", 5001, url) == [
        sys.executable, "-m", "duet", "prefill", "--host", "127.0.0.1", "--port", "5001", "--redis-url", url,
        "--model", "/models/tiny", "--block-size", "8"]
    assert cluster.component_command("router", "0.0.0.0", 5000, url) == [
        sys.executable, "-m", "duet", "router", "--host", "0.0.0.0", "--port", "5000", "--redis-url", url,
        "--model", "/models/tiny", "--policy", "load"]
    no_model = LocalCluster(ClusterConfig())
    assert "--model" not in no_model.component_command("decode", "127.0.0.1", 1, url)


def test_config_is_validated():
    with pytest.raises(ValueError, match="num_prefill=0, num_decode=0 are invalid"):
        ClusterConfig(num_prefill=0, num_decode=0)
    with pytest.raises(ValueError, match="port=70000 is invalid"):
        ClusterConfig(port=70000)
    with pytest.raises(ValueError, match=r"http_port=-1 is invalid: must be in \[0, 65535\]"):
        ClusterConfig(http_port=-1)
    with pytest.raises(ValueError, match="port=8000 and http_port=8000 are invalid: must differ"):
        ClusterConfig(port=8000, http_port=8000)
    with pytest.raises(ValueError, match="tls_cert=c.pem, tls_key=None are invalid: give both or neither"):
        ClusterConfig(tls_cert=Path("c.pem"))
    with pytest.raises(ValueError, match="tls_cert=/nonexistent/c.pem is invalid: no such file"):
        ClusterConfig(tls_cert=Path("/nonexistent/c.pem"), tls_key=Path("/nonexistent/k.pem"))


def test_start_serves_then_stops_in_order_without_orphans(fake_path, tmp_path):
    events = tmp_path / "events"
    config = ClusterConfig(num_prefill=1, num_decode=2, redis_password="pw", log_dir=str(tmp_path / "logs"),
                           worker_args=["--events", str(events), "--grandchild-pidfile", str(tmp_path / "gc")],
                           router_args=["--events", str(events)], ready_timeout_s=30)
    cluster = FakeCluster(config).start()
    components = cluster.components
    assert [c.name for c in components] == ["redis", "prefill-0", "decode-0", "decode-1", "router"]
    assert len({c.address for c in components}) == 5
    assert cluster.router_address == components[-1].address
    assert cluster.redis_url == f"redis://:pw@{components[0].address}/0"
    assert cluster.poll() is None
    prefill_log = Path(components[1].log_path).read_text()
    assert f"'prefill', '--host', '127.0.0.1', '--port', '{components[1].address.split(':')[1]}'" in prefill_log
    assert "unbuffered 1" in prefill_log
    tmp_dir = cluster._tmp_dir
    grandchildren = [int(p.read_text()) for p in tmp_path.glob("gc.*")]
    assert len(grandchildren) == 3

    cluster.stop()
    _wait_dead([c.pid for c in components] + grandchildren)
    order = [line.split() for line in events.read_text().splitlines()]
    assert order[0][0] == "router"
    assert sorted(o[0] for o in order[1:]) == ["decode", "decode", "prefill"]
    assert all(o[2] == "redis_ok=True" for o in order)  # redis outlived every component
    assert not tmp_dir.exists()
    assert Path(components[1].log_path).exists()  # an explicit log_dir is kept
    cluster.stop()  # idempotent


def test_component_never_serving_times_out(fake_path):
    config = ClusterConfig(num_prefill=0, num_decode=1, router_args=["--never-serving"], ready_timeout_s=1.0)
    cluster = FakeCluster(config)
    # under load decode-0 may be late too; the router, which never serves, must be named
    expected = r"(?s)^(decode-0, )?router did not report SERVING within 1.0 s.*router log tail"
    with pytest.raises(RuntimeError, match=expected):
        cluster.start()
    _wait_dead([c.pid for c in cluster.components])


def test_wait_restarts_a_dead_worker_on_its_port_and_stop_kills_one_ignoring_sigterm(fake_path):
    config = ClusterConfig(num_prefill=1, num_decode=1, worker_args=["--ignore-sigterm"], ready_timeout_s=30)
    with FakeCluster(config) as cluster:
        pids = [c.pid for c in cluster.components]
        decode = next(c for c in cluster.components if c.name == "decode-0")
        os.kill(decode.pid, signal.SIGKILL)
        printed = []
        waiting = threading.Thread(target=lambda: printed.append(cluster.wait(print_fn=printed.append)))
        waiting.start()
        deadline = time.monotonic() + 20
        while not any(str(line).startswith("duet: decode-0 restarted") for line in printed):
            assert time.monotonic() < deadline, printed
            time.sleep(0.05)
        again = next(c for c in cluster.components if c.name == "decode-0")
        assert again.pid != decode.pid and again.address == decode.address
        while not grpc_plumbing.health_check(again.address):  # serving again, on the same port
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert cluster.poll() is None
        cluster.request_stop()
        waiting.join(10)
        assert printed[-1] == 0
        t0 = time.monotonic()
        cluster.stop(timeout_s=0.5)  # prefill-0 ignores SIGTERM
        assert time.monotonic() - t0 < 5.0
    assert printed[0].startswith("duet: component decode-0 was killed by SIGKILL; decode-0 log tail:")
    assert printed[0].endswith("duet: restarting decode-0 in 1 s (restart 1 within 300 s)")
    _wait_dead(pids + [again.pid])


def test_run_up_prints_one_ready_line_and_stops_on_sigterm(fake_path, monkeypatch):
    monkeypatch.setattr("deploy.local_cluster.LocalCluster", FakeCluster)
    previous_handler = signal.getsignal(signal.SIGTERM)
    printed = []

    def print_fn(line):
        printed.append(line)
        if "ready" in line:
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()

    assert run_up(ClusterConfig(num_prefill=1, num_decode=1, ready_timeout_s=30), print_fn=print_fn) == 0
    ready = [line for line in printed if "ready" in line]
    assert len(ready) == 1, printed
    assert re.fullmatch(r"duet ready: router at 127\.0\.0\.1:\d+ \(1 prefill, 1 decode, redis at 127\.0\.0\.1:\d+\)",
                        ready[0])
    assert printed[-1] == "duet: stopping (SIGTERM)"
    assert signal.getsignal(signal.SIGTERM) is previous_handler


def test_run_up_names_a_failing_component_with_its_log_tail(fake_path, monkeypatch):
    started = []

    class RecordingCluster(FakeCluster):
        def start(self, print_fn=None):
            started.append(self)
            return super().start(print_fn)

    monkeypatch.setattr("deploy.local_cluster.LocalCluster", RecordingCluster)
    printed = []
    config = ClusterConfig(num_prefill=1, num_decode=0, worker_args=["--fail"], ready_timeout_s=30)
    assert run_up(config, print_fn=printed.append) == 1
    assert printed[:2] == ["duet: loading the default model in prefill-0 ...", "duet: starting the router ..."]
    assert len(printed) == 3 or (len(printed) == 4 and re.fullmatch(r"duet: router serving \(\d+\.\d s\)", printed[2]))
    assert re.match(r"(?s)duet up failed: prefill-0 exited with code 3 before reporting SERVING; prefill-0 log tail:"
                    r".*boom: cannot load the model", printed[-1])
    _wait_dead([c.pid for c in started[0].components])


def test_run_up_says_what_loads_then_prints_every_address(fake_path, monkeypatch, tmp_path):
    """The router's HTTP and metrics ports (0: picked here) reach its command line, its bearer token its
    environment only; one line as each component starts and one as it serves, then the ready line."""
    monkeypatch.setattr("deploy.local_cluster.LocalCluster", FakeCluster)
    monkeypatch.setenv("DUET_AUTH_TOKEN", "from-the-launcher-env")  # the config, not the environment, decides
    printed = []

    def print_fn(line):
        printed.append(line)
        if line.startswith("duet ready"):
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()

    config = ClusterConfig(model_dir="/models/tiny", http_port=0, metrics_port=0, auth_token="s3cret",
                           log_dir=str(tmp_path), ready_timeout_s=30)
    assert run_up(config, print_fn=print_fn) == 0
    assert printed[:3] == ["duet: loading tiny in prefill-0 ...", "duet: loading tiny in decode-0 ...",
                           "duet: starting the router ..."]
    serving = [re.fullmatch(r"duet: (\S+) serving \(\d+\.\d s\)", line) for line in printed[3:6]]
    assert sorted(m.group(1) for m in serving) == ["decode-0", "prefill-0", "router"]
    ready = re.fullmatch(r"duet ready: router at 127\.0\.0\.1:\d+, OpenAI API at http://127\.0\.0\.1:(\d+)/v1, "
                         r"metrics at http://127\.0\.0\.1:(\d+)/metrics \(1 prefill, 1 decode, redis at "
                         r"127\.0\.0\.1:\d+\)", printed[6])
    assert ready, printed
    assert printed[7:] == ["duet: stopping (SIGTERM)"]
    router_log = (tmp_path / "router.log").read_text()
    assert f"'--http-port', '{ready.group(1)}', '--metrics-port', '{ready.group(2)}'" in router_log
    assert "auth s3cret" in router_log and "s3cret'" not in router_log  # in its environment, not its argv
    assert "auth None" in (tmp_path / "prefill-0.log").read_text()


def test_startup_progress_reminds_once_per_interval_while_components_are_pending():
    now = [100.0]
    said = []
    progress = StartupProgress(said.append, "tiny", clock=lambda: now[0])
    progress.started("prefill-0")
    progress.started("router")
    for now[0] in (100.0, 129.9, 130.0, 131.0, 160.4):
        progress.waiting(["prefill-0", "router"])
    now[0] = 161.3
    progress.serving("router")
    progress.waiting(["prefill-0"])
    assert said == ["duet: loading tiny in prefill-0 ...", "duet: starting the router ...",
                    "duet: still waiting for prefill-0, router (30 s)",
                    "duet: still waiting for prefill-0, router (60 s)",
                    "duet: router serving (61.3 s)"]
    StartupProgress(None, "tiny").started("router")  # silent


@pytest.mark.parametrize("field, flag", [("port", "--port"), ("http_port", "--http-port"),
                                         ("metrics_port", "--metrics-port")])
def test_run_up_refuses_a_port_in_use_before_starting_anything(monkeypatch, field, flag):
    started = []

    class RecordingCluster(LocalCluster):
        def _launch(self, *args):
            started.append(args)
            return super()._launch(*args)

    monkeypatch.setattr("deploy.local_cluster.LocalCluster", RecordingCluster)
    monkeypatch.setattr("deploy.local_cluster.RedisServer", lambda **kw: started.append("redis"))
    printed = []
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        assert run_up(ClusterConfig(**{field: port}), print_fn=printed.append) == PORT_IN_USE_EXIT_CODE == 2
    assert printed == [f"duet up failed: port {port} on 127.0.0.1 ({flag}) is in use: stop what listens there or "
                       f"choose another port ({flag} 0 picks a free one)"]
    assert started == []


LAUNCHER = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, {tests!r})
    from test_local_cluster_unit import ClusterConfig, FakeCluster
    from pathlib import Path
    FakeCluster.fake_path = Path({fake!r})
    cluster = FakeCluster(ClusterConfig(num_prefill=1, num_decode=1, ready_timeout_s=30)).start()
    print(json.dumps([c.pid for c in cluster.components]), flush=True)
    input()
''')


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_components_die_with_a_sigkilled_launcher(fake_path, tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER.format(tests=str(REPO_ROOT / "tests"), fake=str(fake_path)))
    # TMPDIR: the killed launcher cannot remove its temp dirs; let pytest's tmp_path hold them
    launcher = subprocess.Popen([sys.executable, str(script)], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=dict(os.environ, TMPDIR=str(tmp_path)))
    try:
        pids = json.loads(launcher.stdout.readline())
        assert len(pids) == 4
        launcher.kill()
        launcher.wait()
        _wait_dead(pids)
    finally:
        launcher.kill()
        launcher.wait()
