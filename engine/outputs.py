"""What the engine returns per request per step: cumulative tokens and text, plus this step's delta."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampler import TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    text: str  # generated text so far; cut exactly at a stop string
    new_token_ids: list[int]  # this step's tokens
    new_text: str  # this step's text delta
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" (see `error`), once finished
    stop_reason: int | str | None  # the stop token id or stop string; None for eos or length
    logprobs: list[TokenLogprobs] | None  # one per generated token, when asked for
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    arrival_time_s: float  # time.monotonic() clock
    first_token_time_s: float | None
    finished_time_s: float | None
    error: str | None = None  # finish_reason "error": why this request failed (the others went on)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time_s is None else self.first_token_time_s - self.arrival_time_s
