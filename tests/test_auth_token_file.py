"""`duet router --auth-token-file`: the bearer token read from a file (a mounted Kubernetes Secret), so it never
shows in a pod spec or the process list. A real router process, real Redis, real gRPC and HTTP."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest

from cluster import grpc_plumbing
from deploy.redis_server import RedisServer
from duet.cli import main
from duet.v1 import generation_pb2 as pb
from duet.v1 import generation_pb2_grpc as pb_grpc
from engine.ports import pick_free_ports


def http_status(url: str, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code


def test_router_takes_its_token_from_the_file(tiny_llama_dir, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-from-a-secret\n")  # `kubectl create secret --from-file` keeps a newline
    grpc_port, http_port = pick_free_ports(2)
    with RedisServer() as redis_server:
        router = subprocess.Popen(
            [sys.executable, "-m", "duet", "router", "--redis-url", redis_server.url, "--model", str(tiny_llama_dir),
             "--port", str(grpc_port), "--http-port", str(http_port), "--auth-token-file", str(token_file)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not grpc_plumbing.health_check(f"127.0.0.1:{grpc_port}"):  # health needs no token (probes)
                assert router.poll() is None and time.monotonic() < deadline, "router did not start"
                time.sleep(0.2)
            models = f"http://127.0.0.1:{http_port}/v1/models"
            while http_status(models, "s3cret-from-a-secret") != 200:
                assert time.monotonic() < deadline, "HTTP did not start"
                time.sleep(0.2)
            assert http_status(models, None) == 401
            assert http_status(models, "wrong") == 401
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                with pytest.raises(grpc.RpcError) as e:
                    stub.Abort(pb.AbortRequest(request_id="x"), metadata=(("authorization", "Bearer wrong"),),
                               timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                stub.Abort(pb.AbortRequest(request_id="x"),
                           metadata=(("authorization", "Bearer s3cret-from-a-secret"),), timeout=10)
        finally:
            router.terminate()
            router.wait(20)


@pytest.mark.parametrize(("content", "extra", "message"), [
    ("", [], "is invalid: the file is empty"),
    ("t", ["--auth-token", "t"], "--auth-token and --auth-token-file both give the token: give one"),
    (None, [], "cannot be read: No such file or directory"),
])
def test_bad_token_files_are_refused(tmp_path, capsys, content, extra, message):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    assert main(["router", "--redis-url", "redis://127.0.0.1:1", "--auth-token-file", str(path), *extra]) == 2
    assert message in capsys.readouterr().err
