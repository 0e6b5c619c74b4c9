"""deploy/restarts.py: the backoff `duet up` and `duet ray up` share, on a clock the test sets."""

from __future__ import annotations

import pytest

from deploy.restarts import RestartBackoff, describe_returncode


def test_backoff_doubles_with_recent_restarts_up_to_its_cap_and_forgets_old_ones():
    backoff = RestartBackoff()
    now_s, said = 0.0, []
    for _ in range(7):  # dies again as soon as it is restarted
        said.append(backoff.schedule("decode-0", now_s))
        delay_s = float(said[-1].split(" in ")[1].split(" s ")[0])
        assert backoff.take_due(now_s + delay_s - 0.01) == [] and backoff.is_scheduled("decode-0")
        now_s += delay_s
        assert backoff.take_due(now_s) == ["decode-0"] and not backoff.is_scheduled("decode-0")
    assert said == [f"duet: restarting decode-0 in {d} s (restart {n} within 300 s)"
                    for n, d in enumerate([1, 2, 4, 8, 16, 30, 30], start=1)]
    # the last restart was at now_s: 299 s later it still counts, 300 s later none does
    assert backoff.schedule("decode-0", now_s + 299).endswith("in 2 s (restart 2 within 300 s)")
    assert backoff.schedule("decode-0", now_s + 300).endswith("in 1 s (restart 1 within 300 s)")


def test_components_back_off_apart_and_a_cancelled_restart_never_comes_due():
    backoff = RestartBackoff()
    assert backoff.schedule("router", 0.0).endswith("in 1 s (restart 1 within 300 s)")
    assert backoff.take_due(1.0) == ["router"]
    assert backoff.schedule("router", 1.5).endswith("in 2 s (restart 2 within 300 s)")
    assert backoff.schedule("prefill-0", 1.5).endswith("in 1 s (restart 1 within 300 s)")  # its own count
    backoff.cancel("router")  # e.g. the autoscaler stopped it meanwhile
    assert backoff.take_due(100.0) == ["prefill-0"] and backoff.take_due(1000.0) == []


def test_exit_codes_and_bad_settings_in_words():
    assert describe_returncode(0) == "exited with code 0" and describe_returncode(3) == "exited with code 3"
    assert describe_returncode(-9) == "was killed by SIGKILL" and describe_returncode(-99) == "was killed by signal 99"
    with pytest.raises(ValueError, match="base_s=2, max_s=1, window_s=300 are invalid"):
        RestartBackoff(base_s=2, max_s=1)
