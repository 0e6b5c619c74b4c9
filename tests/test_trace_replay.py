"""Trace replay: exact simulator arithmetic on hand-made traces, exact LRU order, each policy's choice in
small scenarios, and the real Mooncake trace's headline facts."""

import json
import math
from pathlib import Path

import pytest
from conftest import shared_trace_path

from benchmarks.sim.baseline_policies import (
    POLICY_NAMES,
    ConsistentHashBoundedLoad,
    DuetPolicy,
    LeastLoaded,
    RoundRobin,
    SglangCacheAware,
    compare_policies,
    make_policy,
)
from benchmarks.sim.trace_replay import (
    BlockCache,
    ReplayConfig,
    RequestRecord,
    SimWorker,
    TraceError,
    TraceRequest,
    load_trace,
    percentile,
    simulate,
    simulate_oracle,
)
from duet.cli_bench import main as bench_main

TRACE = shared_trace_path()
JSON_KEYS = ["policy", "token_hit_rate", "ttft_mean_s", "ttft_p90_s", "ttft_p99_s", "imbalance"]


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def req(index: int, arrival_s: float, prompt_tokens: int, hash_ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(index, arrival_s, prompt_tokens, 1, hash_ids)


class Fixed:
    """Sends request i to worker `choices[i]`."""

    name = "fixed"

    def __init__(self, choices):
        self.choices = list(choices)

    def choose(self, request, workers):
        return self.choices[request.request_index]


# -- trace loading ---------------------------------------------------------------------------------------


def test_load_trace_scales_time_and_keeps_fields(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 1500, "input_length": 600, "output_length": 7, "hash_ids": [4, 5]},
        {"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [4]},
    ])
    requests = load_trace(path, time_scale=0.5)
    assert [(r.request_index, r.arrival_s, r.prompt_tokens, r.output_tokens, r.hash_ids) for r in requests] == [
        (1, 0.0, 512, 1, (4,)), (0, 0.75, 600, 7, (4, 5))]
    assert requests[1].prefix_tokens(1) == 512 and requests[1].prefix_tokens(2) == 600  # last block: 88 tokens
    assert len(load_trace(path, limit=1)) == 1


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "line 2: missing field 'hash_ids'"),
    ('{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}',
     "line 2: field 'hash_ids' has 2 ids, expected 3"),
    ('{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [1]}',
     "line 2: field 'input_length' = '10' has type str"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
     "line 2: field 'timestamp' = -1 must be"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [true]}',
     "line 2: field 'hash_ids'[0] = True is not an integer"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
     "line 2: field 'input_length' = 0 must be >= 1"),
    ("not json", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: expected a JSON object, got list"),
])
def test_load_trace_names_the_bad_line_and_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError) as e:
        load_trace(path)
    assert str(e.value).startswith(f"{path} line 2: ") and message in str(e.value)


# -- the cache -------------------------------------------------------------------------------------------


def test_lru_stores_tail_first_and_evicts_least_recently_used():
    cache = BlockCache(3)
    cache.store([1, 2])
    assert cache.blocks_lru_first() == [2, 1]  # the head of a prompt is the most recently used
    cache.store([3, 4])
    assert cache.blocks_lru_first() == [1, 4, 3] and cache.num_evicted_blocks == 1  # 2 went
    assert cache.peek_prefix_blocks([1, 5]) == 1 and cache.blocks_lru_first() == [1, 4, 3]  # peek changes nothing
    assert cache.touch_prefix_blocks([1, 5]) == 1 and cache.blocks_lru_first() == [4, 3, 1]
    cache.store([6])
    assert cache.blocks_lru_first() == [3, 1, 6]
    assert cache.peek_prefix_blocks([3, 1, 6]) == 3 and cache.peek_prefix_blocks([1, 3]) == 2
    cache.check_integrity()


def test_lru_prompt_longer_than_the_cache_keeps_its_head():
    cache = BlockCache(2)
    cache.store([1, 2, 3])
    assert cache.blocks_lru_first() == [2, 1] and cache.num_evicted_blocks == 1


def test_unbounded_cache_never_evicts():
    cache = BlockCache(None)
    cache.store(range(10_000))
    assert len(cache) == 10_000 and cache.num_evicted_blocks == 0
    with pytest.raises(ValueError, match="capacity_blocks=0 is invalid"):
        BlockCache(0)


# -- the simulator ---------------------------------------------------------------------------------------


