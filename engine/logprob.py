"""Logprobs as vLLM's offline API returns them: per generated token, a dict token id -> `Logprob`.

    CompletionOutput.logprobs = [                      one dict per generated token, in order
        {sampled_id: Logprob(-0.11, rank=1, decoded_token=" Paris"),   the sampled token first,
         other_id:   Logprob(-2.70, rank=2, decoded_token=" Lyon")},   then the top-k (ranks 1..k)
        ...
    ]

The sampled token's rank is its rank in the whole vocabulary (tied tokens share the better rank); when it
is among the top-k it appears once, with its top-k rank. Logprobs are of the raw distribution (before
temperature, penalties and logit bias), as vLLM's default `logprobs_mode`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.sampler import TokenLogprobs


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None  # the token's text alone


SampleLogprobs = list[dict[int, Logprob]]


def position_logprobs(lp: TokenLogprobs, token_text: Callable[[int], str]) -> dict[int, Logprob]:
    """One generated token's entry: the sampled token, then the top-k best first."""
    entry = {lp.token_id: Logprob(lp.logprob, lp.rank, token_text(lp.token_id))}
    for rank, (token_id, logprob) in enumerate(lp.top, start=1):
        entry[token_id] = Logprob(logprob, rank, token_text(token_id))
    return entry
