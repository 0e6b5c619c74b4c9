"""Every component's /metrics exposes the documented names, types and labels (real processes, real redis)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster import grpc_plumbing
from deploy.redis_server import RedisServer
from duet.client import Client, stream_to_record
from engine import SamplingParams
from engine.ports import pick_free_port
from router.server import RouterConfig, RouterServer

WORKER_METRICS = {
    "duet_num_requests_waiting": "gauge", "duet_num_requests_running": "gauge", "duet_num_waiting_tokens": "gauge",
    "duet_kv_cache_usage_perc": "gauge", "duet_prefix_cache_queries": "counter", "duet_prefix_cache_hits": "counter",
    "duet_kv_events_dropped": "counter", "duet_prefix_index_resyncs": "counter",
    "duet_inter_token_latency_seconds": "histogram", "duet_kv_transfer_seconds": "histogram",
    "duet_kv_transfer_bytes": "counter",
}
ROUTER_METRICS = {
    "duet_router_requests": "counter", "duet_router_routing_decisions": "counter",
    "duet_router_prefix_lookup_seconds": "histogram", "duet_router_routing_decision_seconds": "histogram",
    "duet_router_predicted_cached_tokens": "counter", "duet_router_actual_cached_tokens": "counter",
    "duet_router_prompt_tokens": "counter", "duet_router_index_available": "gauge",
    "duet_router_index_block_keys": "gauge", "duet_router_time_to_first_token_seconds": "histogram",
    "duet_router_e2e_request_latency_seconds": "histogram", "duet_router_migrations": "counter",
    "duet_router_worker_restarts": "counter",
}


METRICS_HOST = {"prefill": "127.0.0.2", "decode": "127.0.0.1"}  # prefill's /metrics bound apart (--metrics-host)


def scrape(port: int, host: str = "127.0.0.1") -> dict:
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def workers(tiny_llama_dir):
    with RedisServer() as redis_server:
        procs, ports = {}, {}
        for role in ("prefill", "decode"):
            grpc_port, metrics_port = pick_free_port(), pick_free_port()
            procs[role] = subprocess.Popen(
                [sys.executable, "-m", "duet", role, "--port", str(grpc_port), "--redis-url", redis_server.url,
                 "--model", str(tiny_llama_dir), "--num-kv-blocks", "64", "--metrics-port", str(metrics_port),
                 "--metrics-host", METRICS_HOST[role]],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            ports[role] = (grpc_port, metrics_port)
        try:
            deadline = time.monotonic() + 120
            for role, (grpc_port, _) in ports.items():
                while not grpc_plumbing.health_check(f"127.0.0.1:{grpc_port}"):
                    assert procs[role].poll() is None and time.monotonic() < deadline, f"{role} did not start"
                    time.sleep(0.2)
            yield redis_server, ports
        finally:
            for proc in procs.values():
                proc.terminate()
                proc.wait(10)


def test_worker_and_router_metrics(workers, tiny_llama_dir):
    redis_server, ports = workers
    router = RouterServer(RouterConfig(redis_url=redis_server.url, model_dir=tiny_llama_dir, port=0, metrics_port=0,
                                       max_model_len=1024))
    router.start()
    try:
        with Client(router.address) as client:
            record = stream_to_record(client.generate(list(range(2, 60)), SamplingParams(max_tokens=5, temperature=0,
                                                                                           ignore_eos=True)))
        assert len(record["token_ids"]) == 5
        for role, (_, metrics_port) in ports.items():
            families = scrape(metrics_port, METRICS_HOST[role])
            for name, kind in WORKER_METRICS.items():
                assert name in families and families[name].type == kind, (role, name)
                assert all(s.labels.get("role") == role for s in families[name].samples), (role, name)
        decode = scrape(ports["decode"][1])
        count = next(s.value for s in decode["duet_inter_token_latency_seconds"].samples if s.name.endswith("_count"))
        assert count == 4  # tokens 2..5 each came some time after the previous one
        prefill = scrape(ports["prefill"][1], "127.0.0.2")
        with pytest.raises(urllib.error.URLError):  # bound to 127.0.0.2 only, apart from its gRPC port's host
            scrape(ports["prefill"][1], "127.0.0.1")
        sent = next(s.value for s in prefill["duet_kv_transfer_bytes"].samples if s.name.endswith("_total"))
        assert sent > 0
        families = scrape(router.metrics_port)
        for name, kind in ROUTER_METRICS.items():
            assert name in families and families[name].type == kind, name
    finally:
        router.stop()
