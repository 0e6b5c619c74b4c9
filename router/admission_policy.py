"""SLO-aware admission: predict a request's time to first token (TTFT) and refuse, before anything is reserved
or computed, the one that would miss the TTFT SLO because of the queue ahead of it.

Pure logic, no gRPC and no Redis, in the style of router/prefix_policy.py: the orchestrator hands it one
`PrefillQueue` per prefill worker the request could go to and gets an `AdmissionDecision` back.

    predicted TTFT on worker w  =  fixed_s                                                RPCs, scheduling, streams
                                +  queue_s(w)    = queued_tokens(w) / speed(w)            the work ahead of it
                                +  prefill_s(w)  = uncached_tokens(w) / speed(w)          its own uncached part
                                +  transfer_s    = uncached_tokens(w) / transfer_tokens_per_s
                                                                                          KV still to send once computed

and the sum is multiplied by `correction`, how far off that model has lately been (observed / modelled TTFT of
recent first tokens, router/ttft_correction.py: what the model cannot see, such as CPU other processes take).

`speed` is the worker's measured prefill rate (its load reports; unknown: the median of the others, else
`default_tokens_per_s`, as prefix_policy). `transfer_tokens_per_s` is measured by the router from prefill
replies (router/kv_transfer_rate.py): KV streams out layer group by layer group while the prompt is computed,
so only the tail after the last layer counts. The request's prediction is the best worker's: the prefill choice
sends it to the cheapest one.

    queued_tokens(w) = max(this router's tokens in flight on w,  the uncached tokens it admitted for w and has not
                           seen answered (those still in Reserve too),  reported waiting tokens - report age * speed)

A load report is up to a heartbeat old and already counts this router's in-flight work, so summing the two would
count it twice; the report still tells of other routers' work, drained at the worker's speed for as long as the
report is old.

The rule: refuse when the prediction exceeds the SLO **and the queue is the reason**, i.e. the same request on
an idle worker (`idle_s`: the prediction without queue_s) would meet it. So
- an idle cluster never refuses a request (no queue: prediction == idle_s);
- a request that misses the SLO even on an idle cluster (a huge prompt) is served, late, rather than refused:
  its retry would be refused again forever (vLLM and Dynamo serve it too);
- a request the decode worker prefills itself (conditional disaggregation, `predict_local`) is judged the same
  way, with the decode worker's queue: the local prefills ahead of it there (this router's in flight, and the
  decode worker's reported waiting tokens), at the speed the decode worker measured for them; no transfer.

The retry hint is how long the queue needs to drain enough at the worker's speed, no new work arriving:
prediction - SLO, rounded up to a millisecond, within [min_retry_ms, max_retry_ms].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router import prefix_policy


@dataclass(frozen=True)
class PrefillQueue:
    """One worker's prefill work as admission sees it: a prefill worker's, or the local prefills of a decode worker
    (conditional disaggregation)."""

    worker_id: str
    cached_tokens: int  # leading prompt tokens it holds (from the index)
    inflight_tokens: int  # prefill work this router sent there and has not seen answered
    awaiting_tokens: int  # uncached prompt tokens this router admitted for it, not answered: in Reserve too
    reported_waiting_tokens: int  # its last load report's uncached tokens queued
    report_age_s: float  # how old that report is
    tokens_per_s: float | None = None  # measured prefill speed; None: not known yet


@dataclass(frozen=True)
class AdmissionConfig:
    slo_ttft_s: float | None = None  # None: predict only, never refuse
    fixed_s: float = 0.02  # per request: lookup, Reserve, Prefill and stream round trips (an estimate, not fitted)
    default_tokens_per_s: float = 20_000.0  # prefill speed before any worker measured one (prefix_policy's)
    min_retry_ms: int = 100
    max_retry_ms: int = 30_000

    def __post_init__(self) -> None:
        if self.slo_ttft_s is not None and not self.slo_ttft_s > 0:
            raise ValueError(f"slo_ttft_s={self.slo_ttft_s} is invalid: must be > 0 (None: off)")
        if self.fixed_s < 0:
            raise ValueError(f"fixed_s={self.fixed_s} is invalid: must be >= 0")
        if not self.default_tokens_per_s > 0:
            raise ValueError(f"default_tokens_per_s={self.default_tokens_per_s} is invalid: must be > 0")
        if not 0 < self.min_retry_ms <= self.max_retry_ms:
            raise ValueError(f"min_retry_ms={self.min_retry_ms}, max_retry_ms={self.max_retry_ms} are invalid: "
                             "need 0 < min_retry_ms <= max_retry_ms")


@dataclass(frozen=True)
class TTFTPrediction:
    worker_id: str  # the worker it was predicted on: a prefill worker, or (local) the decode worker
    fixed_s: float
    queue_s: float
    prefill_s: float
    transfer_s: float
    correction: float = 1.0  # observed / modelled TTFT lately (router/ttft_correction.py)
    speed_measured: bool = True  # the worker's own measured prefill speed, not a stand-in (the median or default)
    uncached_tokens: int = 0  # the prompt's part to prefill there
    local: bool = False  # prefilled on the decode worker itself (conditional disaggregation)

    def __post_init__(self) -> None:
        if not self.correction > 0:
            raise ValueError(f"correction={self.correction} is invalid: must be > 0")

    @property
    def model_s(self) -> float:
        """The model's sum, uncorrected (what the correction is measured against)."""
        return self.fixed_s + self.queue_s + self.prefill_s + self.transfer_s

    @property
    def ttft_s(self) -> float:
        return self.model_s * self.correction

    @property
    def idle_s(self) -> float:
        """The prediction on the same worker with no queue ahead."""
        return (self.fixed_s + self.prefill_s + self.transfer_s) * self.correction

    def describe(self) -> str:
        where = f"decode worker {self.worker_id} (local prefill)" if self.local else f"prefill worker {self.worker_id}"
        return (f"{1000 * self.ttft_s:.0f} ms = (queue {1000 * self.queue_s:.0f} + prefill {1000 * self.prefill_s:.0f}"
                f" + transfer {1000 * self.transfer_s:.0f} + fixed {1000 * self.fixed_s:.0f} ms)"
                f" x {self.correction:.2f} observed/modelled on {where}")


