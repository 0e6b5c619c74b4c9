"""TTFTCorrection: how far off admission's TTFT model has lately been, as observed / modelled time to first token,
a multiplier on the next predictions (router/admission_policy.py).

The model (queue and uncached prefill at the workers' reported speed, plus the KV transfer tail) leaves out what
it cannot see: CPU taken by other processes on the worker's host (a co-located decode engine, `duet up` on a
laptop), batching with other prompts, the router's own hops. Measured on a shared 2-core box, first tokens took
1.8x what the model said, and more under overload (benchmarks/RESULTS.md, SLO-aware admission). So each first
token of an admitted request feeds back its observed / modelled ratio, as NVIDIA Dynamo's SLA planner corrects
its TTFT predictions by observed / expected latency.

Only predictions made on a measured prefill speed teach it (the caller's part: `Admission.first_token`): while a
worker's speed is unknown the model runs on a default that may be off 10x, and a correction learnt then would
multiply the measured speed's predictions later (seen: 70 s predicted for 8 s observed). The sums decay with time,
half their weight every HALF_LIFE_S, so a correction learnt under one load fades under the next even when few
requests are admitted; the multiplier stays within [MIN_CORRECTION, MAX_CORRECTION], so one outlier (a worker
restarting) cannot make admission refuse everything or nothing; 1.0 with nothing observed.

Thread-safe: request threads observe and read it concurrently.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

HALF_LIFE_S = 20.0
MIN_CORRECTION = 0.5
MAX_CORRECTION = 5.0


class TTFTCorrection:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._decayed_observed_s = 0.0
        self._decayed_model_s = 0.0
        self._decayed_at_s = clock()

    def observe(self, observed_s: float, model_s: float) -> None:
        """One first token: `observed_s` after arrival, where the uncorrected model said `model_s`."""
        if not (observed_s > 0 and model_s > 0):
            return
        with self._lock:
            self._decay()
            self._decayed_observed_s += observed_s
            self._decayed_model_s += model_s

    @property
    def value(self) -> float:
        with self._lock:
            self._decay()
            if self._decayed_model_s <= 0:
                return 1.0
            ratio = self._decayed_observed_s / self._decayed_model_s
        return min(max(ratio, MIN_CORRECTION), MAX_CORRECTION)

    def _decay(self) -> None:
        now_s = self._clock()
        factor = 0.5 ** ((now_s - self._decayed_at_s) / HALF_LIFE_S)
        self._decayed_observed_s *= factor
        self._decayed_model_s *= factor
        self._decayed_at_s = now_s
