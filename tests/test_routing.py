"""Prefix-aware routing end to end: 2 prefill workers and 1 decode worker as processes over one real
redis-server; routers in this process so a second replica and a Redis restart can be staged."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from cluster_helpers import wait_idle
from prometheus_client.parser import text_string_to_metric_families

from deploy.local_cluster import ClusterConfig, LocalCluster
from deploy.redis_server import RedisServer
from duet.client import Client, stream_to_record
from engine import SamplingParams
from router.server import RouterConfig, RouterServer

WORKER_ARGS = ["--num-kv-blocks", "200", "--max-num-batched-tokens", "64", "--max-model-len", "2048"]
PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    config = ClusterConfig(model_dir=str(tiny_llama_dir), num_prefill=2, num_decode=1, worker_args=WORKER_ARGS,
                           router_args=["--max-model-len", "2048"])
    with LocalCluster(config).start() as c:
        yield c


def start_router(cluster, tiny_llama_dir, **kw) -> RouterServer:
    server = RouterServer(RouterConfig(redis_url=cluster.redis_url, model_dir=tiny_llama_dir, port=0,
                                       max_model_len=2048, **kw))
    server.start()
    return server


@pytest.fixture(scope="module")
def router(cluster, tiny_llama_dir):
    server = start_router(cluster, tiny_llama_dir, metrics_port=0)
    yield server
    server.stop()


def prefix(seed: int, n: int = 256) -> list[int]:
    return [(seed * 131 + 7 * i) % 500 + 2 for i in range(n)]


def wait_for(fn, timeout_s: float = 30.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = fn()
            if value:
                return value
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_shared_prefix_goes_to_the_worker_that_holds_it(cluster, router):
    with Client(router.address) as client:
        for seed in range(4):
            first = stream_to_record(client.generate(prefix(seed) + [3, 4, 5], PARAMS, timeout_s=60))
            assert first["cached_tokens"] == 0
            # the worker's KV events reach the index; the explanation shows the cached blocks per worker
            explained = wait_for(lambda s=seed: [e for e in client.explain_route(prefix(s) + [9, 9]).prefill
                                                 if e.cached_tokens == 256], what="the index to learn the prefix")
            assert explained[0].worker_id == first["prefill_worker"]
            ex = client.explain_route(prefix(seed) + [9, 9])
            assert ex.prefill_worker == first["prefill_worker"] and ex.branch == "prefix" and ex.index_available
            assert ex.prompt_blocks == 16 and ex.block_size == 16
            others = [e for e in ex.prefill if e.worker_id != first["prefill_worker"]]
            assert [e.cached_tokens for e in others] == [0]
            second = stream_to_record(client.generate(prefix(seed) + [9, 9], PARAMS, timeout_s=60))
            assert second["prefill_worker"] == first["prefill_worker"]
            assert second["cached_tokens"] == 256  # predicted by the index, reported by the worker
    body = urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=5).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(body) for s in f.samples}
    model = ("model_name", router.router.model_id)
    assert samples[("duet_router_routing_decisions_total", (("branch", "prefix"), model))] >= 1
    assert "duet_router_prefix_lookup_seconds_bucket" in body
    assert samples[("duet_router_actual_cached_tokens_total", (model,))] == 1024
    wait_idle(cluster)


def test_a_routed_prefix_is_speculatively_held_at_once(router):
    with Client(router.address) as client:
        stream = client.generate(prefix(40) + [1], SamplingParams(max_tokens=1700, temperature=0, ignore_eos=True),
                                 timeout_s=60)
        first = next(stream)
        ex = client.explain_route(prefix(40) + [2])  # before or after the worker's event: it counts either way
        held = {e.worker_id: e.cached_tokens for e in ex.prefill}
        assert held[first.prefill_worker] == 256 and ex.prefill_worker == first.prefill_worker
        stream.cancel()


def test_two_router_replicas_make_the_same_choice(cluster, router, tiny_llama_dir):
    replica = start_router(cluster, tiny_llama_dir)
    try:
        with Client(router.address) as a, Client(replica.address) as b:
            for seed in range(10, 22):
                prompt = prefix(seed % 4, 256 if seed % 2 else 100) + [seed]
                ea, eb = a.explain_route(prompt), b.explain_route(prompt)
                assert ea.prefill_worker == eb.prefill_worker, seed
                assert [(e.worker_id, e.cached_tokens) for e in ea.prefill] == [
                    (e.worker_id, e.cached_tokens) for e in eb.prefill]
    finally:
        replica.stop()


def test_redis_restart_falls_back_to_load_only_and_recovers(cluster, router):
    redis_server: RedisServer = cluster._redis  # the cluster's private redis-server
    port = redis_server.port
    with Client(router.address) as client:
        stream_to_record(client.generate(prefix(50) + [1], PARAMS, timeout_s=60))
        redis_server.stop()
        try:
            time.sleep(0.6)  # past the router's registry cache
            during = stream_to_record(client.generate(prefix(50) + [2], PARAMS, timeout_s=60))
            assert during["finish_reason"] == "length" and len(during["token_ids"]) == 3
            ex = client.explain_route(prefix(50) + [3])
            assert not ex.index_available and ex.branch == "load_only"
        finally:
            # a fresh, empty Redis on the same port, with the same password
            cluster._redis = RedisServer(port=port, password=redis_server.password).start()
        # workers re-register on their next heartbeat; their next KV event resyncs the index
        wait_for(lambda: client.explain_route(prefix(51)).index_available, what="the index to be back")
        first = stream_to_record(client.generate(prefix(52) + [1], PARAMS, timeout_s=60))
        wait_for(lambda: any(e.cached_tokens == 256 for e in client.explain_route(prefix(52) + [2]).prefill),
                 what="prefix-aware routing to return")
        again = stream_to_record(client.generate(prefix(52) + [2], PARAMS, timeout_s=60))
        assert again["prefill_worker"] == first["prefill_worker"] and again["cached_tokens"] == 256


def test_route_explain_command(router):
    import json
    import subprocess
    import sys

    ids = ",".join(map(str, prefix(0) + [9, 9]))
    out = subprocess.run([sys.executable, "-m", "duet", "route-explain", "--addr", router.address, "--prompt-ids", ids,
                          "--json"], capture_output=True, text=True, timeout=60, check=True)
    ex = json.loads(out.stdout)
    assert int(ex["prompt_tokens"]) == 258 and int(ex["prompt_blocks"]) == 16 and len(ex["prefill"]) == 2
    assert ex["prefill_worker"] in {w["worker_id"] for w in ex["prefill"]}
    text = subprocess.run([sys.executable, "-m", "duet", "route-explain", "--addr", router.address, "--prompt-ids",
                           ids], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "<- chosen" in text and "est. TTFT" in text
