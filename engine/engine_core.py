"""One engine step for every engine: schedule -> execute -> update, with hooks for what differs.

    add_request / add_transferred (KV arrived) / finish_request / abort      (between steps)
    step():
      scheduler.schedule()              ─▶ chunks: tokens to compute under the budget (a decoding request's
                                           guesses too, when speculating: engine/speculation.py)
      drafter.propose(chunks)           ─▶ a draft model's guesses filled in (engine/drafter.py), if it has one
      hooks.before_execute(chunks)      ─▶ on_layer_done for this forward, or None
      runner.execute(chunks, on_layer_done) ─▶ tokens per sampled request (guesses verified by the sampler)
                                           (raised: hooks.on_execute_failed: re-raise, or abort them)
      a request whose own sampling failed ─▶ FINISHED_ERROR, freed; the others go on
      structured requests' grammars advance by their sampled tokens (a rejection: FINISHED_ERROR alone)
      scheduler.update_from_output      ─▶ appended, stopped requests freed
      ─▶ [NewTokens]: per request, the tokens it gained (a list), their logprobs, its status

`LLMEngine` (offline: detokenization, stop strings, outputs), the prefill worker (KV sent per layer group,
through its hooks) and the decode worker (KV arrived, tokens streamed) each hold one and drive `step`;
none of them touches the scheduler's queues. Not thread-safe: one thread drives a core.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from engine.drafter import Drafter
from engine.errors import InvalidRequestError
from engine.grammar_compiler import GrammarCompiler
from engine.model_runner import ModelRunner
from engine.request import Request, RequestStatus
from engine.runtime import Runtime
from engine.sampler import SampledTokens, TokenLogprobs
from engine.scheduler import ScheduledChunk, Scheduler
from engine.speculation import NO_SPECULATION, SpeculationStats

LayerCallback = Callable[[int], None]  # on_layer_done(i): layer i's K/V for every chunk is in the cache


@dataclass(slots=True)
class NewTokens:
    """What one request gained in a step. `token_ids` is never empty, except for a request that failed on
    its own (status FINISHED_ERROR, `error` says why); a request that finished keeps the tokens up to the
    one that ended it (the scheduler dropped any after it). Read-only by contract (not frozen: one is made
    per request per step, and a frozen dataclass is several times slower to make)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None  # one per token; None where the request asked for none
    status: RequestStatus  # after the last token: finished or still running
    error: str | None = None  # FINISHED_ERROR only: what failed

    @property
    def finished(self) -> bool:
        return self.status.finished


class StepHooks:
    """What an engine adds to each step; the defaults add nothing (the offline engine, the decode worker)."""

    def before_execute(self, chunks: Sequence[ScheduledChunk]) -> LayerCallback | None:
        """Called with the step's scheduled chunks (read-only; their block tables are valid for this step
        only) right before the forward pass; returns that forward's `on_layer_done`, or None.

        The prefill worker starts its KV sends here and ships each layer group from the callback. An
        exception here counts as one of the forward (see `on_execute_failed`)."""
        return None

    def on_execute_failed(self, chunks: Sequence[ScheduledChunk], error: Exception) -> None:
        """Called when `before_execute` or the forward raised `error`, before anything was updated: the
        step's chunks are scheduled but not computed. The default re-raises it from `step`. A hook that
        returns instead has dealt with the step's requests (the prefill worker aborts them and goes on),
        and `step` returns []."""
        raise error


