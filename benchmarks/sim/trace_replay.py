"""Trace replay: Mooncake-format requests through a routing policy, against simulated prefill workers.

What the simulator assumes (and nothing more):

- A **block** is one `hash_ids` entry of the trace (512 tokens; the last block of a prompt may be partial).
  Ids are chained, so a block id stands for the whole prefix up to it: a worker's cached prefix for a
  prompt is the run of its leading blocks that the worker holds.
- Each **worker** runs one prefill at a time, FCFS, no batching. A prefill takes
  `fixed_s + uncached_tokens / tokens_per_s`: linear in the uncached tokens (real attention cost grows with
  context, and cached tokens are not free either), fixed overhead first.
- Each worker's **cache** is an LRU of `cache_blocks` blocks (None: infinite). When a prefill *starts*, its
  leading cached blocks are looked up and touched; when it *finishes*, all its blocks are stored (touched or
  inserted) last block first, so the prompt's head ends most recently used and eviction takes tails before
  heads (vLLM frees a request's blocks in reverse for the same reason). Only finished prefills are visible
  to policies: that is what the workers' KV events tell the real router.
- TTFT = prefill finish - arrival (queueing + prefill; KV transfer and decode are not simulated).
- Load imbalance = max / mean of the workers' total prefill busy time.

Policies see `SimWorker`s advanced to the arrival time and may read only what their real counterpart
could know (each policy's docstring says what it reads). See `benchmarks/sim/baseline_policies.py`.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

TRACE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the file, line number and field."""


@dataclass(frozen=True)
class TraceRequest:
    request_index: int  # position in the trace (0-based)
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    block_tokens: int = TRACE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        assert len(self.hash_ids) == math.ceil(self.prompt_tokens / self.block_tokens), self

    def prefix_tokens(self, num_blocks: int) -> int:
        """Tokens in the first `num_blocks` blocks (the last block may be partial)."""
        return min(num_blocks * self.block_tokens, self.prompt_tokens)


def _field(obj: dict, name: str, kind: type | tuple[type, ...], where: str):
    if name not in obj:
        raise TraceError(f"{where}: missing field '{name}'")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TraceError(f"{where}: field '{name}' = {value!r} has type {type(value).__name__}, expected {kind}")
    return value


def parse_trace_line(line: str, where: str, request_index: int, block_tokens: int = TRACE_BLOCK_TOKENS,
                     time_scale: float = 1.0) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    timestamp_ms = _field(obj, "timestamp", (int, float), where)
    prompt_tokens = _field(obj, "input_length", int, where)
    output_tokens = _field(obj, "output_length", int, where)
    hash_ids = _field(obj, "hash_ids", list, where)
    if not math.isfinite(timestamp_ms) or timestamp_ms < 0:
        raise TraceError(f"{where}: field 'timestamp' = {timestamp_ms!r} must be a finite number >= 0 (ms)")
    if prompt_tokens < 1:
        raise TraceError(f"{where}: field 'input_length' = {prompt_tokens} must be >= 1")
    if output_tokens < 0:
        raise TraceError(f"{where}: field 'output_length' = {output_tokens} must be >= 0")
    for i, h in enumerate(hash_ids):
        if isinstance(h, bool) or not isinstance(h, int):
            raise TraceError(f"{where}: field 'hash_ids'[{i}] = {h!r} is not an integer")
    want = math.ceil(prompt_tokens / block_tokens)
    if len(hash_ids) != want:
        raise TraceError(f"{where}: field 'hash_ids' has {len(hash_ids)} ids, expected {want} "
                         f"(= ceil(input_length {prompt_tokens} / {block_tokens} tokens per block))")
    return TraceRequest(request_index, timestamp_ms / 1000 * time_scale, prompt_tokens, output_tokens,
                        tuple(hash_ids), block_tokens)


