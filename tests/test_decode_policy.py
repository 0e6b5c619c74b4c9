"""router/decode_policy.py: decode workers ranked by cached overlap and load, exactly."""

from __future__ import annotations

import random

import pytest

from router.decode_policy import DecodePolicyConfig, DecodeState, decode_cost_s, rank_decode
from router.load_policy import Candidate
from router.load_policy import rank_decode as rank_decode_by_load


def test_without_a_cache_the_order_is_load_policys():
    workers = [DecodeState("a", 0, 3, 10), DecodeState("b", 0, 1, 5), DecodeState("c", 0, 1, 9),
               DecodeState("d", 0, 0, 1)]
    candidates = [Candidate(w.worker_id, 0, w.num_requests, w.num_free_blocks, 0) for w in workers]
    assert rank_decode(200, workers, rng=random.Random(0)) == ["d", "c", "b", "a"]
    assert rank_decode_by_load(candidates, rng=random.Random(0)) == ["d", "c", "b", "a"]


def test_cached_overlap_outweighs_a_little_load_not_a_lot():
    idle = DecodeState("idle", cached_tokens=0, num_requests=0, num_free_blocks=50)
    holds = DecodeState("holds", cached_tokens=160, num_requests=1, num_free_blocks=50)
    busy = DecodeState("busy", cached_tokens=160, num_requests=3, num_free_blocks=50)
    # 200 prompt tokens: idle 200 / 20000 = 10 ms; holds 40 / 20000 + 5 = 7 ms; busy 2 + 15 = 17 ms
    assert decode_cost_s(200, holds, DecodePolicyConfig()) == pytest.approx(0.007)
    assert rank_decode(200, [idle, holds, busy], rng=random.Random(0)) == ["holds", "idle", "busy"]


def test_cached_tokens_past_the_prompt_count_as_the_prompt():
    w = DecodeState("w", cached_tokens=500, num_requests=0, num_free_blocks=1)
    assert decode_cost_s(100, w, DecodePolicyConfig()) == 0.0


def test_ties_fall_to_the_rng_not_list_order():
    workers = [DecodeState(f"w{i}", 0, 0, 7) for i in range(4)]
    firsts = {rank_decode(10, workers, rng=random.Random(seed))[0] for seed in range(40)}
    assert firsts == {"w0", "w1", "w2", "w3"}


@pytest.mark.parametrize("kwargs, named", [(dict(kv_tokens_per_s=0), "kv_tokens_per_s=0"),
                                           (dict(request_s=-1), "request_s=-1")])
def test_config_errors_name_the_value(kwargs, named):
    with pytest.raises(ValueError, match=named):
        DecodePolicyConfig(**kwargs)


def test_prefills_locally_below_the_threshold_of_uncached_tokens():
    from router.decode_policy import prefills_locally

    assert prefills_locally(58, 32, 32)  # 26 uncached < 32
    assert not prefills_locally(64, 32, 32)  # 32 uncached: not fewer than 32
    assert prefills_locally(20, 0, 32) and not prefills_locally(40, 0, 32)
    assert prefills_locally(10, 50, 1)  # a cache longer than the prompt leaves nothing uncached
    assert not prefills_locally(1, 0, 0) and not prefills_locally(58, 48, 0)  # 0: never


def test_router_config_refuses_a_negative_local_prefill_threshold():
    from router.server import RouterConfig

    with pytest.raises(ValueError, match=r"local_prefill_tokens=-1 is invalid: must be >= 0"):
        RouterConfig(redis_url="redis://127.0.0.1:6379", local_prefill_tokens=-1)
    assert RouterConfig(redis_url="redis://127.0.0.1:6379").local_prefill_tokens == 0
