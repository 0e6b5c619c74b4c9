"""Prefill routing policies for trace replay: ours (`duet`, the real `router.prefix_policy` code) and the
baselines it is compared with. Each reads only what its real counterpart could know; the docstrings say what.

All randomness comes from a `random.Random(seed)` per policy, so a replay is deterministic.
"""

from __future__ import annotations

import hashlib
import math
import random
from bisect import bisect_right
from collections.abc import Sequence

from benchmarks.sim.trace_replay import ReplayConfig, ReplayResult, SimWorker, TraceRequest, simulate, simulate_oracle
from router.load_policy import Candidate, rank_prefill
from router.prefix_policy import PolicyConfig, WorkerState, choose_prefill


class DuetPolicy:
    """`router.prefix_policy.choose_prefill`, fed what the real router knows: each worker's exact cached
    prefix (the index learns it from the workers' KV events, plus the speculative entries of requests
    routed there), its queued tokens (the prefill worker's load report counts uncached work) and its speed.

    Switches (the `duet` policy turns on `speculative` and `uncached_queue`, as the router does; the
    variants in DUET_VARIANTS switch them off one at a time, for the ablation in benchmarks/RESULTS.md):
    `speculative`: a worker also counts as holding the blocks of the requests this router has sent it and
    not seen finish (the speculative index entries of ARCHITECTURE.md); `uncached_queue`: a worker's queued
    tokens count only the waiting requests' uncached parts (as far as its cache now tells);
    `config`: the policy's knobs (e.g. busy_queue_s=inf: no guardrail).
    """

    name = "duet"

    def __init__(self, seed: int = 0, config: PolicyConfig | None = None, speculative: bool = False,
                 uncached_queue: bool = False, name: str = "duet"):
        self.rng = random.Random(seed)
        self.config = config or PolicyConfig()
        self.speculative = speculative
        self.uncached_queue = uncached_queue
        self.name = name
        self.branches: dict[str, int] = {}  # decision branch -> count, for reports

    def cached_tokens(self, worker: SimWorker, request: TraceRequest) -> int:
        if not self.speculative:
            return worker.cached_prefix_tokens(request)
        sent = set().union(*(r.request.hash_ids for r in worker.inflight_records()))
        n = 0
        for h in request.hash_ids:
            if h not in sent and h not in worker.cache:
                break
            n += 1
        return request.prefix_tokens(n)

    def queued_tokens(self, worker: SimWorker) -> int:
        if not self.uncached_queue:
            return worker.queued_tokens()
        waiting_uncached = sum(r.request.prompt_tokens - worker.cached_prefix_tokens(r.request)
                               for r in worker.waiting)
        return worker.queued_tokens() - sum(r.request.prompt_tokens for r in worker.waiting) + waiting_uncached

    def choose(self, request: TraceRequest, workers: Sequence[SimWorker]) -> int:
        states = [WorkerState(w.worker_id, self.cached_tokens(w, request), self.queued_tokens(w), w.tokens_per_s)
                  for w in workers]
        decision = choose_prefill(request.prompt_tokens, states, self.config, self.rng)
        self.branches[decision.branch] = self.branches.get(decision.branch, 0) + 1
        return next(i for i, w in enumerate(workers) if w.worker_id == decision.worker_id)


class RoundRobin:
    """Workers in turn, 0, 1, 2, ...; reads nothing."""

    name = "round_robin"

    def __init__(self) -> None:
        self.next_index = 0

    def choose(self, request: TraceRequest, workers: Sequence[SimWorker]) -> int:
        index = self.next_index % len(workers)
        self.next_index = index + 1
        return index


class LeastLoaded:
    """The router's load-only ranking (`router.load_policy.rank_prefill`): fewest queued tokens, then fewest
    requests in flight, ties at random. Reads queued tokens and in-flight requests."""

    name = "least_loaded"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def choose(self, request: TraceRequest, workers: Sequence[SimWorker]) -> int:
        candidates = [Candidate(w.worker_id, num_waiting=len(w.waiting), num_running=int(w.running is not None),
                                num_free_blocks=0, num_waiting_tokens=w.queued_tokens()) for w in workers]
        best = rank_prefill(candidates, self.rng)[0]
        return next(i for i, w in enumerate(workers) if w.worker_id == best)


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class ConsistentHashBoundedLoad:
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

    The key is the prompt's first block id; each worker has `virtual_nodes` points on a 64-bit ring. A worker
    may hold at most ceil(load_factor * (in-flight requests + 1) / workers) requests in flight (queued or
    running, this one included); from the key's point, walk clockwise to the first worker under that bound.
    Reads in-flight requests only.
    """

    name = "consistent_hash"

    def __init__(self, num_workers: int, load_factor: float = 1.25, virtual_nodes: int = 100):
        if load_factor <= 1:
            raise ValueError(f"load_factor={load_factor} is invalid: must be > 1")
        self.load_factor = load_factor
        ring = sorted((_hash64(f"prefill-{i}#{v}"), i) for i in range(num_workers) for v in range(virtual_nodes))
        self._points = [p for p, _ in ring]
        self._owners = [i for _, i in ring]

    def capacity(self, workers: Sequence[SimWorker]) -> int:
        return math.ceil(self.load_factor * (sum(w.num_inflight for w in workers) + 1) / len(workers))

    def ring_order(self, key: int) -> list[int]:
        """Distinct workers clockwise from `key`'s point on the ring."""
        start = bisect_right(self._points, _hash64(str(key)))
        order: list[int] = []
        for k in range(len(self._owners)):
            owner = self._owners[(start + k) % len(self._owners)]
            if owner not in order:
                order.append(owner)
        return order

    def choose(self, request: TraceRequest, workers: Sequence[SimWorker]) -> int:
        capacity = self.capacity(workers)
        for index in self.ring_order(request.hash_ids[0]):
            if workers[index].num_inflight < capacity:
                return index
        raise AssertionError("bounded load: some worker is always under capacity")  # sum(load) < N * capacity