def load_trace(path: str | Path, limit: int | None = None, time_scale: float = 1.0,
               block_tokens: int = TRACE_BLOCK_TOKENS) -> list[TraceRequest]:
    """Requests in arrival order (stable for equal timestamps); arrival_s = timestamp_ms / 1000 * time_scale.

    Blank lines are skipped; any other bad line raises `TraceError` naming it. `limit`: first N requests.
    """
    if time_scale <= 0 or not math.isfinite(time_scale):
        raise ValueError(f"time_scale={time_scale} is invalid: must be a finite number > 0")
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} is invalid: must be >= 1")
    requests: list[TraceRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            requests.append(parse_trace_line(line, f"{path} line {lineno}", len(requests), block_tokens, time_scale))
            if limit is not None and len(requests) >= limit:
                break
    if not requests:
        raise TraceError(f"{path}: no requests in the trace")
    return sorted(requests, key=lambda r: r.arrival_s)


class BlockCache:
    """An LRU set of block ids, at most `capacity_blocks` of them (None: unbounded)."""

    def __init__(self, capacity_blocks: int | None):
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"capacity_blocks={capacity_blocks} is invalid: must be >= 1 (or None: unbounded)")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.num_evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._lru

    def blocks_lru_first(self) -> list[int]:
        return list(self._lru)

    def peek_prefix_blocks(self, hash_ids: Sequence[int]) -> int:
        """How many leading blocks of `hash_ids` are cached; changes nothing."""
        n = 0
        for h in hash_ids:
            if h not in self._lru:
                break
            n += 1
        return n

    def touch_prefix_blocks(self, hash_ids: Sequence[int]) -> int:
        """Like `peek_prefix_blocks`, and marks the hit blocks used (head most recent)."""
        n = self.peek_prefix_blocks(hash_ids)
        for h in reversed(hash_ids[:n]):
            self._lru.move_to_end(h)
        return n

    def store(self, hash_ids: Sequence[int]) -> None:
        """Touch or insert every block, last block first, then evict least recently used beyond capacity."""
        for h in reversed(hash_ids):
            self._lru[h] = None
            self._lru.move_to_end(h)
        if self.capacity_blocks is not None:
            while len(self._lru) > self.capacity_blocks:
                self._lru.popitem(last=False)
                self.num_evicted_blocks += 1

    def check_integrity(self) -> None:
        assert self.capacity_blocks is None or len(self._lru) <= self.capacity_blocks, (len(self), self.capacity_blocks)


@dataclass
class RequestRecord:
    request: TraceRequest
    worker_index: int
    start_s: float = math.nan
    finish_s: float = math.nan
    cached_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.finish_s - self.request.arrival_s


class SimWorker:
    """One prefill worker: FCFS queue, one prefill at a time, an LRU block cache.

    Policies may read: `cached_prefix_tokens(request)` (what the worker's KV events report: finished
    prefills only), `queued_tokens()` (its load report), `num_inflight` and `inflight_records()` (requests sent there,
    not finished: the router knows them),
    `index`, `worker_id`, `tokens_per_s`. Everything else is the simulator's.
    """

    def __init__(self, index: int, cache: BlockCache, tokens_per_s: float, fixed_s: float):
        if tokens_per_s <= 0:
            raise ValueError(f"tokens_per_s={tokens_per_s} is invalid: must be > 0")
        self.index = index
        self.worker_id = f"prefill-{index}"
        self.cache = cache
        self.tokens_per_s = tokens_per_s
        self.fixed_s = fixed_s
        self.now_s = 0.0
        self.waiting: deque[RequestRecord] = deque()
        self.running: RequestRecord | None = None
        self.busy_s = 0.0  # total prefill time so far
        self.computed_tokens = 0

    @property
    def num_inflight(self) -> int:
        return len(self.waiting) + (self.running is not None)

    def inflight_records(self) -> list[RequestRecord]:
        """Requests sent here and not finished (the router's own in-flight table), oldest first."""
        return ([self.running] if self.running is not None else []) + list(self.waiting)

    def cached_prefix_tokens(self, request: TraceRequest) -> int:
        return request.prefix_tokens(self.cache.peek_prefix_blocks(request.hash_ids))

    def queued_tokens(self) -> int:
        """Prefill tokens not yet computed, as a worker reports them: full prompts of the waiting requests
        (their cache hit is only known when they start) plus what is left of the running one."""
        waiting = sum(r.request.prompt_tokens for r in self.waiting)
        if self.running is None:
            return waiting
        left_s = self.running.finish_s - self.now_s
        uncached = self.running.request.prompt_tokens - self.running.cached_tokens
        return waiting + min(uncached, max(0, math.ceil(left_s * self.tokens_per_s)))

    def submit(self, record: RequestRecord) -> None:
        self.waiting.append(record)
        if self.running is None:
            self._start_next(self.now_s)

    def advance(self, now_s: float) -> list[RequestRecord]:
        """Run the worker up to `now_s` (prefills finishing at exactly `now_s` included); the finished."""
        assert now_s >= self.now_s, (now_s, self.now_s)
        done = []
        while self.running is not None and self.running.finish_s <= now_s:
            finished = self.running
            self.cache.store(finished.request.hash_ids)
            done.append(finished)
            self.running = None
            self._start_next(finished.finish_s)
        self.now_s = now_s
        return done

    def _start_next(self, start_s: float) -> None:
        if not self.waiting:
            return
        record = self.waiting.popleft()
        request = record.request
        record.start_s = start_s
        record.cached_tokens = request.prefix_tokens(self.cache.touch_prefix_blocks(request.hash_ids))
        uncached = request.prompt_tokens - record.cached_tokens
        duration_s = self.fixed_s + uncached / self.tokens_per_s
        record.finish_s = start_s + duration_s
        self.busy_s += duration_s
        self.computed_tokens += uncached
        self.running = record