def test_shared_prefix_on_one_worker_exact_hits_and_ttft_with_queueing():
    # 512 tokens/s: one block costs 1 s; 0.25 s fixed overhead per prefill.
    config = ReplayConfig(workers=1, cache_blocks=None, tokens_per_s=512, fixed_s=0.25)
    r0 = req(0, 0.0, 2048, (1, 2, 3, 4))
    r1 = req(1, 1.0, 1636, (1, 2, 3, 9))  # shares 3 blocks; its last block holds 100 tokens
    result = simulate([r0, r1], Fixed([0, 0]), config)
    a, b = result.records
    assert (a.start_s, a.finish_s, a.cached_tokens) == (0.0, 4.25, 0)
    assert (b.start_s, b.cached_tokens) == (4.25, 1536)  # waited for r0, then found its 3 blocks
    assert b.finish_s == 4.25 + 0.25 + 100 / 512
    assert [a.ttft_s, b.ttft_s] == [4.25, 4.25 + 0.25 + 100 / 512 - 1.0]
    assert result.token_hit_rate == 1536 / (2048 + 1636)
    assert result.busy_s == [4.25 + 0.25 + 100 / 512]
    assert result.ttft_mean_s == (a.ttft_s + b.ttft_s) / 2 and result.imbalance == 1.0


def test_running_prefill_is_not_cached_yet_and_partial_last_block_hits_whole():
    config = ReplayConfig(workers=2, cache_blocks=None, tokens_per_s=512, fixed_s=0.0)
    requests = [req(0, 0.0, 600, (1, 2)), req(1, 0.5, 600, (1, 2)), req(2, 2.0, 600, (1, 2))]
    result = simulate(requests, Fixed([0, 1, 0]), config)
    # r1 ran on the other worker: no hit. r2 arrives after r0 finished (600/512 s): whole prompt cached.
    assert [r.cached_tokens for r in result.records] == [0, 0, 600]
    assert [r.ttft_s for r in result.records] == [600 / 512, 600 / 512, 0.0]
    assert result.busy_s == [600 / 512, 600 / 512] and result.imbalance == 1.0


def test_eviction_removes_hits_and_finish_at_arrival_counts_as_done():
    config = ReplayConfig(workers=1, cache_blocks=2, tokens_per_s=512, fixed_s=0.0)
    requests = [req(0, 0.0, 1024, (1, 2)), req(1, 2.0, 1024, (3, 4)), req(2, 4.0, 1024, (1, 2)),
                req(3, 6.0, 1024, (1, 2))]
    result = simulate(requests, Fixed([0, 0, 0, 0]), config)
    # r1 evicted r0's blocks; r2 recomputes them (finishing at exactly r3's arrival), r3 hits both.
    assert [r.cached_tokens for r in result.records] == [0, 0, 0, 1024]
    assert [r.start_s for r in result.records] == [0.0, 2.0, 4.0, 6.0]
    assert result.evicted_blocks == [4]


def test_queued_tokens_is_waiting_prompts_plus_what_is_left_of_the_running_one():
    worker = SimWorker(0, BlockCache(None), tokens_per_s=512, fixed_s=0.0)
    worker.cache.store([1])
    worker.submit(RequestRecord(req(0, 0.0, 1536, (1, 2, 3)), 0))  # 512 cached: 2 s of work
    worker.submit(RequestRecord(req(1, 0.0, 700, (7, 8)), 0))
    worker.advance(0.5)
    assert worker.num_inflight == 2 and worker.queued_tokens() == 700 + 768
    assert worker.cached_prefix_tokens(req(2, 0.5, 1024, (1, 9))) == 512


def test_percentile_interpolates_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
    assert percentile(range(101), 90) == 90 and percentile([0, 10], 99) == pytest.approx(9.9)


# -- policies --------------------------------------------------------------------------------------------


def workers_with(n, inflight=(), cached=(), tokens_per_s=512.0):
    """`n` idle workers; worker i gets inflight[i] queued requests (1 block each, ids unique) and cached[i] stored."""
    workers = [SimWorker(i, BlockCache(None), tokens_per_s, 0.0) for i in range(n)]
    next_id = 1_000_000
    for i, count in enumerate(inflight):
        for _ in range(count):
            workers[i].submit(RequestRecord(req(0, 0.0, 512, (next_id,)), i))
            next_id += 1
    for i, blocks in enumerate(cached):
        workers[i].cache.store(blocks)
    return workers


