"""The router's Prometheus metrics (one registry per router, so several can live in one process).

The router sees each request whole, as vLLM's API server does, so the request-level metrics vLLM keeps are
kept here, under vLLM's names with `duet_router_` for `vllm:` and vLLM's `model_name` label (the model id
the router serves) on every metric. The engine-level ones (queue, prefill and decode time, preemptions,
iteration tokens, cache config) are the workers' (worker/metrics.py).

    duet_router_...{model_name}                 vLLM's                            duet's meaning
    prompt_tokens_total                counter  vllm:prompt_tokens                prompt tokens of requests whose
                                                                                  first token came back
    generation_tokens_total            counter  vllm:generation_tokens            tokens sent to clients (the
                                                                                  usage's completion_tokens)
    request_success_total{finished_reason} counter vllm:request_success           requests that ended with a finish
                                                                                  reason: stop | length | abort
    time_to_first_token_seconds        histogram vllm:time_to_first_token_seconds request received -> first token sent
    e2e_request_latency_seconds        histogram vllm:e2e_request_latency_seconds request received -> last token
                                                                                  sent (stop or length)
    requests_total{status}             counter  -   every Generate call, once, by final gRPC status name: OK,
                                                CANCELLED (the client left), and the rejected ones by their code
                                                (INVALID_ARGUMENT, UNAUTHENTICATED, RESOURCE_EXHAUSTED,
                                                FAILED_PRECONDITION, UNAVAILABLE, DEADLINE_EXCEEDED, ...). Not
                                                counted: calls gRPC itself refuses before duet's code runs (over
                                                --max-concurrent-streams, a message over the size limit)
    http_requests_total{handler, method, status} counter  (vLLM's http_requests_total) every OpenAI HTTP response
                                                by route and exact status code: the refusals no Generate call sees
                                                (400 for a body that does not parse, 401, 404, 408, 413) included
    migrations_total{reason}           counter  -   requests continued elsewhere: decode_lost | prefill_lost
                                                    | kv_transfer
    worker_restarts_total{role}        counter  -   a worker registered again at an address with a new worker id
                                                    (restarted by `duet up`, Kubernetes, Ray)
    routing_decisions_total{branch}    counter  -   prefix | load | guardrail | load_only
    prefix_lookup_seconds              histogram -  one index round trip
    routing_decision_seconds           histogram -  hashing + lookup + policy
    predicted_cached_tokens_total      counter  -   what the index said the chosen worker holds
    actual_cached_tokens_total         counter  -   what that worker reported it reused
    decode_cached_tokens_total         counter  -   prompt tokens the decode worker already held, of completed
                                                    requests (their Usage's decode_cached_tokens)
    kv_transferred_tokens_total        counter  -   tokens whose KV crossed the wire, of completed requests
                                                    (Usage's kv_transferred_tokens, a migration's resend included)
    local_prefills_total               counter  -   completed requests prefilled on their decode worker
                                                    (conditional disaggregation, --local-prefill-tokens)
    index_available                    gauge    -   1 when the last lookup reached Redis
    index_block_keys                   gauge    -   index size (refreshed periodically)
    speculative_dropped_total          counter  -   speculative index entries dropped (writer queue full)

SLO-aware admission and goodput (router/admission_policy.py; the SLOs are --slo-ttft-ms / --slo-tpot-ms):
    predicted_ttft_seconds             histogram -  the TTFT admission predicted, every request (SLO set or not)
    ttft_prediction_ratio              histogram -  observed / predicted TTFT of each first token: how far to
                                                    trust the prediction (1: exact)
    prefill_queue_seconds              gauge    -   predicted queue wait summed over the prefill workers (every
                                                    HEALTH_POLL_S and every request); what the chart can scale on
    slo_ttft_seconds                   gauge    -   the TTFT SLO (0: none)
    slo_rejected_requests_total        counter  -   refused by admission: RESOURCE_EXHAUSTED / HTTP 429 (also in
                                                    requests_total{status="RESOURCE_EXHAUSTED"})
    slo_requests_total{slo, result}    counter  -   slo="ttft" at each first token, slo="tpot" at each completion
                                                    (stop or length): result="met" | "missed"; only SLOs set
    good_requests_total                counter  -   completed (stop or length) within every SLO set: rate() is
                                                    the goodput in requests/s (no SLO set: every completion)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values (as the public API sends them)


class RouterMetrics:
    def __init__(self, model_name: str, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> None:
        """`slo_ttft_s` / `slo_tpot_s`: the SLOs goodput is counted against (None: not set)."""
        self.model_name = model_name
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.registry = r = CollectorRegistry()
        m = ["model_name"]

        def counter(name: str, help_text: str, *labels: str) -> Counter:
            c = Counter(name, help_text, [*m, *labels], registry=r)
            return c if labels else c.labels(model_name)

        self.requests = counter("duet_router_requests", "Generate calls by final status", "status")
        self.success = counter("duet_router_request_success", "Requests ended with a finish reason",
                                "finished_reason")
        for reason in FINISH_REASONS:  # present at zero from the start, as vLLM's
            self.success.labels(model_name, reason)
        self.http_requests = counter("duet_router_http_requests", "OpenAI HTTP responses by route and status",
                                     "handler", "method", "status")
        self.migrations = counter("duet_router_migrations", "Requests continued on another worker, by reason",
                                   "reason")
        self.worker_restarts = counter("duet_router_worker_restarts",
                                        "Workers seen registered again at their address under a new id", "role")
        self.decisions = counter("duet_router_routing_decisions", "Prefill choices by branch", "branch")
        self.lookup_s = Histogram("duet_router_prefix_lookup_seconds", "Prefix index lookup (one round trip)", m,
                                  buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.decision_s = Histogram("duet_router_routing_decision_seconds", "Hashing + lookup + policy", m,
                                    buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.predicted_cached = counter("duet_router_predicted_cached_tokens",
                                        "Cached prompt tokens the index predicted on the chosen worker")
        self.actual_cached = counter("duet_router_actual_cached_tokens",
                                     "Cached prompt tokens the chosen prefill worker reported reusing")
        self.decode_cached_tokens = counter("duet_router_decode_cached_tokens",
                                            "Prompt tokens the decode worker already held (completed requests)")
        self.kv_transferred_tokens = counter("duet_router_kv_transferred_tokens",
                                             "Tokens whose KV crossed the wire (completed requests)")
        self.local_prefills = counter("duet_router_local_prefills",
                                      "Completed requests prefilled on their decode worker (no KV transfer)")
        self.prompt_tokens = counter("duet_router_prompt_tokens",
                                     "Prompt tokens of requests whose first token came back")
        self.generation_tokens = counter("duet_router_generation_tokens", "Tokens sent to clients")
        self.index_available = Gauge("duet_router_index_available", "1 if the prefix index answered last time", m,
                                     registry=r).labels(model_name)
        self.index_block_keys = Gauge("duet_router_index_block_keys", "Block entries in the prefix index", m,
                                      registry=r).labels(model_name)
        self.speculative_dropped = counter("duet_router_speculative_dropped",
                                           "Speculative index entries dropped because the writer queue was full")
        self.ttft_s = Histogram("duet_router_time_to_first_token_seconds", "Request received -> first token sent",
                                m, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.e2e_s = Histogram("duet_router_e2e_request_latency_seconds", "Request received -> last token sent", m,
                               buckets=_TTFT_BUCKETS + (60.0, 120.0), registry=r).labels(model_name)
        self.predicted_ttft_s = Histogram("duet_router_predicted_ttft_seconds", "TTFT predicted at admission", m,
                                          buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.ttft_prediction_ratio = Histogram("duet_router_ttft_prediction_ratio", "Observed / predicted TTFT", m,
                                               buckets=_RATIO_BUCKETS, registry=r).labels(model_name)
        self.prefill_queue_s = Gauge("duet_router_prefill_queue_seconds",
                                     "Predicted queue wait summed over the prefill workers", m,
                                     registry=r).labels(model_name)
        self.slo_ttft = Gauge("duet_router_slo_ttft_seconds", "The TTFT SLO (0: none)", m,
                              registry=r).labels(model_name)
        self.slo_rejected = counter("duet_router_slo_rejected_requests",
                                    "Requests refused by admission: predicted to miss the TTFT SLO")
        self.slo_requests = counter("duet_router_slo_requests", "Requests against each SLO set, met or missed",
                                    "slo", "result")
        self.good_requests = counter("duet_router_good_requests", "Requests completed within every SLO set")
        for slo, target in (("ttft", slo_ttft_s), ("tpot", slo_tpot_s)):
            if target is not None:  # present at zero from the start
                for result in ("met", "missed"):
                    self.slo_requests.labels(model_name, slo, result)
        self.slo_ttft.set(slo_ttft_s or 0.0)
        self.index_available.set(1)

    # -- one request's stages (the orchestrator reports each once, when it happens) ------------------

    def request_prefilled(self, prompt_tokens: int, predicted_cached_tokens: int, actual_cached_tokens: int) -> None:
        """The prefill worker returned the first token: how well the index predicted its cache."""
        self.prompt_tokens.inc(prompt_tokens)
        self.predicted_cached.inc(predicted_cached_tokens)
        self.actual_cached.inc(actual_cached_tokens)

    def ttft_predicted(self, predicted_s: float) -> None:
        self.predicted_ttft_s.observe(predicted_s)

    def slo_refused(self) -> None:
        """Admission refused the request (its final status, RESOURCE_EXHAUSTED, is counted by request_ended)."""
        self.slo_rejected.inc()

    def first_token_sent(self, ttft_s: float, predicted_ttft_s: float | None = None) -> None:
        """`predicted_ttft_s`: what admission predicted for this request (None: no prediction, e.g. a migration)."""
        self.ttft_s.observe(ttft_s)
        if predicted_ttft_s:
            self.ttft_prediction_ratio.observe(ttft_s / predicted_ttft_s)
        if self.slo_ttft_s is not None:
            self.slo_requests.labels(self.model_name, "ttft", _met(ttft_s <= self.slo_ttft_s)).inc()

    def tokens_sent(self, num_tokens: int) -> None:
        if num_tokens:
            self.generation_tokens.inc(num_tokens)

    def request_completed(self, finish_reason: str, e2e_s: float, ttft_s: float, num_output_tokens: int,
                          decode_cached_tokens: int = 0, kv_transferred_tokens: int = 0,
                          prefilled_locally: bool = False) -> None:
        """The last token went out with a finish reason (or a stop string: "stop"); not an abort. Goodput: within
        the TTFT SLO and, over the tokens after the first, the TPOT SLO ((e2e - ttft) / (tokens - 1), as
        `duet bench serve` and vLLM's benchmark count it). And where its prompt's KV came from (its final Usage)."""
        self.success.labels(self.model_name, finish_reason).inc()
        self.e2e_s.observe(e2e_s)
        good = self.slo_ttft_s is None or ttft_s <= self.slo_ttft_s
        if self.slo_tpot_s is not None:
            tpot_s = (e2e_s - ttft_s) / (num_output_tokens - 1) if num_output_tokens > 1 else 0.0
            met = tpot_s <= self.slo_tpot_s
            self.slo_requests.labels(self.model_name, "tpot", _met(met)).inc()
            good = good and met
        if good:
            self.good_requests.inc()
        self.decode_cached_tokens.inc(decode_cached_tokens)
        self.kv_transferred_tokens.inc(kv_transferred_tokens)
        if prefilled_locally:
            self.local_prefills.inc()

    def request_aborted(self) -> None:
        """`Abort` ended the request: its last message carried finish reason "abort"."""
        self.success.labels(self.model_name, "abort").inc()

    def request_migrated(self, reason: str) -> None:
        self.migrations.labels(self.model_name, reason).inc()

    def worker_restarted(self, role: str) -> None:
        self.worker_restarts.labels(self.model_name, role).inc()

    def routing_decided(self, branch: str, decision_s: float) -> None:
        self.decisions.labels(self.model_name, branch).inc()
        self.decision_s.observe(decision_s)

    def request_ended(self, status: str) -> None:
        """Every Generate call, once, by final gRPC status name (a rejected one too, before any routing)."""
        self.requests.labels(self.model_name, status).inc()

    def http_response(self, handler: str, method: str, status: int) -> None:
        self.http_requests.labels(self.model_name, handler, method, str(status)).inc()

    def prefill_queue_measured(self, queue_s: float) -> None:
        self.prefill_queue_s.set(queue_s)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose /metrics over HTTP; returns the port (0 picks a free one)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port


def _met(met: bool) -> str:
    return "met" if met else "missed"
