"""One prompt's `SamplingParams.n` samples: n engine requests that share one prefill.

Each sample is its own engine request (the scheduler never knows they are siblings). Sample i's id is
`"{i}_{request_id}"` for n > 1 (vLLM's child ids; with n = 1 the one sample keeps the request's id), and
with a seed it samples with `seed + i`, vLLM's rule (vllm/v1/engine/parallel_sampling.py), so sample i of
`n=4, seed=s` gives the tokens `n=1, seed=s+i` gives. Without a seed each sample draws its own noise.

Sharing the prompt: sample 0 is admitted first; samples 1..n-1 wait until sample 0 has computed the prompt
(its first token came out, or it ended), so the prompt's full blocks are in the prefix cache and each
sibling computes only what is past them (the prompt's last partial block and at least one token: the one
whose logits give its first token). Admitted together, the n would each prefill the whole prompt in the
same step, since blocks join the prefix cache only once computed. When nothing can be shared (prefix
caching off, or a prompt shorter than one block plus a token) all n are admitted at once.
"""

from __future__ import annotations

import dataclasses

from engine.errors import InvalidRequestError
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.request import Request
from engine.sampling_params import MAX_SEED, SamplingParams


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s parameters: n = 1, and seed + index when seeded."""
    if params.n == 1:
        return params
    if params.seed is not None and params.seed + params.n - 1 > MAX_SEED:
        raise InvalidRequestError("seed", params.seed, f"must be at most {MAX_SEED - params.n + 1} with "
                                                       f"n={params.n}: sample i samples with seed + i")
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


class ParentRequest:
    """A validated prompt's samples and their latest outputs; made by `LLMEngine.make_request`.

    Contract: `children[i]` is sample i's engine request. `admit_first` and `admit_rest` hand out each index
    exactly once: first sample 0, then (once `ready_for_rest`) the others; `children[:num_admitted]` were
    handed out.
    """

    def __init__(self, request_id: str, prompt: str | None, children: list[Request], share_prefill: bool):
        assert children, "a request has at least one sample"
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = children[0].prompt_token_ids
        self.children = children
        self.share_prefill = share_prefill
        self.num_admitted = 0
        self.outputs = [CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=None, logprobs=None)
                        for i in range(len(children))]
        self.metrics = RequestMetrics(arrival_time_s=children[0].arrival_time_s)

    @property
    def n(self) -> int:
        return len(self.children)

    def admit_first(self) -> range:
        """The sample indexes to admit now: 0 alone when the siblings can share its prefill, else all."""
        assert self.num_admitted == 0
        self.num_admitted = 1 if self.share_prefill else self.n
        return range(self.num_admitted)

    def ready_for_rest(self) -> bool:
        """Sample 0 has computed the prompt (its first output came), and siblings still wait."""
        first = self.outputs[0]
        return self.num_admitted < self.n and (bool(first.token_ids) or first.finished())

    def admit_rest(self) -> range:
        rest = range(self.num_admitted, self.n)
        self.num_admitted = self.n
        return rest

    def update(self, completion: CompletionOutput, now: float) -> None:
        self.outputs[completion.index] = completion
        if completion.token_ids and self.metrics.first_token_time_s is None:
            self.metrics.first_token_time_s = now
        if self.finished:
            self.metrics.finished_time_s = now

    @property
    def finished(self) -> bool:
        return all(out.finished() for out in self.outputs)

    def request_output(self) -> RequestOutput:
        """Every sample's state so far (cumulative), in index order."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=list(self.outputs),
            finished=self.finished,
            num_cached_tokens=self.outputs[0].num_cached_tokens,
            metrics=dataclasses.replace(self.metrics),
        )
