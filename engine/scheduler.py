"""Iteration-level scheduling in tokens: each step hands out new tokens to compute under a budget.

Each request has `num_computed_tokens` and a target, `num_tokens` (prompt + generated). A step
gives running requests their next tokens first (a decode is one token; an unfinished prefill its
next chunk), then admits waiting requests in arrival order while the token budget, the cap on
running sequences and the free blocks allow. A waiting request starts from its longest cached
prefix. When a running request needs a block and none is free, the most recently admitted running
request is preempted: its blocks are freed and it waits again to be recomputed (its generated
tokens are kept, and seeded sampling depends only on the step index, so its output is unchanged).

Speculative decoding (engine/speculation.py) is one more use of the same budget: a decoding request may carry
guesses (`proposed_token_ids`) whose KV the step computes and the sampler verifies; the tokens it gains are the
accepted guesses plus one, `num_computed_tokens` moves past the accepted ones only, and the blocks that held only
rejected guesses go back to the pool. Blocks are hashed into the prefix cache only up to `num_computed_tokens`, so
a block holding an unverified token never is.

This module never imports torch: it hands the model runner `ScheduledChunk`s and takes back a list of
tokens per sampled request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.speculation import Speculator

if TYPE_CHECKING:  # the scheduler never imports torch: it only passes the request's grammar state along
    from engine.grammar_state import GrammarState


@dataclass(slots=True)
class ScheduledChunk:
    """What the model runner needs to compute one request's tokens this step (read-only by contract;
    not frozen because a frozen dataclass is several times slower to make, and one is made per request
    per step)."""

    request_id: str
    token_ids: list[int]  # tokens whose KV is computed this step
    start_position: int  # position of token_ids[0] (== num_computed_tokens before the step)
    block_ids: list[int]  # the whole block table, the live list: valid for this step only
    sample: bool  # the chunk reaches the last known token: sample the next one
    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # the live list: read it during this step only
    # tokens a proposer guessed would follow token_ids (speculative decoding): their KV is computed after
    # token_ids' and the sampler verifies them; only a decoding chunk (one known token) carries any
    proposed_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()  # the request's: the sampler masks them under min_tokens
    grammar: GrammarState | None = None  # structured output: the request's grammar state (engine thread only)
    # the distributions a sampling draft model drew the guesses from (engine/drafter.py: opaque here, one tensor per
    # guess); None: each guess is its proposer's single candidate
    proposal_probs: list | None = None


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(c.token_ids) + len(c.proposed_token_ids) for c in self.chunks)


class TokenUpdate(NamedTuple):
    """The tokens a request gained this step (at least one), and whether it finished with the last."""

    request_id: str
    token_ids: list[int]
    status: RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128  # cap on running sequences
    max_num_batched_tokens: int = 2048  # token budget per step; longer prompts are chunked
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, speculator: Speculator | None = None):
        self.config = config
        self.kv_cache = kv_cache
        self.speculator = speculator  # None: no speculative decoding
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hit_tokens = 0
        self.num_preemptions = 0
        # what the engine computed, for metrics (plain ints: read from any thread at scrape time)
        self.num_prompt_tokens = 0  # a request's prompt counts once, in the step that samples its first token
        self.num_generation_tokens = 0  # tokens sampled and kept

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_transferred(self, request: Request, block_ids: list[int]) -> None:
        """A request whose KV for all but its last token arrived in `block_ids` (allocated from this pool)
        joins the running batch: its next step computes the last token and samples the one after."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in use")
        assert request.num_computed_tokens == request.num_tokens - 1, "exactly one token left to compute"
        self.kv_cache.adopt(request, block_ids)
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> bool:
        """End a request now (abort, or a stop string found by the engine); frees its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        assert status.finished
        if self.speculator is not None:
            self.speculator.forget(request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.status = status
        if stop_reason is not None:
            request.stop_reason = stop_reason
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        num_live = len(self.requests)
        if self.speculator is not None:
            self.speculator.begin_step(len(self.running))
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache.can_allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            if request.status is RequestStatus.PREEMPTED:
                break
            proposed: list[int] = []
            if self.speculator is not None and num_new == 1 == request.num_tokens - request.num_computed_tokens:
                proposed = self.speculator.draft(request, num_live, budget - num_new)
                if proposed and not self.kv_cache.can_allocate_slots(request, num_new + len(proposed)):
                    proposed = []  # no room for guesses: decode plainly rather than preempt anyone for them
            self.kv_cache.allocate_slots(request, num_new + len(proposed))
            out.chunks.append(self._chunk(request, num_new, proposed))
            budget -= num_new + len(proposed)
            i += 1

        # a step that had to preempt admits nobody: the blocks are short already
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted_ids:
            request = self.waiting[0]
            hit_block_ids, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if not self.kv_cache.can_allocate_slots(request, num_new, hit_block_ids):
                break
            self.waiting.popleft()
            self.kv_cache.allocate_slots(request, num_new, hit_block_ids)
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                self.num_prefix_query_tokens += request.num_prompt_tokens
                self.num_prefix_hit_tokens += num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        return out

    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: Mapping[str, Sequence[int]]
    ) -> list[TokenUpdate]:
        """Advance computed tokens by what the step computed; append each sampled chunk's tokens (a non-empty
        list per chunk with `sample`) in order; end finished requests.

        A request that stops at a token (eos, a stop token, its length) keeps the tokens up to and including
        that one; the rest of its list is dropped, and its update carries only the kept tokens.

        A chunk with guesses gains its accepted guesses (a prefix of `proposed_token_ids`) and one more token:
        the KV of those guesses is computed, the blocks past the computed tokens are freed.
        """
        updates = []
        for chunk in out.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(chunk.token_ids)
            self.kv_cache.cache_computed_blocks(request)
            if not chunk.sample:
                continue
            token_ids = sampled_token_ids[chunk.request_id]
            if not token_ids:
                raise ValueError(f"request {chunk.request_id!r} sampled no token: a sampled chunk gains >= 1")
            num_accepted = self._accepted(chunk, token_ids)
            if not request.output_token_ids:  # (KV that arrived, or a migrated request, brings output tokens)
                self.num_prompt_tokens += request.num_prompt_tokens
            kept: list[int] = []
            for token_id in token_ids:
                request.append_output_token(token_id)
                kept.append(token_id)
                status = request.check_stop(self.config.max_model_len)
                if status is not None:
                    self.finish_request(request.request_id, status)
                    break
            self.num_generation_tokens += len(kept)
            if num_accepted and not request.status.finished:  # the accepted guesses' KV was computed this step
                request.num_computed_tokens += num_accepted
                self.kv_cache.cache_computed_blocks(request)
            if self.speculator is not None and not request.status.finished:
                self.kv_cache.trim(request)  # the slots of rejected guesses (or of guesses a drafter did not make)
            updates.append(TokenUpdate(request.request_id, kept, request.status))
        return updates

    # -- helpers ---------------------------------------------------------------------------------

    def _accepted(self, chunk: ScheduledChunk, token_ids: Sequence[int]) -> int:
        """How many of the chunk's guesses its gained tokens accepted (recorded for metrics and back-off)."""
        if not chunk.proposed_token_ids:
            return 0
        num_accepted = len(token_ids) - 1
        if num_accepted > len(chunk.proposed_token_ids) or \
                list(token_ids[:num_accepted]) != chunk.proposed_token_ids[:num_accepted]:
            raise ValueError(f"request {chunk.request_id!r} gained {list(token_ids)}: must be a prefix of its guesses "
                             f"{chunk.proposed_token_ids} and one more token")
        if self.speculator is not None:
            self.speculator.record(chunk.request_id, len(chunk.proposed_token_ids), num_accepted)
        return num_accepted

    def _chunk(self, request: Request, num_new: int, proposed: list[int] | None = None) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new],
            start_position=start,
            block_ids=self.kv_cache.block_ids(request.request_id),
            sample=start + num_new == request.num_tokens,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            proposed_token_ids=proposed or [],
            eos_token_ids=request.eos_token_ids,
            grammar=request.grammar,
        )

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def check_integrity(self, other_holders: Iterable[Sequence[int]] = ()) -> None:
        """Scheduler and block accounting agree; called in test teardown and when idle."""
        self.kv_cache.check_integrity(other_holders)
        for request in self.running:
            assert request.status is RequestStatus.RUNNING, request
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request
            assert not self.kv_cache.block_ids(request.request_id), f"waiting {request.request_id} holds blocks"
        assert len(self.running) + len(self.waiting) == len(self.requests)
