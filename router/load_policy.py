"""Load-only worker choice (the prefix-aware policy builds on it): no gRPC, no Redis, just numbers.

Loads in the registry are up to a heartbeat old, so the router adds what it has itself sent to a worker
since (`inflight`). Ties never fall to list order: they go to a random pick (a caller-supplied `rng`
makes that reproducible in tests).
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


def rank_prefill(candidates: Sequence[Candidate], rng: random.Random | None = None) -> list[str]:
    """Least queued prefill work first: waiting tokens, then requests in flight."""
    rng = rng or random
    keyed = [((c.num_waiting_tokens, c.inflight + c.num_waiting + c.num_running), rng.random(), c.worker_id)
             for c in candidates]
    return [worker_id for *_, worker_id in sorted(keyed)]


def rank_decode(candidates: Sequence[Candidate], rng: random.Random | None = None) -> list[str]:
    """Fewest running (incl. in flight) first, then most free KV blocks."""
    rng = rng or random
    keyed = [((c.num_running + c.num_waiting + c.inflight, -c.num_free_blocks), rng.random(), c.worker_id)
             for c in candidates]
    return [worker_id for *_, worker_id in sorted(keyed)]


def without(ranked: Sequence[str], excluded: Mapping[str, object]) -> list[str]:
    """Drop excluded workers, unless that leaves none (a suspect worker beats no worker)."""
    kept = [w for w in ranked if w not in excluded]
    return kept or list(ranked)
