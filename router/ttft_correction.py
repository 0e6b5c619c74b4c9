"""TTFTCorrection: how far off admission's TTFT model has lately been, as observed / modelled time to first token,
a multiplier on the next predictions (router/admission_policy.py).

The model (queue and uncached prefill at the workers' reported speed, plus the KV transfer tail) leaves out what
it cannot see: CPU taken by other processes on the worker's host (a co-located decode engine, `duet up` on a
laptop), batching with other prompts, the router's own hops. Measured on a shared 2-core box, first tokens took
1.8x what the model said, and more under overload (benchmarks/RESULTS.md, SLO-aware admission). So each first
token of an admitted request feeds back its observed / modelled ratio, as NVIDIA Dynamo's SLA planner corrects
its TTFT predictions by observed / expected latency. Decayed sums (x DECAY per observation) follow the recent
load; the multiplier stays within [MIN_CORRECTION, MAX_CORRECTION] so one outlier (a worker restarting) cannot
make admission refuse everything or nothing; 1.0 until the first observation.

Thread-safe: request threads observe and read it concurrently.
"""

from __future__ import annotations

import threading

DECAY = 0.9
MIN_CORRECTION = 0.5
MAX_CORRECTION = 20.0


class TTFTCorrection:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._decayed_observed_s = 0.0
        self._decayed_model_s = 0.0

    def observe(self, observed_s: float, model_s: float) -> None:
        """One first token: `observed_s` after arrival, where the uncorrected model said `model_s`."""
        if not (observed_s > 0 and model_s > 0):
            return
        with self._lock:
            self._decayed_observed_s = DECAY * self._decayed_observed_s + observed_s
            self._decayed_model_s = DECAY * self._decayed_model_s + model_s

    @property
    def value(self) -> float:
        with self._lock:
            if self._decayed_model_s <= 0:
                return 1.0
            ratio = self._decayed_observed_s / self._decayed_model_s
        return min(max(ratio, MIN_CORRECTION), MAX_CORRECTION)