class SglangCacheAware:
    """Approximate cache-aware routing after the SGLang router's `cache_aware` policy.

    The router keeps, per worker, a tree of the prefixes it has routed there (never told what the worker
    evicted; the SGLang router's size-based tree eviction is off here: its default limit is far above this
    trace's tree sizes). Block ids are chained, so a worker's tree is exactly the set of block ids routed
    there, and a prompt's match is its run of leading blocks in that set. Load = requests in flight.

    1. imbalanced (max_load - min_load > balance_abs_threshold AND max_load > balance_rel_threshold * min_load):
       the least-loaded worker;
    2. else, if the best match ratio (matched tokens / prompt tokens) > cache_threshold: the best-matching
       worker;
    3. else the worker with the smallest tree (most spare cache).
    Ties at random. The chosen worker's tree gets the whole prompt, whatever the branch.
    """

    name = "sglang_cache_aware"

    def __init__(self, num_workers: int, seed: int = 0, cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5):
        self.rng = random.Random(seed)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.trees: list[set[int]] = [set() for _ in range(num_workers)]
        self.branches = {"balance": 0, "cache": 0, "smallest_tree": 0}

    def matched_blocks(self, index: int, request: TraceRequest) -> int:
        tree, n = self.trees[index], 0
        for h in request.hash_ids:
            if h not in tree:
                break
            n += 1
        return n

    def _pick(self, indices: list[int]) -> int:
        return indices[self.rng.randrange(len(indices))] if len(indices) > 1 else indices[0]

    def choose(self, request: TraceRequest, workers: Sequence[SimWorker]) -> int:
        loads = [w.num_inflight for w in workers]
        max_load, min_load = max(loads), min(loads)
        if max_load - min_load > self.balance_abs_threshold and max_load > self.balance_rel_threshold * min_load:
            branch, index = "balance", self._pick([i for i, x in enumerate(loads) if x == min_load])
        else:
            matched = [request.prefix_tokens(self.matched_blocks(i, request)) for i in range(len(workers))]
            best = max(matched)
            if best / request.prompt_tokens > self.cache_threshold:
                branch, index = "cache", self._pick([i for i, m in enumerate(matched) if m == best])
            else:
                smallest = min(len(t) for t in self.trees)
                branch, index = "smallest_tree", self._pick([i for i, t in enumerate(self.trees) if len(t) == smallest])
        self.branches[branch] += 1
        self.trees[index].update(request.hash_ids)
        return index


POLICY_NAMES = ("duet", "round_robin", "least_loaded", "consistent_hash", "sglang_cache_aware", "oracle")
# DuetPolicy variants for ablations: not in the default comparison, selectable by name (`--policies`).
# `duet` itself is what the router does: speculative entries for routed requests, queues counted in uncached
# tokens (the prefill worker's load report), the guardrail.
DUET_DEFAULT = {"speculative": True, "uncached_queue": True}
DUET_VARIANTS = {
    "duet_plain": {},  # the first version: finished prefills only, whole prompts as queued work
    "duet_speculative": {"speculative": True},
    "duet_uncached_queue": {"uncached_queue": True},
    "duet_no_guardrail": {**DUET_DEFAULT, "config": PolicyConfig(busy_queue_s=math.inf)},
}
ALL_POLICY_NAMES = (*POLICY_NAMES, *DUET_VARIANTS)


def make_policy(name: str, config: ReplayConfig):
    """A fresh policy by name (not `oracle`: that is a different cluster, see `simulate_oracle`)."""
    if name == "duet":
        return DuetPolicy(config.seed, **DUET_DEFAULT)
    if name in DUET_VARIANTS:
        return DuetPolicy(config.seed, name=name, **DUET_VARIANTS[name])
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded(config.seed)
    if name == "consistent_hash":
        return ConsistentHashBoundedLoad(config.workers)
    if name == "sglang_cache_aware":
        return SglangCacheAware(config.workers, config.seed)
    allowed = ", ".join(n for n in ALL_POLICY_NAMES if n != "oracle")
    raise ValueError(f"policy {name!r} is unknown: choose from {allowed}")


def compare_policies(requests: Sequence[TraceRequest], config: ReplayConfig,
                     names: Sequence[str] = POLICY_NAMES) -> list[ReplayResult]:
    """Replay the same requests under each named policy (each on fresh workers), in the order given."""
    return [simulate_oracle(requests, config) if name == "oracle" else
            simulate(requests, make_policy(name, config), config) for name in names]