def test_round_robin_goes_in_turn():
    policy, workers = RoundRobin(), workers_with(3)
    assert [policy.choose(req(i, 0.0, 512, (i,)), workers) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_picks_fewest_queued_tokens_then_random_among_ties():
    workers = workers_with(3, inflight=(2, 1, 1))
    workers[2].submit(RequestRecord(req(0, 0.0, 100, (99,)), 2))  # worker 2: 612 tokens, worker 1: 512
    assert LeastLoaded(seed=0).choose(req(9, 0.0, 512, (9,)), workers) == 1
    idle = workers_with(4)
    picks = {LeastLoaded(seed=s).choose(req(9, 0.0, 512, (9,)), idle) for s in range(20)}
    assert picks == {0, 1, 2, 3}  # ties never go by list order


def test_consistent_hash_sticks_to_the_key_and_respects_the_load_bound():
    policy = ConsistentHashBoundedLoad(3)
    order = policy.ring_order(42)
    assert sorted(order) == [0, 1, 2]
    r = req(0, 0.0, 1024, (42, 7))
    assert policy.choose(r, workers_with(3)) == order[0]
    # first choice holds 2 of 2 in flight: bound = ceil(1.25 * 3 / 3) = 2, so it is full: next on the ring
    inflight = [0, 0, 0]
    inflight[order[0]] = 2
    workers = workers_with(3, inflight=inflight)
    assert policy.capacity(workers) == 2 and policy.choose(r, workers) == order[1]
    inflight[order[1]] = 2  # total 4: bound = ceil(1.25 * 5 / 3) = 3: the first choice has room again
    assert policy.choose(r, workers_with(3, inflight=inflight)) == order[0]


def test_consistent_hash_never_exceeds_the_bound_on_the_real_trace():
    requests = load_trace(TRACE, limit=400, time_scale=0.2)
    inner = ConsistentHashBoundedLoad(4)

    class Checked:
        name = "checked"

        def choose(self, request, workers):
            index = inner.choose(request, workers)
            assert workers[index].num_inflight < inner.capacity(workers)
            return index

    simulate(requests, Checked(), ReplayConfig(workers=4))


def test_sglang_routes_to_best_match_above_threshold_else_smallest_tree():
    policy = SglangCacheAware(3, seed=0)
    policy.trees[0].update({1, 2, 3, 50, 51, 52, 53})
    policy.trees[1].update({10, 11})
    workers = workers_with(3)
    assert policy.choose(req(0, 0.0, 2048, (1, 2, 3, 4)), workers) == 0  # 3/4 matched > 0.3
    assert policy.branches["cache"] == 1 and {1, 2, 3, 4} <= policy.trees[0]
    assert policy.choose(req(1, 0.0, 2048, (10, 12, 13, 14)), workers) == 2  # 1/4 = 0.25 <= 0.3: smallest
    assert policy.branches["smallest_tree"] == 1 and policy.trees[2] == {10, 12, 13, 14}
    assert policy.choose(req(2, 0.0, 2048, (20, 21, 22, 23)), workers) == 1  # no match: tree sizes 8, 2, 4


def test_sglang_balances_only_when_both_thresholds_are_exceeded():
    policy = SglangCacheAware(2, seed=0)
    policy.trees[0].update({1, 2})
    request = req(0, 0.0, 1024, (1, 2))
    assert policy.choose(request, workers_with(2, inflight=(70, 0))) == 1  # 70 - 0 > 64 and 70 > 1.5 * 0
    assert policy.branches["balance"] == 1 and policy.trees[1] == {1, 2}  # the tree learns in every branch
    policy = SglangCacheAware(2, seed=0)
    policy.trees[0].update({1, 2})
    assert policy.choose(request, workers_with(2, inflight=(70, 10))) == 0  # 60 <= 64: not imbalanced
    assert policy.choose(request, workers_with(2, inflight=(200, 140))) == 0  # 200 <= 1.5 * 140
    assert policy.branches == {"balance": 0, "cache": 2, "smallest_tree": 0}


def test_duet_takes_the_cached_worker_unless_its_queue_costs_more():
    r = req(0, 0.0, 4096, tuple(range(8)))  # 8 s of work at 512 tokens/s; worker 1 holds 6 blocks of it
    policy = DuetPolicy(seed=0)
    assert policy.choose(r, workers_with(3, cached=((), tuple(range(6))))) == 1
    # 2 queued requests of 512 tokens on worker 1: 2 s queued + 2 s uncached < 8 s elsewhere
    assert policy.choose(r, workers_with(3, inflight=(0, 2), cached=((), tuple(range(6))))) == 1
    assert policy.branches == {"prefix": 2}
    # ...but 7 queued: 7 s + 2 s > 8 s
    assert DuetPolicy(seed=0).choose(r, workers_with(2, inflight=(0, 7), cached=((), tuple(range(6))))) == 0


def test_make_policy_rejects_unknown_names():
    with pytest.raises(ValueError, match="policy 'nope' is unknown"):
        make_policy("nope", ReplayConfig())


# -- the real trace --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_trace():
    return load_trace(TRACE)


def test_oracle_hit_rate_on_the_real_trace_is_the_readme_figure(real_trace):
    assert len(real_trace) == 3993
    oracle = simulate_oracle(real_trace, ReplayConfig(workers=8))
    assert oracle.token_hit_rate == pytest.approx(0.64, abs=0.02)
    assert oracle.imbalance == 1.0


def test_duet_hits_at_least_as_often_as_round_robin_with_8_workers(real_trace):
    duet, rr = compare_policies(real_trace, ReplayConfig(workers=8), names=("duet", "round_robin"))
    assert duet.token_hit_rate >= rr.token_hit_rate


def test_replay_is_deterministic_for_a_seed(real_trace):
    config = ReplayConfig(workers=4, cache_blocks=200, seed=3)
    runs = [[r.summary() for r in compare_policies(real_trace[:300], config)] for _ in range(2)]
    assert runs[0] == runs[1]


# -- the command -----------------------------------------------------------------------------------------


def test_bench_route_json_prints_one_object_per_policy(capsys):
    assert bench_main(["bench", "route", str(TRACE), "--limit", "200", "--workers", "4", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(POLICY_NAMES) == 6
    rows = [json.loads(line) for line in lines]
    assert [list(r) for r in rows] == [JSON_KEYS] * 6
    assert [r["policy"] for r in rows] == ["duet", "round_robin", "least_loaded", "consistent_hash",
                                           "sglang_cache_aware", "oracle"]
    assert all(0 <= r["token_hit_rate"] <= 1 and r["imbalance"] >= 1 and math.isfinite(r["ttft_p99_s"])
               for r in rows)


def test_bench_route_table_and_errors(capsys, tmp_path):
    assert bench_main(["bench", "route", str(TRACE), "--limit", "100", "--cache-blocks", "inf",
                       "--policies", "duet,oracle"]) == 0
    out = capsys.readouterr().out
    assert "workers=8 cache_blocks=None" in out and "offered_load_no_cache=" in out
    assert "| duet |" in out and "| oracle |" in out and "| round_robin |" not in out
    assert bench_main(["bench", "route", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    bad = write_trace(tmp_path / "bad.jsonl", [{"timestamp": 0, "input_length": 600, "output_length": 1,
                                                "hash_ids": [1]}])
    assert bench_main(["bench", "route", str(bad)]) == 2
    assert "bad.jsonl line 1: field 'hash_ids' has 1 ids, expected 2" in capsys.readouterr().err
    assert bench_main(["bench", "route", str(TRACE), "--policies", "duet,nope"]) == 2
    with pytest.raises(SystemExit):
        bench_main(["bench", "route", str(TRACE), "--cache-blocks", "0"])


def test_duet_variants_see_inflight_blocks_and_uncached_queues():
    workers = workers_with(2)
    workers[1].submit(RequestRecord(req(0, 0.0, 2048, (1, 2, 3, 4)), 1))  # running on 1, nothing stored yet
    workers[1].cache.store([7, 8])
    workers[1].submit(RequestRecord(req(1, 0.0, 1024, (7, 8)), 1))  # waiting on 1, whole prompt cached there
    r = req(2, 0.0, 2048, (1, 2, 3, 5))
    plain, spec = DuetPolicy(seed=0), DuetPolicy(seed=0, speculative=True, uncached_queue=True)
    assert plain.cached_tokens(workers[1], r) == 0 and spec.cached_tokens(workers[1], r) == 1536
    assert plain.queued_tokens(workers[1]) == 2048 + 1024 and spec.queued_tokens(workers[1]) == 2048
    no_guardrail = make_policy("duet_no_guardrail", ReplayConfig())
    assert no_guardrail.config.busy_queue_s == math.inf and no_guardrail.speculative and no_guardrail.uncached_queue
    plain = make_policy("duet_plain", ReplayConfig())
    assert not plain.speculative and not plain.uncached_queue
    duet = make_policy("duet", ReplayConfig())
    assert duet.speculative and duet.uncached_queue and duet.config.busy_queue_s == 10.0
