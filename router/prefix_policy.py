"""The prefix-aware prefill choice: send a prompt to the worker that gives it the earliest first token.

Pure logic, no gRPC and no Redis: the router (and the trace-replay simulator) hand it one `WorkerState`
per prefill worker and get a `RouteDecision` back.

    estimated TTFT on worker w  =  fixed_s
                                +  queued_tokens(w) / speed(w)                       work ahead of it
                                +  (prompt_tokens - cached_tokens(w)) / speed(w)     its own uncached part

`speed` is the worker's measured prefill rate in tokens/s (calibrated from its own reports; a worker
that has not reported yet gets the median of the others, or `default_tokens_per_s`). Guardrail: a worker
whose queue already holds more than `busy_queue_s` of work is skipped unless every worker is that busy,
so a hot prefix cannot pile everything onto one worker. Ties (estimates within `tie_rel` of the best) go
to the worker with less queued work, then at random: never by list order.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerState:
    worker_id: str
    cached_tokens: int  # leading prompt tokens this worker holds in its prefix cache (from the index)
    queued_tokens: int  # prefill tokens waiting or running there (`work_ahead_tokens`)
    tokens_per_s: float | None = None  # measured prefill speed; None: not known yet


@dataclass(frozen=True)
class PolicyConfig:
    default_tokens_per_s: float = 20_000.0
    fixed_s: float = 0.002  # per-request overhead: RPCs, scheduling, first decode step
    busy_queue_s: float = 10.0  # guardrail: skip workers with more queued work than this (see RESULTS.md)
    tie_rel: float = 0.02  # estimates within 2 % of the best count as a tie


@dataclass(frozen=True)
class Estimate:
    worker_id: str
    cached_tokens: int
    queued_tokens: int
    tokens_per_s: float
    cost_s: float
    busy: bool


@dataclass(frozen=True)
class RouteDecision:
    worker_id: str
    branch: str  # "prefix": chosen for its cache; "load": no cache advantage; "guardrail": best was too busy
    estimates: list[Estimate] = field(default_factory=list)  # every worker, cheapest first


def fallback_tokens_per_s(speeds: Sequence[float | None], default_tokens_per_s: float) -> float:
    """The speed a worker that has not measured one is priced at: the median of the measured `speeds`, else the
    default."""
    known = [s for s in speeds if s]
    return statistics.median(known) if known else default_tokens_per_s


def work_ahead_tokens(inflight_tokens: int, reported_waiting_tokens: int, report_age_s: float,
                      tokens_per_s: float) -> float:
    """The prefill work ahead of a new request on a worker: this router's own tokens in flight there, or the
    worker's last load report drained at its speed for as long as the report is old, whichever is more. A report
    already counts this router's in-flight work, so adding the two would count it twice; it also tells of other
    routers' work, which only it shows."""
    return max(float(inflight_tokens), reported_waiting_tokens - report_age_s * tokens_per_s, 0.0)


def estimate(prompt_tokens: int, workers: Sequence[WorkerState], config: PolicyConfig) -> list[Estimate]:
    fallback = fallback_tokens_per_s([w.tokens_per_s for w in workers], config.default_tokens_per_s)
    out = []
    for w in workers:
        speed = w.tokens_per_s or fallback
        cached = min(w.cached_tokens, prompt_tokens)
        queue_s = w.queued_tokens / speed
        cost = config.fixed_s + queue_s + (prompt_tokens - cached) / speed
        out.append(Estimate(w.worker_id, cached, w.queued_tokens, speed, cost, queue_s > config.busy_queue_s))
    return out


def choose_prefill(
    prompt_tokens: int,
    workers: Sequence[WorkerState],
    config: PolicyConfig | None = None,
    rng: random.Random | None = None,
) -> RouteDecision:
    """The worker with the lowest estimated TTFT (see the module docstring); `workers` must not be empty."""
    if not workers:
        raise ValueError("workers is empty: need at least one prefill worker")
    config = config or PolicyConfig()
    rng = rng or random.Random()
    estimates = estimate(prompt_tokens, workers, config)
    ranked = sorted(estimates, key=lambda e: e.cost_s)
    allowed = [e for e in ranked if not e.busy] or ranked
    best_cost = allowed[0].cost_s
    tied = [e for e in allowed if e.cost_s <= best_cost * (1 + config.tie_rel)]
    least_queued = min(e.queued_tokens for e in tied)
    tied = [e for e in tied if e.queued_tokens == least_queued]
    choice = tied[rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
    if ranked[0].busy and choice is not ranked[0]:
        branch = "guardrail"
    elif choice.cached_tokens > min(e.cached_tokens for e in estimates):
        branch = "prefix"
    else:
        branch = "load"
    return RouteDecision(choice.worker_id, branch, ranked)