class EngineCore:
    """A scheduler and a model runner, stepped together.

    Contract of `step`: every chunk scheduled is executed once; each sampled request appears once in the
    result, in schedule order (those that failed on their own last), with the tokens it gained; finished
    requests have already been freed (their blocks are back in the pool). If the forward raises,
    `hooks.on_execute_failed` decides; if one request's sampling raises, that request alone ends with
    FINISHED_ERROR.
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, hooks: StepHooks | None = None,
                 grammar_compiler: GrammarCompiler | None = None, drafter: Drafter | None = None):
        self.scheduler = scheduler
        self.runner = runner
        self.drafter = drafter  # speculative decoding with a draft model: fills the step's guesses
        self.hooks = hooks or StepHooks()
        self.last_step_num_tokens = 0  # tokens computed by the last step (metrics: iteration tokens)
        self.grammar_compiler = grammar_compiler  # None: structured output is refused (InvalidRequestError)

    @classmethod
    def from_runtime(cls, runtime: Runtime, hooks: StepHooks | None = None) -> EngineCore:
        return cls(runtime.scheduler, runtime.runner, hooks, runtime.grammar_compiler, runtime.drafter)

    # -- requests (between steps) ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a validated request; ValueError if its id is live, InvalidRequestError if its structured
        output cannot be served (or its earlier output, replayed, breaks it)."""
        self._attach_grammar(request)
        self.scheduler.add_request(request)

    def add_transferred(self, request: Request, block_ids: list[int], num_local_blocks: int = 0) -> None:
        """KV arrived: a request whose KV for all but its last token is in `block_ids` (allocated from this
        pool; the first `num_local_blocks` are this pool's own cached blocks, the rest were written by the
        transfer) joins the running batch; its next step computes the last token and samples the one after.
        Raises as `add_request` (nothing is taken then)."""
        self._attach_grammar(request)
        self.scheduler.add_transferred(request, block_ids)
        if self.drafter is not None and self.drafter.receives_kv:  # the draft's KV of the same tokens came too
            self.drafter.adopt(request.request_id, request.all_token_ids[:-1], block_ids, num_local_blocks)

    def _attach_grammar(self, request: Request) -> None:
        """A structured request's grammar state, having replayed the tokens it generated elsewhere (the
        prefill worker's first token, a migrated request's output). A copy of a cached matcher when the
        server `prepare`d the spec on its own thread; compiled here (~1 ms) otherwise."""
        spec = request.sampling_params.structured_output
        if spec is None or request.grammar is not None:
            return
        if self.grammar_compiler is None:
            raise InvalidRequestError("structured_output", spec.kind, "is not served by this engine (it has no "
                                      "grammar compiler: build it with EngineCore.from_runtime)")
        request.grammar = self.grammar_compiler.new_state(
            spec, request.sampling_params.stop_token_ids, request.output_token_ids)

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> bool:
        """End a live request with a finished `status` now and free its blocks; False if it is not live."""
        return self.scheduler.finish_request(request_id, status, stop_reason)

    def abort(self, request_id: str) -> bool:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_requests(self) -> int:
        """Live requests: waiting and running."""
        return len(self.scheduler.requests)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_prefix_query_tokens(self) -> int:
        """Prompt tokens looked up in the prefix cache so far (a plain read: safe from any thread)."""
        return self.scheduler.num_prefix_query_tokens

    @property
    def num_prefix_hit_tokens(self) -> int:
        return self.scheduler.num_prefix_hit_tokens

    @property
    def speculation(self) -> SpeculationStats:
        """Speculative decoding's counters (all zero when it is off)."""
        speculator = self.scheduler.speculator
        return NO_SPECULATION if speculator is None else speculator.stats()

    @property
    def num_preemptions(self) -> int:
        """Requests preempted so far (their KV dropped, to be recomputed)."""
        return self.scheduler.num_preemptions

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens of requests whose first token was sampled here (not a request whose KV arrived, nor a
        migrated one: their prompt counted where it was first prefilled)."""
        return self.scheduler.num_prompt_tokens

    @property
    def num_generation_tokens(self) -> int:
        """Tokens sampled and kept (a prefill worker's first token included)."""
        return self.scheduler.num_generation_tokens

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.config.max_num_seqs

    def check_integrity(self, other_holders: Iterable[Sequence[int]] = ()) -> None:
        """Scheduler and block accounting agree (`other_holders`: block lists held outside the requests)."""
        self.scheduler.check_integrity(other_holders)

    # -- one step ----------------------------------------------------------------------------------

    def step(self) -> list[NewTokens]:
        scheduled = self.scheduler.schedule()
        self.last_step_num_tokens = scheduled.num_batched_tokens
        start = time.perf_counter()
        fed_before = self.drafter.num_fed_tokens if self.drafter is not None else 0
        try:
            if self.drafter is not None:
                self.drafter.forget(scheduled.preempted_ids)
                self.drafter.propose(scheduled.chunks)
            on_layer_done = self.hooks.before_execute(scheduled.chunks)
            sampled = self.runner.execute(scheduled.chunks, on_layer_done)
            if self.drafter is not None and (self.drafter.shadows or not self._speculation_off()):
                # the draft's KV of the prompt chunks (a prefill worker: of every chunk, which it ships)
                num_layers = len(self.runner.kv_caches)
                self.drafter.shadow(scheduled.chunks, None if on_layer_done is None else
                                    lambda layer: on_layer_done(num_layers + layer))
        except Exception as e:
            self.hooks.on_execute_failed(scheduled.chunks, e)
            return []
        drafted = self.drafter is not None and self.drafter.num_fed_tokens > fed_before
        self._observe_speculation(scheduled.chunks, sampled, time.perf_counter() - start, drafted)
        failed = [NewTokens(request_id, [], None, RequestStatus.FINISHED_ERROR, s.error)
                  for request_id, s in sampled.items() if s.error is not None]
        failed += self._advance_grammars(sampled)
        for new in failed:  # freed before the update, which then skips their chunks (no longer running)
            self.scheduler.finish_request(new.request_id, RequestStatus.FINISHED_ERROR)
        updates = self.scheduler.update_from_output(
            scheduled, {request_id: s.token_ids for request_id, s in sampled.items()}
        )
        if self.drafter is not None:
            self.drafter.retain(self.scheduler.requests)
        results = []
        for update in updates:
            logprobs = sampled[update.request_id].logprobs
            if logprobs is not None:
                logprobs = logprobs[: len(update.token_ids)]  # those of tokens past a stop were dropped too
            results.append(NewTokens(update.request_id, update.token_ids, logprobs, update.status))
        return results + failed

    def _speculation_off(self) -> bool:
        """Whether the measured back-off has speculation off at the running batch's size (then a draft model skips
        the prompt chunks too: engine/speculation_payoff.py)."""
        speculator = self.scheduler.speculator
        return speculator is not None and speculator.payoff.is_off(len(self.scheduler.running))

    def _observe_speculation(self, chunks: list[ScheduledChunk], sampled: dict[str, SampledTokens],
                             seconds: float, drafted: bool) -> None:
        """A decode-only step's speed, with or without guesses, for the speculator's measured back-off (a step in
        which a draft model only caught up counts as speculative: speculation cost it that time)."""
        speculator = self.scheduler.speculator
        if speculator is None or not chunks or any(len(c.token_ids) != 1 for c in chunks):
            return
        speculated = drafted or any(c.proposed_token_ids for c in chunks)
        num_tokens = sum(len(s.token_ids) for s in sampled.values())
        speculator.observe_step(len(chunks), speculated, num_tokens, seconds)

    def _advance_grammars(self, sampled: dict[str, SampledTokens]) -> list[NewTokens]:
        """Feed each structured request's sampled tokens to its grammar (they were drawn under its mask, so
        a rejection is the library's or a replay's fault): one rejected fails that request alone."""
        failed = []
        requests = self.scheduler.requests
        for request_id, s in sampled.items():
            request = requests.get(request_id)
            if s.error is not None or request is None or request.grammar is None:
                continue
            if not all(request.grammar.accept(token_id) for token_id in s.token_ids):
                failed.append(NewTokens(request_id, [], None, RequestStatus.FINISHED_ERROR,
                                        f"structured output: {request.grammar.error}"))
        return failed
