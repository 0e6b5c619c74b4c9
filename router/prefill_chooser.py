"""Choosing the prefill worker for a prompt: hash it, ask the prefix index once, apply the policy.

    prompt ─▶ block hashes (engine.hashing, the workers' block size, root from model id + cache salt)
           ─▶ PrefixIndex.lookup: leading blocks each prefill (and decode) worker holds (ONE Redis round
              trip, `lookup`; the orchestrator ranks decode workers with the same answer)
           ─▶ prefix_policy.choose_prefill(cached tokens, queued work, measured speed)
           ─▶ speculative entry for the chosen worker (the next request with this prefix sees it at once),
              queued to router/speculative_writer.py: written off the request's path, so the decision itself
              costs one Redis round trip

If Redis cannot be reached the choice falls back to load only (branch "load_only"), logged once when it
goes down and once when it comes back, and `duet_router_index_available` says so; every request retries
the index, so routing returns to prefix-aware by itself. Replicas agree: nothing here depends on this
router's history except its own in-flight counts, and ties are broken by a generator seeded from the
prompt's hashes, so two routers over one Redis make the same choice for the same prompt and state.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis

from cluster.prefix_index import PrefixIndex
from cluster.registry import LiveWorker, WorkerInfo
from engine.hashing import hash_blocks, root_hash
from router.metrics import RouterMetrics
from router.prefix_policy import (
    PolicyConfig,
    RouteDecision,
    WorkerState,
    choose_prefill,
    fallback_tokens_per_s,
    work_ahead_tokens,
)
from router.speculative_writer import SpeculativeWriter

log = logging.getLogger("duet.router")


@dataclass(frozen=True)
class PrefixLookup:
    """One index round trip's answer for a prompt: its block hashes and the leading blocks each asked worker
    (prefill and decode alike) holds; `held` is None when Redis could not be reached (load-only routing)."""

    block_hashes: list[int]
    block_size: int
    held: dict[str, int] | None  # worker id -> leading blocks held (absent: none)
    lookup_s: float

    def cached_tokens(self, worker_id: str) -> int:
        return self.held.get(worker_id, 0) * self.block_size if self.held is not None else 0


@dataclass(frozen=True)
class PrefillChoice:
    worker: WorkerInfo
    decision: RouteDecision
    block_hashes: list[int]
    block_size: int
    index_available: bool
    lookup_s: float
    decision_s: float

    @property
    def predicted_cached_tokens(self) -> int:
        chosen = next(e for e in self.decision.estimates if e.worker_id == self.worker.worker_id)
        return chosen.cached_tokens


class PrefillChooser:
    def __init__(self, index: PrefixIndex, model_id: str, metrics: RouterMetrics, speculative: SpeculativeWriter,
                 policy: PolicyConfig | None = None):
        """`speculative`: the background writer that chosen workers' speculative entries are queued to."""
        self.index = index
        self.speculative = speculative
        self.model_id = model_id
        self.metrics = metrics
        self.policy = policy or PolicyConfig()
        self._index_down = False

    def lookup(self, prompt_token_ids: Sequence[int], cache_salt: str,
               workers: Sequence[LiveWorker]) -> PrefixLookup:
        """What each of `workers` (non-empty; one block size) holds of the prompt: ONE index round trip, shared
        by the decode choice and the prefill choice (`choose(..., lookup=)`)."""
        block_size = workers[0].info.block_size
        hashes = hash_blocks(prompt_token_ids, block_size, root_hash(self.model_id, cache_salt))
        held, lookup_s = self._lookup(hashes, [w.worker_id for w in workers])
        return PrefixLookup(hashes, block_size, held, lookup_s)

    def choose(
        self,
        prompt_token_ids: Sequence[int],
        cache_salt: str,
        prefills: Sequence[LiveWorker],
        inflight_tokens: Mapping[str, int],
        speculate: bool = True,
        lookup: PrefixLookup | None = None,
    ) -> PrefillChoice:
        """The prefill worker for this prompt (one index round trip, or none when given the `lookup` already
        made for it). With `speculate`, the chosen worker is also queued to hold the prompt's blocks
        speculatively (written in the background, see the module docstring); ExplainRoute passes False,
        since it sends nothing."""
        start_s = time.perf_counter()
        if lookup is None:
            lookup = self.lookup(prompt_token_ids, cache_salt, prefills)
        hashes, held, lookup_s, block_size = lookup.block_hashes, lookup.held, lookup.lookup_s, lookup.block_size
        fallback = fallback_tokens_per_s([w.load.prefill_tokens_per_s for w in prefills],
                                         self.policy.default_tokens_per_s)
        states = [
            WorkerState(
                worker_id=w.worker_id,
                cached_tokens=lookup.cached_tokens(w.worker_id),
                queued_tokens=round(work_ahead_tokens(inflight_tokens.get(w.worker_id, 0), w.load.num_waiting_tokens,
                                                      w.load_age_s, w.load.prefill_tokens_per_s or fallback)),
                tokens_per_s=w.load.prefill_tokens_per_s or None,
            )
            for w in prefills
        ]
        rng = random.Random(hashes[-1] if hashes else len(prompt_token_ids))  # replicas break ties alike
        decision = choose_prefill(len(prompt_token_ids), states, self.policy, rng)
        if held is None:
            decision = RouteDecision(decision.worker_id, "load_only", decision.estimates)
        worker = next(w.info for w in prefills if w.worker_id == decision.worker_id)
        if speculate and held is not None and hashes:
            self.speculative.submit(worker.worker_id, hashes)
        decision_s = time.perf_counter() - start_s
        self.metrics.routing_decided(decision.branch, decision_s)
        return PrefillChoice(worker, decision, hashes, block_size, held is not None, lookup_s, decision_s)

    def _lookup(self, hashes: list[int], worker_ids: list[str]) -> tuple[dict[str, int] | None, float]:
        start_s = time.perf_counter()
        try:
            held = self.index.lookup(hashes, worker_ids)
        except (redis.RedisError, OSError) as e:
            if not self._index_down:
                log.warning("router event=index_down routing=load_only error=%s", e)
                self._index_down = True
            self.metrics.index_available.set(0)
            return None, time.perf_counter() - start_s
        lookup_s = time.perf_counter() - start_s
        if self._index_down:
            log.warning("router event=index_up routing=prefix_aware")
            self._index_down = False
        self.metrics.index_available.set(1)
        self.metrics.lookup_s.observe(lookup_s)
        return held, lookup_s
