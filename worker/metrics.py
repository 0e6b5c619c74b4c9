"""A worker's Prometheus metrics: vLLM's names and meaning where the meaning is the same, with a `duet_` prefix
for vLLM's `vllm:` and a `role` label (prefill | decode, so one query covers a pool) next to vLLM's
`model_name` label (the worker's model id). vLLM's `engine` label has no counterpart: one engine per worker.

    duet_...{model_name, role}             vLLM's                         duet's meaning
    num_requests_waiting            gauge  vllm:num_requests_waiting      queued (prefill) / reserved, not yet
                                                                          decoding (decode)
    num_requests_running            gauge  vllm:num_requests_running
    num_waiting_tokens              gauge  -                              uncached prompt tokens queued (prefill;
                                                                          decode: its local prefills')
    kv_cache_usage_perc             gauge  vllm:kv_cache_usage_perc       fraction of KV blocks in use (0..1)
    prefix_cache_queries_total      counter vllm:prefix_cache_queries     prompt tokens looked up in the cache
    prefix_cache_hits_total         counter vllm:prefix_cache_hits        of which found
    prompt_tokens_total             counter vllm:prompt_tokens            prompt tokens of requests whose first
                                                                          token was sampled here (prefill workers;
                                                                          a request whose KV arrived, or a migrated
                                                                          one, counted where it was prefilled)
    generation_tokens_total         counter vllm:generation_tokens        tokens sampled here: a prefill worker's
                                                                          first token, a decode worker's the rest
    num_preemptions_total           counter vllm:num_preemptions          requests preempted (KV dropped, recomputed)
    iteration_tokens_total          histogram vllm:iteration_tokens_total tokens computed by one engine step
    request_queue_time_seconds      histogram vllm:request_queue_time_seconds   prefill: arrival -> first scheduled
    request_prefill_time_seconds    histogram vllm:request_prefill_time_seconds first scheduled -> first token
                                                                          (prefill workers)
    request_decode_time_seconds     histogram vllm:request_decode_time_seconds  decode: KV and first token arrived ->
                                                                          finished (stop, length or abort)
    inter_token_latency_seconds     histogram vllm:inter_token_latency_seconds  decode: time between a request's
                                                                          tokens
    cache_config_info               gauge  vllm:cache_config_info         1; the KV cache's settings as labels:
                                                                          block_size, num_gpu_blocks (KV blocks on
                                                                          the worker's device, CPU too),
                                                                          cache_dtype, enable_prefix_caching
    spec_decode_num_drafts_total    counter vllm:spec_decode_num_drafts   decode: steps' chunks that carried guesses
    spec_decode_num_draft_tokens_total counter vllm:spec_decode_num_draft_tokens  guesses verified
    spec_decode_num_accepted_tokens_total counter vllm:spec_decode_num_accepted_tokens  of which accepted
    spec_decode_num_accepted_tokens_per_pos_total counter vllm:(same)    {position}: drafts whose guess at that
                                                                          position was accepted
    draft_computed_tokens_total     counter -                             tokens a draft model computed here (decode:
                                                                          guesses and catch-up; prefill: the prompts
                                                                          whose draft KV it ships)
    draft_prompt_catch_up_tokens_total counter -                          decode: of those, prompt tokens fed while
                                                                          guessing (0 while the draft's prompt KV
                                                                          arrives with the target's)
    kv_events_dropped_total         counter -                             KV events dropped (Redis unreachable)
    prefix_index_resyncs_total      counter -
    kv_transfer_seconds             histogram -                           prefill: last forward pass -> the decode
                                                                          worker acked all KV
    kv_transfer_bytes_total         counter -

Every metric is exposed by both roles (a role that never observes one shows it at zero), so both scrape alike.
Where vLLM counts what one engine saw of a whole request, duet's request is split over two workers: the
router's metrics (router/metrics.py) count each request once, as vLLM's API server does.

Gauges and the counters the engine already keeps are read at scrape time (a custom collector), so the engine
thread does no metrics work for them; it observes only the per-step and per-token histograms.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LABELS = ("model_name", "role")
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# vLLM's request-phase buckets start at 0.3 s; a small model's phases take milliseconds, so these start lower
_PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                  160.0, 320.0, 640.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's

GAUGES = {
    "num_requests_waiting": "Requests waiting",
    "num_requests_running": "Requests running",
    "num_waiting_tokens": "Uncached prompt tokens queued",
    "kv_cache_usage_perc": "Fraction of KV blocks in use",
}
COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache",
    "prompt_tokens": "Prompt tokens of requests whose first token was sampled here",
    "generation_tokens": "Tokens sampled here",
    "num_preemptions": "Requests preempted (their KV dropped, to be recomputed)",
    "kv_events_dropped": "KV events dropped while Redis was unreachable",
    "prefix_index_resyncs": "Prefix index resyncs from this worker's cache",
    "spec_decode_num_drafts": "Chunks that carried speculative guesses",
    "spec_decode_num_draft_tokens": "Speculative guesses verified",
    "spec_decode_num_accepted_tokens": "Speculative guesses accepted",
    "draft_computed_tokens": "Tokens the draft model computed on this worker",
    "draft_prompt_catch_up_tokens": "Prompt tokens the draft model was fed on this worker while guessing",
}
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"  # a sequence of counts, one per guess position


class _Snapshot:
    """Reads the worker's numbers when Prometheus scrapes: `read()` gives every name of GAUGES and COUNTERS."""

    def __init__(self, label_values: tuple[str, str], read: Callable[[], Mapping[str, float]]):
        self.label_values, self.read = list(label_values), read

    def collect(self):
        values = self.read()
        for name, help_text in GAUGES.items():
            g = GaugeMetricFamily(f"duet_{name}", help_text, labels=LABELS)
            g.add_metric(self.label_values, float(values[name]))
            yield g
        for name, help_text in COUNTERS.items():
            c = CounterMetricFamily(f"duet_{name}", help_text, labels=LABELS)
            c.add_metric(self.label_values, float(values[name]))
            yield c
        c = CounterMetricFamily(f"duet_{PER_POSITION}", "Drafts whose guess at this position was accepted",
                                labels=(*LABELS, "position"))
        for position, count in enumerate(values[PER_POSITION]):
            c.add_metric([*self.label_values, str(position)], float(count))
        yield c