@dataclass(frozen=True)
class AdmissionDecision:
    admit: bool
    prediction: TTFTPrediction
    retry_after_ms: int = 0  # refused: when to try again


def fallback_tokens_per_s(workers: Sequence[PrefillQueue], config: AdmissionConfig) -> float:
    return prefix_policy.fallback_tokens_per_s([w.tokens_per_s for w in workers], config.default_tokens_per_s)


def queued_tokens(worker: PrefillQueue, tokens_per_s: float) -> float:
    """The work ahead of a new request on `worker` (see the module docstring)."""
    ahead = prefix_policy.work_ahead_tokens(worker.inflight_tokens, worker.reported_waiting_tokens,
                                            worker.report_age_s, tokens_per_s)
    return max(ahead, float(worker.awaiting_tokens))


def predict_prefill(prompt_tokens: int, workers: Sequence[PrefillQueue], transfer_tokens_per_s: float,
                    config: AdmissionConfig, correction: float = 1.0) -> TTFTPrediction:
    """The lowest predicted TTFT over `workers` (non-empty) for a prompt of `prompt_tokens`."""
    if not workers:
        raise ValueError("workers is empty: need at least one prefill worker")
    if not transfer_tokens_per_s > 0:
        raise ValueError(f"transfer_tokens_per_s={transfer_tokens_per_s} is invalid: must be > 0")
    fallback = fallback_tokens_per_s(workers, config)
    predictions = []
    for w in workers:
        speed = w.tokens_per_s or fallback
        uncached_tokens = prompt_tokens - min(w.cached_tokens, prompt_tokens)
        predictions.append(TTFTPrediction(w.worker_id, config.fixed_s, queued_tokens(w, speed) / speed,
                                          uncached_tokens / speed, uncached_tokens / transfer_tokens_per_s,
                                          correction, w.tokens_per_s is not None, uncached_tokens))
    return min(predictions, key=lambda p: (p.ttft_s, p.worker_id))


def predict_local(uncached_tokens: int, decode: PrefillQueue, workers: Sequence[PrefillQueue],
                  config: AdmissionConfig, correction: float = 1.0) -> TTFTPrediction:
    """A prefill on decode worker `decode` itself, behind the local prefills queued there; no transfer. At the
    speed the decode worker measured for its local prefills (decode rows and all); until it has one, the prefill
    workers' (`workers`: same model, same kind of device in duet up) stands in, measured when one of them measured
    its own."""
    speed = decode.tokens_per_s or fallback_tokens_per_s(workers, config)
    measured = bool(decode.tokens_per_s) or any(w.tokens_per_s for w in workers)
    return TTFTPrediction(decode.worker_id, config.fixed_s, queued_tokens(decode, speed) / speed,
                          uncached_tokens / speed, 0.0, correction, measured, uncached_tokens, local=True)


def decide(prediction: TTFTPrediction, config: AdmissionConfig) -> AdmissionDecision:
    """Admit unless the SLO is set, the prediction misses it and the queue is the reason (module docstring)."""
    if config.slo_ttft_s is None:
        return AdmissionDecision(True, prediction)
    slo_us, ttft_us, idle_us = _us(config.slo_ttft_s), _us(prediction.ttft_s), _us(prediction.idle_s)
    if ttft_us <= slo_us or idle_us > slo_us:
        return AdmissionDecision(True, prediction)
    wait_ms = -(-(ttft_us - slo_us) // 1000)  # rounded up
    return AdmissionDecision(False, prediction, min(max(wait_ms, config.min_retry_ms), config.max_retry_ms))


def _us(seconds: float) -> int:
    """Compared to the microsecond: a sum of float terms that is the SLO on paper (0.01 + 0.035 + 0.05 + 0.005)
    must not miss it by a rounding error."""
    return round(seconds * 1_000_000)
