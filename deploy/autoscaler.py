"""Desired replicas for a pool from its queue depth: one policy for the Ray launcher, and the meaning of
the thresholds given to KEDA / the HPA in the Helm chart.

    ratio    = load / (replicas * target_per_replica)        load: the pool's total queue metric
    desired  = ceil(load / target_per_replica)                 clamped to [min_replicas, max_replicas]
    no change while |ratio - 1| <= tolerance                  (the HPA's 10 % dead band)
    up:   at most scale_up_step replicas per decision, not within scale_up_cooldown_s of the last change up
    down: at most scale_down_step per decision, not within scale_down_cooldown_s of ANY last change

Queue metrics per pool (what `load` is; the chart's KEDA/HPA use the same names, per replica targets):
    prefill  prompt tokens/s computed (in flight) + duet_num_waiting_tokens{role="prefill"} / poll interval
             (the Ray launcher; KEDA/HPA use waiting tokens or duet_num_requests_waiting alone)
    decode   duet_num_requests_running{role="decode"} + duet_num_requests_waiting{role="decode"}
             (or duet_kv_cache_usage_perc{role="decode"} averaged, target e.g. 0.8)
KEDA's `threshold` / the HPA's `averageValue` is `target_per_replica`; its `pollingInterval` and
`stabilizationWindowSeconds` play the role of the cooldowns here; min/max replicas are the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class PoolPolicy:
    target_per_replica: float  # queue metric one replica should carry (e.g. 8192 waiting tokens, 32 running)
    min_replicas: int = 1
    max_replicas: int = 8
    scale_up_step: int = 4
    scale_down_step: int = 2
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 120.0
    tolerance: float = 0.1

    def __post_init__(self) -> None:
        if self.target_per_replica <= 0:
            raise ValueError(f"target_per_replica={self.target_per_replica} is invalid: must be > 0")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"min_replicas={self.min_replicas}, max_replicas={self.max_replicas} are invalid: "
                             "need 0 <= min <= max and max >= 1")
        if self.scale_up_step < 1 or self.scale_down_step < 1:
            raise ValueError("scale_up_step and scale_down_step must be >= 1")


@dataclass
class PoolState:
    replicas: int
    last_up_s: float = -math.inf
    last_down_s: float = -math.inf


class Decision(NamedTuple):
    replicas: int
    reason: str  # "hold", "tolerance", "up", "down", "cooldown", "clamp"


def decide(policy: PoolPolicy, state: PoolState, load: float, now_s: float) -> Decision:
    """The replica count for now; updates `state`'s cooldown clocks when it changes."""
    current = state.replicas
    want = min(max(math.ceil(load / policy.target_per_replica), policy.min_replicas), policy.max_replicas)
    if current < policy.min_replicas or current > policy.max_replicas:
        target = min(max(current, policy.min_replicas), policy.max_replicas)
        return _apply(state, target, now_s, "clamp")
    if want == current:
        return Decision(current, "hold")
    ratio = load / (current * policy.target_per_replica) if current else math.inf
    if abs(ratio - 1.0) <= policy.tolerance:
        return Decision(current, "tolerance")
    if want > current:
        if now_s - state.last_up_s < policy.scale_up_cooldown_s:
            return Decision(current, "cooldown")
        return _apply(state, min(want, current + policy.scale_up_step), now_s, "up")
    if now_s - max(state.last_up_s, state.last_down_s) < policy.scale_down_cooldown_s:
        return Decision(current, "cooldown")
    return _apply(state, max(want, current - policy.scale_down_step), now_s, "down")


def _apply(state: PoolState, replicas: int, now_s: float, reason: str) -> Decision:
    if replicas > state.replicas:
        state.last_up_s = now_s
    elif replicas < state.replicas:
        state.last_down_s = now_s
    state.replicas = replicas
    return Decision(replicas, reason)
