"""Speculative decoding, the scheduler's side: which running requests draft guesses this step, how many, and
what was accepted. Pure Python (the scheduler never imports torch); the sampler verifies (engine/sampler.py).

    schedule():  a decoding request (one known token left to compute) gets up to k guesses from the proposer,
                 fewer near max_tokens / the context end, none when the step is large or the request is
                 backing off; they ride in its chunk as `proposed_token_ids` and take budget and KV slots.
                 n-gram guesses are made here; a draft model's are DRAFT_PENDING places that the drafter
                 (engine/drafter.py, which runs a model: not the scheduler's business) fills before the step
                 executes
    update:      the sampler kept a of them (and sampled one more): the KV of those a is computed, the rest of
                 the guessed slots are stale and the blocks past the computed tokens go back to the pool

Back-off, so speculation never makes a workload noticeably slower:
  per step     more live requests than `disable_by_batch_size`: nobody drafts (verification is not free when
               a step is compute-bound); and at each batch size, by measurement: while speculative steps gain
               fewer tokens per second than plain ones (x `min_speedup`), nobody drafts for a while
               (engine/speculation_payoff.py);
  per request  an acceptance rate (exponential average over its drafts) below `min_acceptance_rate` pauses its
               drafting for a number of steps that doubles each time it happens again (up to MAX_PAUSE_STEPS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from engine.ngram_proposer import propose_ngram
from engine.request import Request
from engine.speculation_payoff import PayoffTracker
from engine.speculative_config import SpeculativeConfig

DRAFT_PENDING = -1  # a guess the drafter has yet to make (never a token id: a forward over one fails loudly)
ACCEPTANCE_DECAY = 0.5  # weight of the older drafts in a request's acceptance average
FIRST_PAUSE_STEPS = 4
MAX_PAUSE_STEPS = 64


@dataclass(slots=True)
class DraftState:
    """One request's speculation: its acceptance average and back-off."""

    acceptance: float = 1.0
    paused_steps: int = 0  # steps left without drafting
    next_pause_steps: int = FIRST_PAUSE_STEPS


class SpeculationStats(NamedTuple):
    """What verification kept so far (vLLM's spec_decode_* counters)."""

    num_drafts: int  # chunks that carried guesses
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_per_position: tuple[int, ...]  # [j]: drafts whose guess j was accepted


NO_SPECULATION = SpeculationStats(0, 0, 0, ())


class Speculator:
    """Drafts guesses for decoding requests and counts what verification kept (metrics under vLLM's names:
    drafts, draft tokens, accepted tokens, accepted per position). Not thread-safe: the scheduler's thread."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.num_drafts = 0  # chunks that carried guesses
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_per_position = [0] * config.num_speculative_tokens
        self._states: dict[str, DraftState] = {}
        self.payoff = PayoffTracker(config.min_speedup)
        self._step_on = True  # this step's verdict (begin_step)

    def begin_step(self, batch_size: int) -> None:
        """A step with `batch_size` running requests is being scheduled: whether it speculates at all."""
        self._step_on = self.payoff.speculate(batch_size)

    def observe_step(self, batch_size: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        """A decode-only step of `batch_size` chunks (with guesses or not) gained `num_tokens` in `seconds`."""
        self.payoff.observe(batch_size, speculated, num_tokens, seconds)

    def draft(self, request: Request, num_live: int, max_tokens: int) -> list[int]:
        """Guesses for a decoding request's next tokens: at most `max_tokens` (what is left of the step's budget)."""
        cfg = self.config
        if not self._step_on or num_live > cfg.disable_by_batch_size or max_tokens < 1:
            return []
        state = self._states.setdefault(request.request_id, DraftState())
        if state.paused_steps:
            state.paused_steps -= 1
            return []
        # the bonus token the step samples after the last accepted guess must fit too
        room = min(cfg.num_speculative_tokens, max_tokens, request.sampling_params.max_tokens -
                   request.num_output_tokens - 1, self.max_model_len - request.num_tokens - 1)
        if room < 1:
            return []
        if cfg.method == "draft_model":
            return [DRAFT_PENDING] * room
        return propose_ngram(request.all_token_ids, cfg.prompt_lookup_min, cfg.prompt_lookup_max, room)

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """Verification of a chunk's `num_proposed` guesses kept the first `num_accepted`."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_per_position[position] += 1
        state = self._states.setdefault(request_id, DraftState())
        state.acceptance = ACCEPTANCE_DECAY * state.acceptance + (1 - ACCEPTANCE_DECAY) * num_accepted / num_proposed
        if state.acceptance < self.config.min_acceptance_rate:
            state.paused_steps = state.next_pause_steps
            state.next_pause_steps = min(2 * state.next_pause_steps, MAX_PAUSE_STEPS)
            state.acceptance = 1.0  # a fresh start after the pause

    def stats(self) -> SpeculationStats:
        """The counters, as plain values (safe to read from any thread: a snapshot of ints)."""
        return SpeculationStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                tuple(self.num_accepted_per_position))

    def forget(self, request_id: str) -> None:
        """The request ended (or was preempted: its next run starts afresh)."""
        self._states.pop(request_id, None)
