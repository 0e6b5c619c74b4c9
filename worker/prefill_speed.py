"""PrefillSpeed: a prefill worker's measured speed in tokens/s, which the router's cost model divides by
(router/prefix_policy.py: work ahead / speed + uncached prompt / speed, plus a fixed per-request cost). A decode
worker measures its local prefills (conditional disaggregation) with one too: their tokens over the steps that
computed them, decode rows and all, which admission divides its queue of local prefills by.

Decayed sums (tokens and step seconds, each x 0.95 per step), so the speed follows the recent mix of prompt
lengths. Two kinds of step are left out, because each would make a worker look several times slower than it is
for many steps, and the router would then send a prefix away from the worker that holds it:

- the worker's first step, which pays one-time warm-up (lazy kernel loads, first allocations);
- steps of fewer than MIN_MEASURED_TOKENS tokens (a follow-up that hits the cache computes ~20): their time is
  the step's fixed cost (scheduling, the first decode, KV hand-off), which the policy's `fixed_s` stands for,
  and one noisy such step sets the estimate. A worker that has measured nothing reports 0 (unknown: the router
  uses the other workers' median).

A worker measures itself once before it serves (`PrefillLoop.measure_speed`: synthetic forwards observed here as
steps are), so even a fresh cluster's first requests are priced by a measured speed.
"""

from __future__ import annotations

DECAY = 0.95
MIN_MEASURED_TOKENS = 64


class PrefillSpeed:
    def __init__(self) -> None:
        self._warmed_up = False
        self._decayed_tokens = 0.0
        self._decayed_step_s = 0.0

    def observe(self, num_tokens: int, step_s: float) -> None:
        """One finished step that computed `num_tokens` prompt tokens in `step_s` seconds."""
        if not self._warmed_up:
            self._warmed_up = True
            return
        if num_tokens < MIN_MEASURED_TOKENS:
            return
        self._decayed_tokens = DECAY * self._decayed_tokens + num_tokens
        self._decayed_step_s = DECAY * self._decayed_step_s + step_s

    @property
    def tokens_per_s(self) -> float:
        """The measured speed; 0.0 while unknown."""
        return self._decayed_tokens / self._decayed_step_s if self._decayed_step_s > 0 else 0.0