class Policy(Protocol):
    name: str

    def choose(self, request: TraceRequest, workers: Sequence[SimWorker]) -> int:
        """Index into `workers` (all advanced to `request.arrival_s`) of the worker that gets `request`."""
        ...


@dataclass(frozen=True)
class ReplayConfig:
    workers: int = 8
    cache_blocks: int | None = 1000  # per worker, in trace blocks; None: unbounded
    tokens_per_s: float = 10_000.0  # simulated prefill speed of one worker (uncached tokens)
    fixed_s: float = 0.002  # per-prefill overhead (= PolicyConfig.fixed_s)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers={self.workers} is invalid: must be >= 1")
        if self.cache_blocks is not None and self.cache_blocks < 1:
            raise ValueError(f"cache_blocks={self.cache_blocks} is invalid: must be >= 1")
        if not self.tokens_per_s > 0:
            raise ValueError(f"tokens_per_s={self.tokens_per_s} is invalid: must be > 0")
        if not self.fixed_s >= 0:
            raise ValueError(f"fixed_s={self.fixed_s} is invalid: must be >= 0")


@dataclass
class ReplayResult:
    policy: str
    records: list[RequestRecord]
    busy_s: list[float]  # per worker
    computed_tokens: list[int]  # per worker
    evicted_blocks: list[int] = field(default_factory=list)  # per worker

    @property
    def token_hit_rate(self) -> float:
        return sum(r.cached_tokens for r in self.records) / sum(r.request.prompt_tokens for r in self.records)

    def ttft_percentile_s(self, q: float) -> float:
        return percentile([r.ttft_s for r in self.records], q)

    @property
    def ttft_mean_s(self) -> float:
        return sum(r.ttft_s for r in self.records) / len(self.records)

    @property
    def imbalance(self) -> float:
        """max / mean of per-worker busy time (1.0: perfectly even)."""
        mean = sum(self.busy_s) / len(self.busy_s)
        return max(self.busy_s) / mean if mean > 0 else 1.0

    def summary(self) -> dict[str, float | str]:
        """The `--json` object: exactly these keys."""
        return {
            "policy": self.policy,
            "token_hit_rate": round(self.token_hit_rate, 4),
            "ttft_mean_s": round(self.ttft_mean_s, 4),
            "ttft_p90_s": round(self.ttft_percentile_s(90), 4),
            "ttft_p99_s": round(self.ttft_percentile_s(99), 4),
            "imbalance": round(self.imbalance, 4),
        }


def percentile(values: Iterable[float], q: float) -> float:
    """q-th percentile, linear interpolation between closest ranks (numpy's default method)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def simulate(requests: Sequence[TraceRequest], policy: Policy, config: ReplayConfig) -> ReplayResult:
    """Replay `requests` (sorted by arrival) through `policy` on `config.workers` fresh workers."""
    workers = [SimWorker(i, BlockCache(config.cache_blocks), config.tokens_per_s, config.fixed_s)
               for i in range(config.workers)]
    records = []
    for request in requests:
        for w in workers:
            w.advance(request.arrival_s)
        index = policy.choose(request, workers)
        if not 0 <= index < len(workers):
            raise ValueError(f"policy {policy.name} chose worker {index}: must be in [0, {len(workers)})")
        record = RequestRecord(request, index)
        workers[index].submit(record)
        records.append(record)
    for w in workers:
        w.advance(math.inf)
        w.cache.check_integrity()
        assert w.num_inflight == 0
    return ReplayResult(policy.name, records, [w.busy_s for w in workers], [w.computed_tokens for w in workers],
                        [w.cache.num_evicted_blocks for w in workers])


class _OnlyWorker:
    name = "oracle"

    def choose(self, request: TraceRequest, workers: Sequence[SimWorker]) -> int:
        return 0


def simulate_oracle(requests: Sequence[TraceRequest], config: ReplayConfig) -> ReplayResult:
    """The bound of one infinite cache: a single worker with an unbounded cache and the whole cluster's speed
    (`workers * tokens_per_s`, same `fixed_s`), FCFS. Its hit rate is the trace's ideal hit rate; its TTFT is
    what perfect sharing of cache and compute would give (queueing included)."""
    single = replace(config, workers=1, cache_blocks=None, tokens_per_s=config.tokens_per_s * config.workers)
    return simulate(requests, _OnlyWorker(), single)


def offered_load(requests: Sequence[TraceRequest], config: ReplayConfig) -> float:
    """Prefill work with no cache hits / cluster capacity over the trace's span (>1: overloaded even then)."""
    span_s = requests[-1].arrival_s - requests[0].arrival_s
    if span_s <= 0:
        return math.inf
    return sum(r.prompt_tokens for r in requests) / (span_s * config.workers * config.tokens_per_s)
