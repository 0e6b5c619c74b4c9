"""PrefillSpeed (prefill_worker/prefill_speed.py): the speed a prefill worker reports to the router."""

import pytest

from prefill_worker.prefill_speed import DECAY, MIN_MEASURED_TOKENS, PrefillSpeed


def test_the_first_step_and_short_steps_are_not_measured():
    speed = PrefillSpeed()
    speed.observe(512, 10.0)  # warm-up: lazy loads, first allocations
    assert speed.tokens_per_s == 0.0  # unknown: the router uses the other workers' median
    speed.observe(MIN_MEASURED_TOKENS - 1, 5.0)  # a cache-hit follow-up: its time is the step's fixed cost
    assert speed.tokens_per_s == 0.0
    speed.observe(256, 0.5)
    assert speed.tokens_per_s == 512.0
    speed.observe(20, 3.0)  # one slow short step (a busy machine) leaves the estimate alone
    assert speed.tokens_per_s == 512.0


def test_the_speed_follows_recent_steps_by_decayed_sums():
    speed = PrefillSpeed()
    speed.observe(100, 1.0)
    speed.observe(100, 1.0)  # 100 tok/s
    speed.observe(1000, 1.0)  # 1000 tok/s now
    tokens, seconds = DECAY * 100 + 1000, DECAY * 1.0 + 1.0
    assert speed.tokens_per_s == pytest.approx(tokens / seconds)