class WorkerMetrics:
    """One worker's registry. `read` gives the scrape-time numbers (see _Snapshot); `cache_info` the KV cache's
    settings, as label values of `duet_cache_config_info`."""

    def __init__(self, role: str, model_name: str, read: Callable[[], Mapping[str, float]],
                 cache_info: Mapping[str, str]):
        self.role, self.model_name = role, model_name
        self.registry = r = CollectorRegistry()
        labels = (model_name, role)
        r.register(_Snapshot(labels, read))

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, help_text, LABELS, buckets=buckets, registry=r).labels(*labels)

        self.inter_token_s = histogram("duet_inter_token_latency_seconds", "Time between a request's tokens",
                                       _ITL_BUCKETS)
        self.kv_transfer_s = histogram("duet_kv_transfer_seconds", "Last forward pass -> all KV acked",
                                       _TRANSFER_BUCKETS)
        self.queue_s = histogram("duet_request_queue_time_seconds", "Arrival -> first scheduled (prefill)",
                                 _PHASE_BUCKETS)
        self.prefill_s = histogram("duet_request_prefill_time_seconds", "First scheduled -> first token (prefill)",
                                   _PHASE_BUCKETS)
        self.decode_s = histogram("duet_request_decode_time_seconds",
                                  "KV and first token arrived -> finished (decode)", _PHASE_BUCKETS)
        self.iteration_tokens = histogram("duet_iteration_tokens_total", "Tokens computed by one engine step",
                                          _ITERATION_TOKEN_BUCKETS)
        self.kv_transfer_bytes = Counter("duet_kv_transfer_bytes", "KV bytes sent to decode workers", LABELS,
                                         registry=r).labels(*labels)
        info_labels = {"model_name": model_name, "role": role, **cache_info}
        Gauge("duet_cache_config_info", "The KV cache's settings (as labels)", list(info_labels),
              registry=r).labels(**info_labels).set(1)

    def observe_step(self, num_tokens: int) -> None:
        """One engine step computed `num_tokens` (a step that computed none is not one: nothing was scheduled)."""
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
