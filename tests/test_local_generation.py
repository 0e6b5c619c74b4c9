"""The HTTP API's in-process Generate calls (router/local_generation.py) keep gRPC's contract: the body's timeout
ends a call with DEADLINE_EXCEEDED (HTTP 504), calls past the router's concurrency limit are RESOURCE_EXHAUSTED
(HTTP 429), a decode worker killed mid-stream costs the stream a pause (migration), and nothing leaks on the
workers. Real clusters (redis, prefill and decode workers); for the first two tests the router runs in this process
so its limit can be set, and requests are held by stopping the decode worker."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import httpx
import pytest
from cluster_helpers import wait_idle

from deploy.local_cluster import ClusterConfig, LocalCluster
from duet.v1 import generation_pb2 as pb
from engine import LLM, SamplingParams
from router.local_generation import LocalGeneration
from router.server import RouterConfig, RouterServer

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    config = ClusterConfig(model_dir=str(tiny_llama_dir), worker_args=["--num-kv-blocks", "64"])
    with LocalCluster(config).start() as c:
        yield c


@pytest.fixture
def router(cluster, tiny_llama_dir):
    server = RouterServer(RouterConfig(redis_url=cluster.redis_url, model_dir=tiny_llama_dir, port=0, http_port=0,
                                       max_concurrent_streams=1, shutdown_grace_s=1.0))
    server.start()
    server.base = f"http://127.0.0.1:{server.http.port}"
    try:
        yield server
    finally:
        server.stop()
        wait_idle(cluster)


def decode_pid(cluster) -> int:
    return next(c.pid for c in cluster.components if c.name == "decode-0")


def test_the_body_timeout_ends_the_call_with_504_and_nothing_leaks(cluster, router):
    os.kill(decode_pid(cluster), signal.SIGSTOP)  # Reserve waits on it: no first message
    try:
        start_s = time.monotonic()
        response = httpx.post(router.base + "/v1/completions", timeout=30, json={
            "prompt": PROMPT, "max_tokens": 4, "stream": True, "timeout": 1.0})
        elapsed_s = time.monotonic() - start_s
    finally:
        os.kill(decode_pid(cluster), signal.SIGCONT)
    assert response.status_code == 504
    assert response.json()["error"] == {"message": "Deadline Exceeded", "type": "timeout", "param": None,
                                        "code": 504}
    assert 1.0 <= elapsed_s < 10.0


def test_calls_past_the_concurrency_limit_are_429_and_the_held_one_finishes(cluster, router, tiny_llama_dir):
    want = LLM(tiny_llama_dir).generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                                        use_tqdm=False)[0].outputs[0].text
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    held: dict[str, httpx.Response] = {}
    os.kill(decode_pid(cluster), signal.SIGSTOP)
    try:
        first = threading.Thread(target=lambda: held.update(r=httpx.post(router.base + "/v1/completions", json=body,
                                                                         timeout=60)))
        first.start()
        deadline = time.monotonic() + 10
        while not router.local._calls:  # the first call holds the one place
            assert time.monotonic() < deadline, "the first call never started"
            time.sleep(0.01)
        refused = httpx.post(router.base + "/v1/completions", json=body, timeout=30)
    finally:
        os.kill(decode_pid(cluster), signal.SIGCONT)
    first.join(60)
    assert refused.status_code == 429
    assert refused.json()["error"]["message"] == "the router serves at most 1 requests at once"
    assert held["r"].status_code == 200 and held["r"].json()["choices"][0]["text"] == want
    again = httpx.post(router.base + "/v1/completions", json=body, timeout=60)  # the place is free again
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == want


def test_an_http_stream_survives_its_decode_worker_killed_mid_stream(tiny_llama_dir):
    """The in-process HTTP path keeps the router's migration: SIGKILL the decode worker serving an SSE stream after
    its first tokens, and the stream goes on, from the other decode worker, with exactly the offline text."""
    import json

    from cluster_helpers import worker_components, worker_stats
    from test_migration import migrated_from

    max_tokens = 600  # long enough to be still decoding when the kill lands
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    want = LLM(tiny_llama_dir, max_model_len=1024).generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    config = ClusterConfig(model_dir=str(tiny_llama_dir), num_decode=2, http_port=0,
                           worker_args=["--num-kv-blocks", "128", "--max-model-len", "1024"],
                           router_args=["--max-model-len", "1024"])
    with LocalCluster(config).start() as cluster:
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        texts, victim = [], None
        with httpx.stream("POST", cluster.http_url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                texts.append(json.loads(line[len("data: "):])["choices"][0]["text"])
                if len(texts) == 4:  # mid-stream: kill the decode worker that runs it
                    decodes = [c for c in worker_components(cluster) if c.name.startswith("decode")]
                    victim, victim_id = next((c, s.worker_id) for c in decodes
                                             if (s := worker_stats(c.address, "decode", check=False)).num_running)
                    os.kill(victim.pid, signal.SIGKILL)
        assert victim is not None and "".join(texts) == want
        assert migrated_from(cluster, victim_id) == 1
        wait_idle(cluster, skip=(victim.name,))


class _StuckRouter:
    """A router (the two calls LocalCall makes) whose stream sends one message and then hangs with no deadline of its
    own: only the call's deadline can end it. Pure logic: the real-cluster case is the 504 test above."""

    def __init__(self):
        self.release, self.cancelled = threading.Event(), threading.Event()

    def admit(self, request, timeout_s):
        return request, self

    def stream(self, routed, live):
        yield pb.GenerateResponse(request_id="r", token_ids=[7])
        self.release.wait(30)

    def cancel(self, abort: bool) -> None:  # the Live of the call
        self.cancelled.set()


def test_the_calls_own_deadline_ends_a_stuck_stream_after_what_arrived_before_it():
    router = _StuckRouter()
    generation = LocalGeneration(router, max_concurrent=2)

    async def read(timeout_s: float):
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for message in generation.call(pb.GenerateRequest(), timeout_s):
                got.append(list(message.token_ids))
        return got, e.value.code(), e.value.details()

    try:
        start_s = time.monotonic()
        got, code, details = asyncio.run(read(0.5))
        assert (got, code, details) == ([[7]], grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        assert 0.5 <= time.monotonic() - start_s < 5.0
        assert router.cancelled.wait(5)  # the request is cancelled downstream
    finally:
        router.release.set()
        generation.close()
