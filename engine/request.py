"""A request as the scheduler sees it: tokens known, tokens computed, and how it ends.

The scheduler thinks in tokens, not phases. `num_computed_tokens` counts tokens whose KV is in the
cache; `num_tokens` counts tokens known (prompt + generated). A step moves `num_computed_tokens`
forward; when it reaches `num_tokens` the model samples the next token. Prefill, a chunk of prefill,
a prefix-cache hit, KV arriving from a prefill worker and a decode step are all that one move.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.grammar_state import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV dropped; it will be recomputed
    FINISHED_STOPPED = "stop"  # eos, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the request failed on its own in a step (its sampling raised); the others went on
    FINISHED_HANDED_OFF = "handed_off"  # a prefill worker's part is done: a decode worker continues it

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


# a plain attribute, not a property: it is read for every request on every step
for _status in RequestStatus:
    _status.finished = _status.name.startswith("FINISHED")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str = ""
    arrival_time_s: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first scheduling
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # structured output: where the output is in its grammar; the engine core sets it on admission (replaying
    # output_token_ids) and advances it with every accepted token
    grammar: GrammarState | None = None

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "a request needs at least one prompt token"
        self._all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens. Read-only view: do not mutate."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the last generated token implies, if any (stop strings are the engine's)."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if last in params.stop_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and last in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
