"""Scheduler in tokens: budgets, chunking, prefix hits, preemption — exact block ids and counts."""

import pytest

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=8, block_size=4, max_num_seqs=4, budget=16, max_model_len=32):
    pool = BlockPool(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), KVCacheManager(pool, "m"))


def req(rid, prompt, max_tokens=8, **kw):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, **kw), frozenset({0}))


def step(s, token=7):
    out = s.schedule()
    sampled = {c.request_id: [token] for c in out.chunks if c.sample}
    return out, s.update_from_output(out, sampled)


def test_prefill_then_decode_one_token_each():
    s = make()
    s.add_request(req("a", range(1, 6)))  # 5 tokens: blocks 0, 1
    out, updates = step(s)
    (c,) = out.chunks
    assert (c.token_ids, c.start_position, c.block_ids, c.sample) == ([1, 2, 3, 4, 5], 0, [0, 1], True)
    assert [(u.request_id, u.token_ids) for u in updates] == [("a", [7])]
    assert c.proposed_token_ids == []  # no speculator: no guesses
    out, _ = step(s)
    (c,) = out.chunks
    assert (c.token_ids, c.start_position, c.block_ids) == ([7], 5, [0, 1])
    s.check_integrity()


def test_long_prompt_is_chunked_under_the_budget_and_samples_only_at_the_end():
    s = make(budget=6)
    s.add_request(req("a", range(1, 15)))  # 14 tokens -> 6 + 6 + 2
    chunks = []
    for _ in range(3):
        out, updates = step(s)
        chunks += [(c.start_position, len(c.token_ids), c.sample) for c in out.chunks]
    assert chunks == [(0, 6, False), (6, 6, False), (12, 2, True)]
    assert s.requests["a"].output_token_ids == [7]
    assert s.kv_cache.block_ids("a") == [0, 1, 2, 3]
    s.check_integrity()


def test_running_requests_come_first_and_waiting_ones_fill_the_budget():
    s = make(budget=8)
    s.add_request(req("a", range(1, 5)))
    step(s)
    s.add_request(req("b", range(10, 20)))  # 10 tokens, only 7 fit after a's decode
    out, _ = step(s)
    assert [(c.request_id, len(c.token_ids), c.sample) for c in out.chunks] == [("a", 1, True), ("b", 7, False)]


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2, num_blocks=16)
    for r in "abc":
        s.add_request(req(r, [1, 2]))
    out, _ = step(s)
    assert [c.request_id for c in out.chunks] == ["a", "b"] and s.num_waiting == 1


def test_finished_requests_leave_at_once_and_free_blocks():
    s = make()
    s.add_request(req("a", [1, 2, 3], max_tokens=2))
    step(s)
    _, updates = step(s)
    assert updates[0].status is RequestStatus.FINISHED_LENGTH
    assert not s.running and "a" not in s.requests
    s.check_integrity()
    assert s.kv_cache.pool.num_free_blocks == 8


def test_eos_stops_unless_ignored_and_stop_token_ids_stop():
    s = make()
    s.add_request(req("a", [1, 2]))
    s.add_request(req("b", [1, 3], ignore_eos=True))
    s.add_request(req("c", [1, 4], stop_token_ids=[9]))
    _, updates = step(s, token=0)  # 0 is eos
    assert {u.request_id: u.status for u in updates} == {
        "a": RequestStatus.FINISHED_STOPPED, "b": RequestStatus.RUNNING, "c": RequestStatus.FINISHED_STOPPED
    }
    s.add_request(req("d", [1, 5], stop_token_ids=[9]))
    _, updates = step(s, token=9)
    assert {u.request_id: u.status for u in updates}["d"] is RequestStatus.FINISHED_STOPPED
    assert s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    s.check_integrity()


