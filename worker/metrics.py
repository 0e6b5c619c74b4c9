"""A worker's Prometheus metrics, names following vLLM's where the meaning is the same (with a `duet_`
prefix and a `role` label, so one dashboard query covers a pool):

    duet_num_requests_waiting{role}        gauge    queued (prefill) / reserved, not yet decoding (decode)
    duet_num_requests_running{role}        gauge
    duet_num_waiting_tokens{role}          gauge    uncached prompt tokens queued (prefill work)
    duet_kv_cache_usage_perc{role}         gauge    fraction of KV blocks in use (0..1, as vLLM)
    duet_prefix_cache_queries_total{role}  counter  prompt tokens looked up in the prefix cache
    duet_prefix_cache_hits_total{role}     counter  of which found
    duet_kv_events_dropped_total{role}     counter
    duet_prefix_index_resyncs_total{role}  counter
    duet_inter_token_latency_seconds{role} histogram  decode: time between a request's tokens
    duet_kv_transfer_seconds{role}         histogram  prefill: last forward pass -> decode worker acked all KV
    duet_kv_transfer_bytes_total{role}     counter

Gauges and the counters the engine already keeps are read at scrape time (a custom collector), so the
engine thread does no metrics work for them.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _Snapshot:
    """Reads the worker's numbers when Prometheus scrapes."""

    def __init__(self, role: str, read: Callable[[], dict[str, float]]):
        self.role, self.read = role, read

    def collect(self):
        values = self.read()
        for name, help_text in (
            ("num_requests_waiting", "Requests waiting"),
            ("num_requests_running", "Requests running"),
            ("num_waiting_tokens", "Uncached prompt tokens queued"),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use"),
        ):
            g = GaugeMetricFamily(f"duet_{name}", help_text, labels=["role"])
            g.add_metric([self.role], float(values[name]))
            yield g
        for name, help_text in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
            ("kv_events_dropped", "KV events dropped while Redis was unreachable"),
            ("prefix_index_resyncs", "Prefix index resyncs from this worker's cache"),
        ):
            c = CounterMetricFamily(f"duet_{name}", help_text, labels=["role"])
            c.add_metric([self.role], float(values[name]))
            yield c


class WorkerMetrics:
    def __init__(self, role: str, read: Callable[[], dict[str, float]]):
        self.role = role
        self.registry = r = CollectorRegistry()
        r.register(_Snapshot(role, read))
        self.inter_token_s = Histogram("duet_inter_token_latency_seconds", "Time between a request's tokens",
                                       ["role"], buckets=_ITL_BUCKETS, registry=r).labels(role)
        self.kv_transfer_s = Histogram("duet_kv_transfer_seconds", "Last forward pass -> all KV acked",
                                       ["role"], buckets=_TRANSFER_BUCKETS, registry=r).labels(role)
        self.kv_transfer_bytes = Counter("duet_kv_transfer_bytes", "KV bytes sent to decode workers", ["role"],
                                         registry=r).labels(role)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
