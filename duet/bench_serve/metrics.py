"""The figures of a `duet bench serve` run, as pure functions of its request records.

Percentiles are numpy's default ("linear": the p-th percentile of sorted x[0..n-1] is interpolated at rank
p/100 * (n - 1)), over these populations of the *completed* requests:

    ttft_ms, e2e_ms   one value per completed request
    tpot_ms           one per completed request with at least 2 output tokens (TPOT is undefined below)
    itl_ms            every inter-chunk gap of every completed request, pooled

An empty population (e.g. every request failed) has null percentiles.

The SLO: a request meets it if it completed and its TTFT <= `ttft_ms` and its TPOT <= `tpot_ms`, counting only
the limits given (a request with one output token has no TPOT and meets the TPOT limit). With no limit given,
every completed request meets it. goodput_rps = requests meeting it / duration_s; slo_attainment = requests
meeting it / all requests (failed ones included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from duet.bench_serve.request_record import RequestRecord

PERCENTILES = (50, 90, 99)
LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_ms is not None and (record.ttft_ms is None or record.ttft_ms > self.ttft_ms):
            return False
        if self.tpot_ms is not None and record.tpot_ms is not None and record.tpot_ms > self.tpot_ms:
            return False
        return True


def latency_stats(values_ms: Sequence[float]) -> dict[str, float | None]:
    """{"p50", "p90", "p99", "mean"} of the values (numpy's linear percentiles); all None when there are none."""
    if len(values_ms) == 0:
        return {**{f"p{p}": None for p in PERCENTILES}, "mean": None}
    values = np.asarray(values_ms, dtype=np.float64)
    out: dict[str, float | None] = {f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(values, PERCENTILES))}
    out["mean"] = float(values.mean())
    return out


def latency_samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """The population of each latency (see the module docstring), in record order."""
    done = [r for r in records if r.ok]
    return {
        "ttft_ms": [r.ttft_ms for r in done if r.ttft_ms is not None],
        "tpot_ms": [r.tpot_ms for r in done if r.tpot_ms is not None],
        "itl_ms": [gap for r in done for gap in r.itl_ms],
        "e2e_ms": [r.e2e_ms for r in done if r.e2e_ms is not None],
    }


def run_duration_s(records: Sequence[RequestRecord]) -> float:
    """From the run's start (t = 0, the first request's planned send) to the end of the last request sent."""
    ends = [r.start_s + r.e2e_ms / 1000.0 for r in records if r.start_s is not None and r.e2e_ms is not None]
    return max(ends, default=0.0)


def summarize(records: Sequence[RequestRecord], slo: SLO) -> dict:
    """The JSON summary: requests, completed, failed, duration_s (`run_duration_s`), output_tokens_per_s (completed
    requests' output tokens / duration_s), the four latencies' stats, goodput_rps and slo_attainment."""
    duration_s = run_duration_s(records)
    completed = [r for r in records if r.ok]
    meeting = sum(slo.met_by(r) for r in records)
    samples = latency_samples(records)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return {
        "requests": len(records),
        "completed": len(completed),
        "failed": len(records) - len(completed),
        "duration_s": duration_s,
        "output_tokens_per_s": per_s(sum(r.output_tokens for r in completed)),
        **{key: latency_stats(samples[key]) for key in LATENCY_KEYS},
        "goodput_rps": per_s(meeting),
        "slo_attainment": meeting / len(records) if records else 0.0,
    }


def throughput_bins(records: Sequence[RequestRecord], bin_s: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive `bin_s` bins from the run's start, completed requests only. A
    request's tokens are spread evenly over its text chunks (a chunk's own token count is not in the stream)."""
    done = [(r.chunk_times_s(), r.output_tokens) for r in records if r.ok]
    last_s = max((times[-1] for times, _ in done if times), default=0.0)
    bins = [0.0] * (int(last_s // bin_s) + 1)
    for times, tokens in done:
        for t in times:
            bins[int(t // bin_s)] += tokens / len(times) / bin_s
    return bins
