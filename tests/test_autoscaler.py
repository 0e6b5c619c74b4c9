"""The autoscaling policy (deploy/autoscaler.py), exactly, and its replay over the shared trace."""

import statistics

import pytest
from conftest import shared_trace_path

from benchmarks.sim.autoscale_sim import simulate
from benchmarks.sim.trace_replay import load_trace
from deploy.autoscaler import PoolPolicy, PoolState, decide

TRACE = shared_trace_path()
POLICY = PoolPolicy(target_per_replica=100, min_replicas=1, max_replicas=10, scale_up_step=2, scale_down_step=1,
                    scale_up_cooldown_s=30, scale_down_cooldown_s=120, tolerance=0.1)


def test_scale_up_is_step_limited_and_cools_down():
    state = PoolState(2)
    assert decide(POLICY, state, 900, 0.0) == (4, "up")  # wants 9, at most +2
    assert decide(POLICY, state, 900, 10.0) == (4, "cooldown")
    assert decide(POLICY, state, 900, 30.0) == (6, "up")
    assert decide(POLICY, state, 5000, 60.0) == (8, "up")
    assert decide(POLICY, state, 5000, 90.0) == (10, "up")
    assert decide(POLICY, state, 5000, 120.0) == (10, "hold")  # max_replicas


def test_scale_down_waits_for_any_recent_change_and_steps_by_one():
    state = PoolState(5, last_up_s=0.0)
    assert decide(POLICY, state, 0, 60.0) == (5, "cooldown")  # 120 s after the last change up
    assert decide(POLICY, state, 0, 120.0) == (4, "down")
    assert decide(POLICY, state, 0, 200.0) == (4, "cooldown")
    assert decide(POLICY, state, 0, 240.0) == (3, "down")
    assert decide(POLICY, PoolState(1), 0, 0.0) == (1, "hold")  # min_replicas


def test_tolerance_band_and_clamp():
    assert decide(POLICY, PoolState(4), 430, 0.0) == (4, "tolerance")  # ratio 1.075: no change
    assert decide(POLICY, PoolState(4), 460, 0.0) == (5, "up")
    assert decide(POLICY, PoolState(12), 0, 0.0) == (10, "clamp")
    with pytest.raises(ValueError, match="target_per_replica"):
        PoolPolicy(target_per_replica=0)
    with pytest.raises(ValueError, match="min_replicas=3, max_replicas=2"):
        PoolPolicy(target_per_replica=1, min_replicas=3, max_replicas=2)


def test_replicas_track_the_shared_trace():
    arrivals = [(r.arrival_s, r.prompt_tokens) for r in load_trace(TRACE)]
    end_s = max(t for t, _ in arrivals)
    policy = PoolPolicy(target_per_replica=8000, max_replicas=16, scale_down_cooldown_s=60)
    ticks = simulate(arrivals, policy, tokens_per_s=10_000, tail_s=1200, initial_replicas=4)
    needed, ready = [], []
    for lo in range(120, int(end_s) - 60, 120):  # two-minute windows, after the cold start
        window = [t for t in ticks if lo <= t.t_s < lo + 120]
        needed.append(sum(t.offered_tokens_per_s for t in window) / len(window) / 10_000)
        ready.append(sum(t.ready for t in window) / len(window))
    assert statistics.correlation(needed, ready) > 0.5  # replicas follow the offered load
    assert all(r >= n for n, r in zip(needed, ready))  # never below what the load needs on average
    assert all(r <= 2 * n + 2 for n, r in zip(needed, ready))  # nor wastefully above (bursty trace: headroom)
    assert ticks[-1].ready == policy.min_replicas and ticks[-1].queued_tokens == 0  # idle: back to the minimum
    changes = [b.replicas - a.replicas for a, b in zip(ticks, ticks[1:]) if b.replicas != a.replicas]
    flips = sum(1 for a, b in zip(changes, changes[1:]) if (a > 0) != (b > 0))
    assert flips <= 12  # no flapping
