"""The decode worker choice: send a request where its KV is cheapest to make whole, given the load there.

Pure logic, no gRPC and no Redis, in the style of router/prefix_policy.py: the router hands it one
`DecodeState` per decode worker (the index's count of leading prompt blocks each holds from earlier turns,
and its load) and gets the workers ranked, best first; Reserve tries them in that order.

    cost on worker w  =  (prompt_tokens - cached_tokens(w)) / kv_tokens_per_s     KV it must be sent
                      +  num_requests(w) * request_s                              requests already there

A worker's cached tokens are KV that needs no transfer (and, with conditional disaggregation, no prefill:
`prefills_locally` below);
each request already there slows every decode step a little. Equal costs go to the worker with more free
blocks, then at random: never by list order. With no cache anywhere this is exactly load_policy.rank_decode's
order (fewest requests, then most free blocks). The two constants are estimates, not measurements: a cached
token saves its prefill and its transfer (`kv_tokens_per_s`, prefix_policy's default prefill speed), and
`request_s` prices one more request in the batch at 5 ms, so 100 cached tokens outweigh one request.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeState:
    worker_id: str
    cached_tokens: int  # leading prompt tokens this worker holds in its prefix cache (from the index)
    num_requests: int  # running + waiting (incl. reservations) now: load_policy.Candidate.num_requests
    num_free_blocks: int


@dataclass(frozen=True)
class DecodePolicyConfig:
    kv_tokens_per_s: float = 20_000.0  # what one cached token saves: its prefill and its transfer
    request_s: float = 0.005  # what one more request in the worker's batch costs this one

    def __post_init__(self) -> None:
        if not self.kv_tokens_per_s > 0:
            raise ValueError(f"kv_tokens_per_s={self.kv_tokens_per_s} is invalid: must be > 0")
        if self.request_s < 0:
            raise ValueError(f"request_s={self.request_s} is invalid: must be >= 0")


def decode_cost_s(prompt_tokens: int, worker: DecodeState, config: DecodePolicyConfig) -> float:
    cached_tokens = min(worker.cached_tokens, prompt_tokens)
    return (prompt_tokens - cached_tokens) / config.kv_tokens_per_s + worker.num_requests * config.request_s


def rank_decode(prompt_tokens: int, workers: Sequence[DecodeState], config: DecodePolicyConfig | None = None,
                rng: random.Random | None = None) -> list[str]:
    """Worker ids, cheapest first (see the module docstring)."""
    config = config or DecodePolicyConfig()
    rng = rng or random.Random()
    keyed = [((decode_cost_s(prompt_tokens, w, config), -w.num_free_blocks), rng.random(), w.worker_id)
             for w in workers]
    return [worker_id for *_, worker_id in sorted(keyed)]


def prefills_locally(prompt_tokens: int, cached_tokens: int, local_prefill_tokens: int) -> bool:
    """Conditional disaggregation: whether the decode worker that holds `cached_tokens` of the prompt computes the
    rest itself (fewer than `local_prefill_tokens` uncached: the prefill worker's round trip and KV transfer would
    cost more than the suffix's forward pass in the decode batch) instead of a prefill worker. 0 disables it."""
    return prompt_tokens - min(cached_tokens, prompt_tokens) < local_prefill_tokens
