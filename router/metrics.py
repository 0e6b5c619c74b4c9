"""The router's Prometheus metrics (one registry per router, so several can live in one process).

    duet_router_requests_total{status}                  finished Generate calls by gRPC status
    duet_router_migrations_total{reason}                requests continued elsewhere: decode_lost | prefill_lost
                                                        | kv_transfer
    duet_router_worker_restarts_total{role}             a worker registered again at an address with a new
                                                        worker id (restarted by `duet up`, Kubernetes, Ray)
    duet_router_routing_decisions_total{branch}         prefix | load | guardrail | load_only
    duet_router_prefix_lookup_seconds                   one index round trip
    duet_router_routing_decision_seconds                hashing + lookup + policy
    duet_router_predicted_cached_tokens_total           what the index said the chosen worker holds
    duet_router_actual_cached_tokens_total              what that worker reported it reused
    duet_router_prompt_tokens_total
    duet_router_index_available                         1 when the last lookup reached Redis
    duet_router_index_block_keys                        index size (refreshed periodically)
    duet_router_speculative_dropped_total               speculative index entries dropped (writer queue full)
    duet_router_time_to_first_token_seconds, duet_router_e2e_request_latency_seconds
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("duet_router_requests", "Generate calls by final status", ["status"], registry=r)
        self.migrations = Counter("duet_router_migrations", "Requests continued on another worker, by reason",
                                  ["reason"], registry=r)
        self.worker_restarts = Counter("duet_router_worker_restarts",
                                       "Workers seen registered again at their address under a new id", ["role"],
                                       registry=r)
        self.decisions = Counter("duet_router_routing_decisions", "Prefill choices by branch", ["branch"],
                                 registry=r)
        self.lookup_s = Histogram("duet_router_prefix_lookup_seconds", "Prefix index lookup (one round trip)",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.decision_s = Histogram("duet_router_routing_decision_seconds", "Hashing + lookup + policy",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.predicted_cached = Counter("duet_router_predicted_cached_tokens",
                                        "Cached prompt tokens the index predicted on the chosen worker", registry=r)
        self.actual_cached = Counter("duet_router_actual_cached_tokens",
                                     "Cached prompt tokens the chosen prefill worker reported reusing", registry=r)
        self.prompt_tokens = Counter("duet_router_prompt_tokens", "Prompt tokens routed", registry=r)
        self.index_available = Gauge("duet_router_index_available", "1 if the prefix index answered last time",
                                     registry=r)
        self.index_block_keys = Gauge("duet_router_index_block_keys", "Block entries in the prefix index",
                                      registry=r)
        self.speculative_dropped = Counter("duet_router_speculative_dropped",
                                           "Speculative index entries dropped because the writer queue was full",
                                           registry=r)
        self.ttft_s = Histogram("duet_router_time_to_first_token_seconds", "Request received -> first token sent",
                                buckets=_TTFT_BUCKETS, registry=r)
        self.e2e_s = Histogram("duet_router_e2e_request_latency_seconds", "Request received -> last token sent",
                               buckets=_TTFT_BUCKETS + (60.0, 120.0), registry=r)
        self.index_available.set(1)

    # -- one request's stages (the orchestrator reports each once, when it happens) ------------------

    def request_prefilled(self, prompt_tokens: int, predicted_cached_tokens: int, actual_cached_tokens: int) -> None:
        """The prefill worker returned the first token: how well the index predicted its cache."""
        self.prompt_tokens.inc(prompt_tokens)
        self.predicted_cached.inc(predicted_cached_tokens)
        self.actual_cached.inc(actual_cached_tokens)

    def first_token_sent(self, ttft_s: float) -> None:
        self.ttft_s.observe(ttft_s)

    def request_completed(self, e2e_s: float) -> None:
        """The last token went out (a finish reason or a stop string; not an abort or a failure)."""
        self.e2e_s.observe(e2e_s)

    def request_migrated(self, reason: str) -> None:
        self.migrations.labels(reason).inc()

    def request_ended(self, status: str) -> None:
        """Every Generate call that reached the orchestrator, once, by final gRPC status name."""
        self.requests.labels(status).inc()

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose /metrics over HTTP; returns the port (0 picks a free one)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
