"""Whether speculating pays, by measurement: decode steps' tokens per second with guesses against without, per
batch size, so a proposer that costs more than it saves (a draft model nearly as slow as the target, verification
on a compute-bound step) is switched off instead of making the workload slower.

Per batch size (decode chunks in the step), two exponential averages of tokens / second: `plain` (steps that
verified no guess) and `speculative` (steps that did). Before each step the scheduler asks `speculate(b)`:

    no plain figure for b, or PROBE_EVERY_STEPS speculative steps since the last plain one
                                      -> a plain step (a probe: what speculation is compared with)
    speculative < min_speedup * plain -> off for a pause of FIRST_OFF_STEPS steps, doubling (up to MAX_OFF_STEPS)
                                         each time it happens again; afterwards it is measured afresh
    otherwise                         -> speculate

Steps with a prefill chunk are not measured (their time is the prefill's). While a batch size is off (`is_off`),
a draft model does not compute the prompt KV of its requests either (engine/engine_core.py): that work is
speculation's too (~30 % of a batch-1 bf16 cell of copy prompts, RESULTS.md), and a request that meets
speculation back on catches its draft up in bounded chunks. Pure Python: the engine core times the steps and
reports them (`observe`).
"""

from __future__ import annotations

from dataclasses import dataclass

RATE_DECAY = 0.7  # weight of the older steps in each average
PROBE_EVERY_STEPS = 64
FIRST_OFF_STEPS = 16
MAX_OFF_STEPS = 1024


@dataclass(slots=True)
class _BatchRates:
    plain: float = 0.0  # tokens / s (0: not measured yet)
    speculative: float = 0.0
    steps_since_probe: int = 0
    off_steps: int = 0  # steps left with speculation off
    next_off_steps: int = FIRST_OFF_STEPS


class PayoffTracker:
    """`speculate(b)` before a step of b decodes, `observe(...)` after it. Not thread-safe: the engine's thread."""

    def __init__(self, min_speedup: float):
        self.min_speedup = min_speedup  # 0: never switched off by measurement
        self._rates: dict[int, _BatchRates] = {}
        self.num_off_switches = 0  # times a batch size was switched off (a counter for tests and logs)

    def speculate(self, batch_size: int) -> bool:
        if not self.min_speedup:
            return True
        r = self._rates.setdefault(batch_size, _BatchRates())
        if r.off_steps:
            r.off_steps -= 1
            return False
        if not r.plain or r.steps_since_probe >= PROBE_EVERY_STEPS:
            return False  # a probe; `observe` resets the count
        if r.speculative and r.speculative < self.min_speedup * r.plain:
            r.off_steps, r.next_off_steps = r.next_off_steps, min(2 * r.next_off_steps, MAX_OFF_STEPS)
            r.speculative = 0.0  # measured afresh when it is back on
            self.num_off_switches += 1
            return False
        if r.speculative >= r.plain:
            r.next_off_steps = FIRST_OFF_STEPS  # it pays: a later lapse gets the short pause again
        r.steps_since_probe += 1
        return True

    def is_off(self, batch_size: int) -> bool:
        """Whether speculation is switched off at `batch_size` now (asking changes nothing)."""
        r = self._rates.get(batch_size)
        return r is not None and r.off_steps > 0

    def observe(self, batch_size: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        """A decode-only step of `batch_size` chunks gained `num_tokens` in `seconds`."""
        if not self.min_speedup or seconds <= 0:
            return
        r = self._rates.setdefault(batch_size, _BatchRates())
        rate = num_tokens / seconds
        if speculated:
            r.speculative = rate if not r.speculative else RATE_DECAY * r.speculative + (1 - RATE_DECAY) * rate
        else:
            r.plain = rate if not r.plain else RATE_DECAY * r.plain + (1 - RATE_DECAY) * rate
            r.steps_since_probe = 0
