"""Open-loop arrival times: when each session of a run is sent, independent of when earlier ones finish."""

from __future__ import annotations

import math

import numpy as np


def poisson_arrivals_s(num_arrivals: int, rate_per_s: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process of `rate_per_s` (exponential gaps, mean 1 / rate), s after the run's start;
    the first arrives at 0. `rate_per_s` = inf: all at 0. Same arguments, same times."""
    if num_arrivals < 0:
        raise ValueError(f"num_arrivals={num_arrivals} is invalid: must be >= 0")
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s={rate_per_s} is invalid: must be > 0 (or inf)")
    if math.isinf(rate_per_s):
        return [0.0] * num_arrivals
    gaps_s = np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=max(num_arrivals - 1, 0))
    return [0.0, *np.cumsum(gaps_s).tolist()][:num_arrivals]
