"""What the offline API returns, shaped as vLLM's `RequestOutput` / `CompletionOutput` where names overlap.

    RequestOutput                       one prompt
      .prompt, .prompt_token_ids        the text given (None for token ids) and the tokens run
      .outputs[i]: CompletionOutput     sample i of SamplingParams.n, in index order
        .text, .token_ids               generated so far (cut exactly at a stop string)
        .cumulative_logprob, .logprobs  when SamplingParams.logprobs is set, else None (engine/logprob.py)
        .finish_reason, .stop_reason    "stop" | "length" | "abort" | "error"; the stop token id or string
      .finished                         every sample is finished
      .num_cached_tokens                prompt tokens sample 0 took from the prefix cache
      .metrics                          arrival, first-token and finish times (time.monotonic clock)

`LLM.generate` returns finished outputs, all n samples each. `LLM.generate_stream` yields deltas (vLLM's
`RequestOutputKind.DELTA`): each yield holds only the samples that progressed in that engine step, with only
that step's text, token ids and logprobs (cumulative_logprob stays cumulative); concatenating a sample's
deltas gives its final output. Fields past vLLM's (`num_cached_tokens` and `error` per sample) are duet's.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.logprob import SampleLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs, when logprobs are asked for
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # once finished: "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string; None for eos or length
    num_cached_tokens: int = 0  # prompt tokens this sample took from the prefix cache (samples 1..n-1 share 0's)
    error: str | None = None  # finish_reason "error": why this sample failed (the others went on)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time_s: float  # time.monotonic() clock
    first_token_time_s: float | None = None  # the first token of any sample
    finished_time_s: float | None = None  # the last sample finished

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time_s is None else self.first_token_time_s - self.arrival_time_s


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.metrics is None else self.metrics.ttft_s
