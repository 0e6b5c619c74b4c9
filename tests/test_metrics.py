"""Every component's /metrics: the documented names, types and labels (vLLM's names under `duet_`, a
`model_name` label everywhere), and exact values after known requests (real processes, real redis). The Grafana
dashboard queries only metrics and labels a real scrape has."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster import grpc_plumbing
from deploy.redis_server import RedisServer
from duet.client import Client, stream_to_record
from engine import SamplingParams
from engine.ports import pick_free_port
from router.server import RouterConfig, RouterServer

ROOT = Path(__file__).resolve().parents[1]
WORKER_METRICS = {
    "duet_num_requests_waiting": "gauge", "duet_num_requests_running": "gauge", "duet_num_waiting_tokens": "gauge",
    "duet_kv_cache_usage_perc": "gauge", "duet_prefix_cache_queries": "counter", "duet_prefix_cache_hits": "counter",
    "duet_prompt_tokens": "counter", "duet_generation_tokens": "counter", "duet_num_preemptions": "counter",
    "duet_kv_events_dropped": "counter", "duet_prefix_index_resyncs": "counter",
    "duet_inter_token_latency_seconds": "histogram", "duet_kv_transfer_seconds": "histogram",
    "duet_kv_transfer_bytes": "counter", "duet_request_queue_time_seconds": "histogram",
    "duet_request_prefill_time_seconds": "histogram", "duet_request_decode_time_seconds": "histogram",
    "duet_iteration_tokens_total": "histogram", "duet_cache_config_info": "gauge",
}
ROUTER_METRICS = {
    "duet_router_requests": "counter", "duet_router_request_success": "counter",
    "duet_router_routing_decisions": "counter",
    "duet_router_prefix_lookup_seconds": "histogram", "duet_router_routing_decision_seconds": "histogram",
    "duet_router_predicted_cached_tokens": "counter", "duet_router_actual_cached_tokens": "counter",
    "duet_router_prompt_tokens": "counter", "duet_router_generation_tokens": "counter",
    "duet_router_index_available": "gauge", "duet_router_index_block_keys": "gauge",
    "duet_router_time_to_first_token_seconds": "histogram", "duet_router_e2e_request_latency_seconds": "histogram",
    "duet_router_migrations": "counter", "duet_router_worker_restarts": "counter",
    "duet_router_speculative_dropped": "counter", "duet_router_decode_cached_tokens": "counter",
    "duet_router_kv_transferred_tokens": "counter", "duet_router_local_prefills": "counter",
    "duet_router_predicted_ttft_seconds": "histogram", "duet_router_ttft_prediction_ratio": "histogram",
    "duet_router_prefill_queue_seconds": "gauge", "duet_router_slo_ttft_seconds": "gauge",
    "duet_router_slo_rejected_requests": "counter", "duet_router_good_requests": "counter",
}
METRICS_HOST = {"prefill": "127.0.0.2", "decode": "127.0.0.1"}  # prefill's /metrics bound apart (--metrics-host)
NUM_KV_BLOCKS = 64


def scrape(port: int, host: str = "127.0.0.1") -> dict:
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, sample_name: str, **labels: str) -> float:
    """The one sample named `sample_name` whose labels include `labels`."""
    family = families[re.sub(r"(_total|_count|_sum|_bucket|_created)$", "", sample_name)]
    found = [s.value for s in family.samples
             if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (sample_name, labels, family.samples)
    return found[0]


def deltas(before: dict, after: dict, names: list[str]) -> dict[str, float]:
    return {name: value(after, name) - value(before, name) for name in names}


@pytest.fixture(scope="module")
def workers(tiny_llama_dir):
    with RedisServer() as redis_server:
        procs, ports = {}, {}
        for role in ("prefill", "decode"):
            grpc_port, metrics_port = pick_free_port(), pick_free_port()
            procs[role] = subprocess.Popen(
                [sys.executable, "-m", "duet", role, "--port", str(grpc_port), "--redis-url", redis_server.url,
                 "--model", str(tiny_llama_dir), "--num-kv-blocks", str(NUM_KV_BLOCKS), "--metrics-port",
                 str(metrics_port), "--metrics-host", METRICS_HOST[role]],
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


@pytest.fixture
def router(workers, tiny_llama_dir):
    """A router of its own (its counters start at zero), with /metrics."""
    redis_server, _ = workers
    server = RouterServer(RouterConfig(redis_url=redis_server.url, model_dir=tiny_llama_dir, port=0, metrics_port=0,
                                       max_model_len=1024))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def scrape_workers(ports: dict) -> dict[str, dict]:
    return {role: scrape(metrics_port, METRICS_HOST[role]) for role, (_, metrics_port) in ports.items()}


def test_worker_and_router_metrics_have_names_types_and_labels(workers, router, tiny_llama_dir):
    _, ports = workers
    with Client(router.address) as client:
        record = stream_to_record(client.generate(list(range(2, 60)), SamplingParams(max_tokens=5, temperature=0,
                                                                                       ignore_eos=True)))
    assert len(record["token_ids"]) == 5
    model_name = tiny_llama_dir.name
    for role, families in scrape_workers(ports).items():
        for name, kind in WORKER_METRICS.items():
            assert name in families and families[name].type == kind, (role, name)
            samples = families[name].samples
            assert samples and all(s.labels.get("role") == role and s.labels.get("model_name") == model_name
                                   for s in samples), (role, name, samples)
        info = families["duet_cache_config_info"].samples
        assert [(s.labels, s.value) for s in info] == [({
            "model_name": model_name, "role": role, "block_size": "16", "num_gpu_blocks": str(NUM_KV_BLOCKS),
            "cache_dtype": "float32", "enable_prefix_caching": "True"}, 1.0)]
    with pytest.raises(urllib.error.URLError):  # bound to 127.0.0.2 only, apart from its gRPC port's host
        scrape(ports["prefill"][1], "127.0.0.1")
    families = scrape(router.metrics_port)
    for name, kind in ROUTER_METRICS.items():
        assert name in families and families[name].type == kind, name
        assert all(s.labels.get("model_name") == model_name for s in families[name].samples), name


def test_values_after_one_request_are_exact(workers, router):
    """58 prompt tokens no cache holds, 5 generated (ignore_eos, max_tokens=5): the first on the prefill worker in one
    step of 58 tokens, four on the decode worker in four one-token steps."""
    _, ports = workers
    before = scrape_workers(ports)
    with Client(router.address) as client:
        record = stream_to_record(client.generate(list(range(300, 358)), SamplingParams(max_tokens=5, temperature=0,
                                                                                          ignore_eos=True)))
    assert (len(record["token_ids"]), record["finish_reason"]) == (5, "length")
    after = scrape_workers(ports)
    counted = ["duet_prompt_tokens_total", "duet_generation_tokens_total", "duet_num_preemptions_total",
               "duet_request_queue_time_seconds_count", "duet_request_prefill_time_seconds_count",
               "duet_request_decode_time_seconds_count", "duet_iteration_tokens_total_count",
               "duet_iteration_tokens_total_sum", "duet_inter_token_latency_seconds_count",
               "duet_kv_transfer_seconds_count"]
    assert deltas(before["prefill"], after["prefill"], counted) == dict(zip(counted, [58, 1, 0, 1, 1, 0, 1, 58, 0, 1]))
    assert deltas(before["decode"], after["decode"], counted) == dict(zip(counted, [0, 4, 0, 0, 0, 1, 4, 4, 4, 0]))
    assert value(after["prefill"], "duet_kv_transfer_bytes_total") > value(before["prefill"],
                                                                           "duet_kv_transfer_bytes_total")
    assert value(after["prefill"], "duet_request_prefill_time_seconds_sum") > 0

    families = scrape(router.metrics_port)
    assert value(families, "duet_router_prompt_tokens_total") == 58
    assert value(families, "duet_router_generation_tokens_total") == 5
    assert {s.labels["finished_reason"]: s.value for s in families["duet_router_request_success"].samples
            if s.name.endswith("_total")} == {"stop": 0, "length": 1, "abort": 0}
    assert {s.labels["status"]: s.value for s in families["duet_router_requests"].samples
            if s.name.endswith("_total")} == {"OK": 1}
    assert value(families, "duet_router_time_to_first_token_seconds_count") == 1
    assert value(families, "duet_router_e2e_request_latency_seconds_count") == 1


def test_router_counts_stop_abort_and_rejected_requests_by_status(workers, router, tiny_llama_dir):
    with Client(router.address) as client:
        prompt = list(range(2, 20))
        first = stream_to_record(client.generate(prompt, SamplingParams(max_tokens=1, temperature=0)))
        assert first["finish_reason"] == "length"
        stop = stream_to_record(client.generate(prompt, SamplingParams(  # greedy: the same first token, a stop
            max_tokens=8, temperature=0, stop_token_ids=first["token_ids"])))
        assert (stop["token_ids"], stop["finish_reason"]) == (first["token_ids"], "stop")
        stream = client.generate(prompt, SamplingParams(max_tokens=900, temperature=0, ignore_eos=True),
                                 request_id="to-abort")
        next(stream)  # the first token is out: the request is decoding
        assert client.abort("to-abort")
        assert stream_to_record(stream)["finish_reason"] == "abort"
        bad = grpc_plumbing_error(lambda: list(client.generate([1, 99999], SamplingParams(max_tokens=1))))
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    families = scrape(router.metrics_port)
    assert {s.labels["finished_reason"]: s.value for s in families["duet_router_request_success"].samples
            if s.name.endswith("_total")} == {"stop": 1, "length": 1, "abort": 1}
    assert {s.labels["status"]: s.value for s in families["duet_router_requests"].samples
            if s.name.endswith("_total")} == {"OK": 3, "INVALID_ARGUMENT": 1}
    assert value(families, "duet_router_e2e_request_latency_seconds_count") == 2  # stop and length, not abort
    # a router that wants a token counts the calls it refuses for want of one
    redis_server, _ = workers
    guarded = RouterServer(RouterConfig(redis_url=redis_server.url, model_dir=tiny_llama_dir, port=0, metrics_port=0,
                                        max_model_len=1024, auth_token="secret"))
    guarded.start()
    try:
        with Client(guarded.address) as client:
            for _ in range(2):
                e = grpc_plumbing_error(lambda: list(client.generate([1, 2], SamplingParams(max_tokens=1))))
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED
            assert grpc_plumbing_error(lambda: client.abort("x")).code() == grpc.StatusCode.UNAUTHENTICATED
        families = scrape(guarded.metrics_port)
        assert {s.labels["status"]: s.value for s in families["duet_router_requests"].samples
                if s.name.endswith("_total")} == {"UNAUTHENTICATED": 2}  # Generate calls only, not Abort
    finally:
        guarded.stop()


def grpc_plumbing_error(fn) -> grpc.RpcError:
    try:
        fn()
    except grpc.RpcError as e:
        return e
    raise AssertionError("expected an RpcError")


# -- the dashboard ----------------------------------------------------------------------------------------------

# added by Prometheus (the chart's ServiceMonitor relabels), not by duet: a real scrape cannot have them
_SCRAPE_LABELS = {"namespace", "duet_release", "le"}
_PROMQL_WORDS = {"sum", "by", "rate", "histogram_quantile", "avg", "max", "min", "count", "without", "or",
                 "vector", "label_values", "increase", "irate", "on", "ignoring", "group_left", "clamp_min"}


def dashboard_queries() -> list[str]:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "duet.json").read_text())
    queries = [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    panels = [p for row in dashboard["panels"] for p in [row, *row.get("panels", [])]]
    return queries + [t["expr"] for p in panels for t in p.get("targets", [])]


def test_every_metric_and_label_the_dashboard_queries_is_in_a_real_scrape(workers, router):
    _, ports = workers
    with Client(router.address) as client:  # one request, so every labelled series has a sample
        stream_to_record(client.generate(list(range(2, 30)), SamplingParams(max_tokens=2, temperature=0,
                                                                              ignore_eos=True)))
    scraped: dict[str, set[str]] = {}  # sample name -> the label names it has
    for families in [*scrape_workers(ports).values(), scrape(router.metrics_port)]:
        for family in families.values():
            for s in family.samples:
                scraped.setdefault(s.name, set()).update(s.labels)
    queries = dashboard_queries()
    assert len(queries) > 20
    for query in queries:
        names = set(re.findall(r"\bduet_[a-z0-9_]+\b", query)) - _SCRAPE_LABELS
        assert names, query
        for name in names:
            assert name in scraped, f"the dashboard queries {name}, which no component exposes: {query}"
        used = set(re.findall(r"\b([a-z_]+)\s*(?:=~|!=|!~|=)\s*\"", query))
        for grouping in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", query):
            used |= {label.strip() for label in grouping.split(",") if label.strip()}
        used |= set(re.findall(r"label_values\([^,]+,\s*([a-z_]+)\)", query))
        available = set.union(*(scraped[n] for n in names)) | _SCRAPE_LABELS
        assert used - _PROMQL_WORDS <= available, (query, used - _PROMQL_WORDS - available)
