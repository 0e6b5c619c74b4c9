"""Load-only worker choice (the prefix-aware policy builds on it): no gRPC, no Redis, just numbers.

Loads in the registry are up to a heartbeat old, so the router corrects a worker's reported requests by
what it has itself started and seen end there since the report was taken (`since_report`); a request of
this router's that ended after the report was counted by it, and is counted no more. Ties never fall to list
order: they go to a random pick (a caller-supplied `rng` makes that reproducible in tests).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_waiting_tokens: int
    inflight: int = 0  # requests this router sent there and has not seen finish
    since_report: int = 0  # requests this router started there minus those it saw end, since the load report

    def num_requests(self) -> int:
        """Requests on the worker now: its report (running + waiting), plus this router's starts and minus its
        ends since; at least this router's own in flight there."""
        return max(self.inflight, self.num_running + self.num_waiting + self.since_report)


def rank_prefill(candidates: Sequence[Candidate], rng: random.Random | None = None) -> list[str]:
    """Least queued prefill work first: waiting tokens, then requests in flight."""
    rng = rng or random
    keyed = [((c.num_waiting_tokens, c.num_requests()), rng.random(), c.worker_id)
             for c in candidates]
    return [worker_id for *_, worker_id in sorted(keyed)]


def rank_decode(candidates: Sequence[Candidate], rng: random.Random | None = None) -> list[str]:
    """Fewest requests (`Candidate.num_requests`) first, then most free KV blocks."""
    rng = rng or random
    keyed = [((c.num_requests(), -c.num_free_blocks), rng.random(), c.worker_id)
             for c in candidates]
    return [worker_id for *_, worker_id in sorted(keyed)]


def without(ranked: Sequence[str], excluded: Mapping[str, object]) -> list[str]:
    """Drop excluded workers, unless that leaves none (a suspect worker beats no worker)."""
    kept = [w for w in ranked if w not in excluded]
    return kept or list(ranked)
