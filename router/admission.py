"""Admission: the router's side of SLO-aware admission (the policy is router/admission_policy.py).

    lookup (what each worker holds) + load reports + this router's in-flight work + measured KV transfer rate
        ─▶ admission_policy: predicted TTFT on the best prefill worker (or the decode worker, prefilling locally)
        ─▶ admitted: the prediction rides on the request's HandOffPlan; its first token is compared with it
           (duet_router_ttft_prediction_ratio; and the correction of later predictions learns from it,
           router/ttft_correction.py) and counted against the SLO (duet_router_slo_requests_total)
        ─▶ refused: RESOURCE_EXHAUSTED naming the prediction and the SLO, with the retry hint in the
           `grpc-retry-pushback-ms` trailer (HTTP: 429 with Retry-After), as when no decode worker can admit

A request is judged once, when it arrives: a retry after a lost worker or a migration is never refused (it was
admitted; it has waited already). Without an SLO the prediction is still made and measured, so it can be
checked before the SLO is turned on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from cluster.registry import LiveWorker
from router.admission_policy import (
    AdmissionConfig,
    PrefillQueue,
    TTFTPrediction,
    decide,
    fallback_tokens_per_s,
    predict_local,
    predict_prefill,
    queued_tokens,
)
from router.kv_transfer_rate import KVTransferRate
from router.metrics import RouterMetrics
from router.prefill_chooser import PrefixLookup
from router.request_stream import Failed
from router.ttft_correction import TTFTCorrection

log = logging.getLogger("duet.router")


@dataclass(frozen=True)
class LocalPrefill:
    """A request the decode worker Reserve will most likely pick would prefill itself: that worker, and how many
    of the prompt's tokens it lacks."""

    decode: LiveWorker
    uncached_tokens: int


class Admission:
    def __init__(self, config: AdmissionConfig, metrics: RouterMetrics):
        self.config, self.metrics = config, metrics
        self.transfer_rate = KVTransferRate()
        self.correction = TTFTCorrection()
        self._lock = threading.Lock()
        self._awaiting_tokens: dict[str, int] = {}  # prefill worker id -> uncached tokens admitted, not answered

    def admit(self, request_id: str, num_prompt_tokens: int, prefills: Sequence[LiveWorker],
              inflight_tokens: Mapping[str, int], lookup: PrefixLookup | None,
              local: LocalPrefill | None = None) -> TTFTPrediction:
        """The request's predicted TTFT, or `Failed(RESOURCE_EXHAUSTED)` with a retry hint when admission refuses
        it. `local`: the decode worker would prefill it itself (None: a prefill worker will)."""
        queues = self.queues(prefills, inflight_tokens, lookup)
        correction = self.correction.value
        if local is not None:
            [decode] = self.queues([local.decode], inflight_tokens, lookup)
            prediction = predict_local(local.uncached_tokens, decode, queues, self.config, correction)
        else:
            prediction = predict_prefill(num_prompt_tokens, queues, self.transfer_rate.tokens_per_s, self.config,
                                         correction)
        self.metrics.ttft_predicted(prediction.ttft_s)
        self.metrics.prefill_queue_measured(self.total_queue_s(queues))
        decision = decide(prediction, self.config)
        if decision.admit:
            return prediction
        self.metrics.slo_refused()
        slo_ms = 1000 * self.config.slo_ttft_s
        log.info("request=%s event=slo_refused predicted_ttft_ms=%.0f slo_ttft_ms=%g queue_ms=%.0f retry_ms=%d",
                 request_id, 1000 * prediction.ttft_s, slo_ms, 1000 * prediction.queue_s, decision.retry_after_ms)
        raise Failed(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"predicted time to first token {prediction.describe()} exceeds the SLO of {slo_ms:g} ms "
            f"(--slo-ttft-ms) because of the queue; retry after {decision.retry_after_ms} ms",
            (("grpc-retry-pushback-ms", str(decision.retry_after_ms)),),
        )

    @contextmanager
    def awaiting_prefill(self, prediction: TTFTPrediction | None) -> Iterator[None]:
        """While an admitted request reserves and is prefilled, its uncached tokens count as queued on the worker it
        was predicted on (a prefill worker, or the decode worker prefilling it), so the requests admitted just before
        it (still in Reserve, not yet sent) are seen."""
        worker_id, tokens = (prediction.worker_id, prediction.uncached_tokens) if prediction else ("", 0)
        if not worker_id or not tokens:  # no prediction, or all cached
            yield
            return
        with self._lock:
            self._awaiting_tokens[worker_id] = self._awaiting_tokens.get(worker_id, 0) + tokens
        try:
            yield
        finally:
            with self._lock:
                left = self._awaiting_tokens[worker_id] - tokens
                if left:
                    self._awaiting_tokens[worker_id] = left
                else:
                    del self._awaiting_tokens[worker_id]

    def first_token(self, ttft_s: float, prediction: TTFTPrediction) -> None:
        """An admitted request's first token went out `ttft_s` after it arrived: the correction learns from it when
        the prediction stood on the worker's measured speed (router/ttft_correction.py)."""
        if prediction.speed_measured:
            self.correction.observe(ttft_s, prediction.model_s)

    def transferred(self, kv_transferred_tokens: int, transfer_s: float) -> None:
        """A prefill reply's KV transfer, for the measured rate."""
        self.transfer_rate.observe(kv_transferred_tokens, transfer_s)

    def measure_queue(self, prefills: Sequence[LiveWorker], inflight_tokens: Mapping[str, int]) -> None:
        """Refresh duet_router_prefill_queue_seconds (between requests too, so an autoscaler sees the queue drain)."""
        self.metrics.prefill_queue_measured(self.total_queue_s(self.queues(prefills, inflight_tokens, None)))

    def total_queue_s(self, queues: Sequence[PrefillQueue]) -> float:
        fallback = fallback_tokens_per_s(queues, self.config)
        return sum(queued_tokens(q, q.tokens_per_s or fallback) / (q.tokens_per_s or fallback) for q in queues)

    def queues(self, prefills: Sequence[LiveWorker], inflight_tokens: Mapping[str, int],
               lookup: PrefixLookup | None) -> list[PrefillQueue]:
        with self._lock:
            awaiting = dict(self._awaiting_tokens)
        return [PrefillQueue(w.worker_id, lookup.cached_tokens(w.worker_id) if lookup is not None else 0,
                             inflight_tokens.get(w.worker_id, 0), awaiting.get(w.worker_id, 0),
                             w.load.num_waiting_tokens, w.load_age_s, w.load.prefill_tokens_per_s or None)
                for w in prefills]