def test_prefix_hit_reuses_blocks_and_leaves_one_token_to_compute():
    s = make(num_blocks=8)
    s.add_request(req("a", range(1, 10), max_tokens=1))  # 9 tokens: blocks 0,1 full and cached
    step(s)
    assert s.kv_cache.pool.num_cached_blocks == 2
    s.add_request(req("b", list(range(1, 9)) + [99]))  # shares the two full blocks
    out, _ = step(s)
    (c,) = out.chunks
    assert (c.start_position, c.token_ids, c.block_ids[:2]) == (8, [99], [0, 1])
    assert s.requests["b"].num_cached_tokens == 8
    s.add_request(req("c", range(1, 9)))  # the whole prompt is cached: recompute its last block
    out, _ = step(s)
    c = [c for c in out.chunks if c.request_id == "c"][0]
    assert (c.start_position, len(c.token_ids)) == (4, 4) and c.block_ids[0] == 0
    assert (s.num_prefix_query_tokens, s.num_prefix_hit_tokens) == (9 + 9 + 8, 8 + 4)
    s.check_integrity()


def test_preemption_by_recompute_keeps_output_and_frees_the_latest_request():
    s = make(num_blocks=4, block_size=2, budget=16, max_model_len=8)
    s.add_request(req("a", [1, 2, 3]))  # blocks 0, 1
    s.add_request(req("b", [4, 5, 6]))  # blocks 2, 3
    step(s)
    out, _ = step(s)  # a decodes token at position 3 (fits in block 1); b likewise in block 3
    assert not out.preempted_ids
    out, _ = step(s)  # a needs a third block: none free, b (admitted last) is preempted
    assert out.preempted_ids == ["b"] and [c.request_id for c in out.chunks] == ["a"]
    b = s.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.output_token_ids == [7, 7]
    assert s.waiting[0] is b
    s.check_integrity()
    while "a" in s.requests:
        step(s)
    out, _ = step(s)  # b is recomputed: prompt + its two outputs, from the prefix cache where possible
    (c,) = out.chunks
    assert c.request_id == "b" and c.start_position + len(c.token_ids) == 5 and c.sample
    s.check_integrity()
    # the metrics' counters: each prompt counted once (b's recompute is not a new prompt), every kept token
    # (a: 5, b: 2 before and 1 after its preemption), one preemption
    assert (s.num_prompt_tokens, s.num_generation_tokens, s.num_preemptions) == (3 + 3, 5 + 3, 1)


def test_a_list_of_tokens_is_appended_in_order_and_cut_at_a_stop():
    s = make()
    s.add_request(req("a", [1, 2, 3], max_tokens=8))
    s.add_request(req("b", [4, 5], max_tokens=8, stop_token_ids=[9]))
    s.add_request(req("c", [6], max_tokens=3))
    out = s.schedule()
    updates = s.update_from_output(out, {"a": [7, 8], "b": [7, 9, 8, 8], "c": [7, 7, 7, 7]})
    assert [(u.request_id, u.token_ids, u.status) for u in updates] == [
        ("a", [7, 8], RequestStatus.RUNNING),
        ("b", [7, 9], RequestStatus.FINISHED_STOPPED),  # stop token 9: the tokens after it are dropped
        ("c", [7, 7, 7], RequestStatus.FINISHED_LENGTH),  # max_tokens=3
    ]
    a = s.requests["a"]
    assert (a.output_token_ids, a.all_token_ids, a.num_computed_tokens) == ([7, 8], [1, 2, 3, 7, 8], 3)
    assert list(s.requests) == ["a"] and s.kv_cache.block_ids("b") == [] and s.kv_cache.block_ids("c") == []
    (c,) = s.schedule().chunks  # both new tokens' KV is still to compute: one chunk of two tokens
    assert (c.token_ids, c.start_position, c.sample) == ([7, 8], 3, True)
    s.check_integrity()


def test_a_sampled_chunk_must_gain_a_token():
    s = make()
    s.add_request(req("a", [1, 2]))
    out = s.schedule()
    with pytest.raises(ValueError, match="request 'a' sampled no token"):
        s.update_from_output(out, {"a": []})
