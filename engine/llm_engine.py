"""The offline engine: validate and admit requests, step the engine core, detokenize, stop strings.

Contract: `add_request` either raises `InvalidRequestError` without touching any shared state, or
admits the request; so a bad request never disturbs the others. `step` runs one iteration of the
`EngineCore` and returns a `RequestOutput` (engine/outputs.py) for every request one of whose samples
gained tokens or finished in it, holding every sample's state so far. A request with `n` samples runs as
n engine requests (engine/parallel_sampling.py); its id and `abort_request` stand for all n.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_core import EngineCore, NewTokens
from engine.errors import InvalidRequestError
from engine.logprob import SampleLogprobs, position_logprobs
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestOutput
from engine.parallel_sampling import ParentRequest, child_params, child_request_id
from engine.prompt import Prompt, parse_prompt
from engine.request import Request, RequestStatus
from engine.runtime import build_runtime
from engine.sampling_params import SamplingParams
from engine.validation import check_request

log = logging.getLogger("duet.engine")


class _Tracked:
    """Engine-side state of one live sample: its detokenizer and output bookkeeping."""

    def __init__(self, request: Request, parent: ParentRequest, index: int, detokenizer: IncrementalDetokenizer):
        self.request = request
        self.parent = parent
        self.index = index
        self.detokenizer = detokenizer
        wants_logprobs = request.sampling_params.logprobs is not None
        self.logprobs: SampleLogprobs | None = [] if wants_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if wants_logprobs else None


class LLMEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.runtime = rt = build_runtime(model_dir, config)
        self.model_dir = rt.model_dir
        self.model_config = rt.model_config
        self.dtype = rt.dtype
        self.tokenizer = rt.tokenizer
        self.model_id = rt.model_id
        self.block_size = config.block_size
        self.model = rt.model
        self.max_model_len = rt.max_model_len
        self.num_kv_blocks = rt.num_kv_blocks
        self.block_pool = rt.block_pool
        self.kv_cache = rt.kv_cache
        self.core = EngineCore.from_runtime(rt)
        self.scheduler = rt.scheduler  # for statistics (num_preemptions, num_running): steps go through `core`
        self._tracked: dict[str, _Tracked] = {}  # by engine request id (one per sample)
        self._parents: dict[str, ParentRequest] = {}  # by the caller's request id
        self._ids = itertools.count()

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    # -- requests --------------------------------------------------------------------------------

    def make_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, cache_salt: str = ""
    ) -> ParentRequest:
        """Validate and tokenize a prompt in any form engine/prompt.py accepts; raises `InvalidRequestError`
        naming the field. Touches no engine state: `add` admits the result."""
        params = params or SamplingParams()
        parsed = parse_prompt(prompt)
        if parsed.cache_salt and cache_salt and parsed.cache_salt != cache_salt:
            raise InvalidRequestError("cache_salt", parsed.cache_salt, f"differs from cache_salt={cache_salt!r}")
        token_ids = parsed.token_ids if parsed.token_ids is not None else self.tokenizer.encode(parsed.text)
        check_request(
            token_ids, params, vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
            max_logprobs=self.config.max_logprobs,
        )
        if params.structured_output is not None:  # compiled on the caller's thread, not inside a step
            self.core.grammar_compiler.prepare(params.structured_output)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        child_ids = [child_request_id(request_id, i, params.n) for i in range(params.n)]
        for rid in (request_id, *child_ids):
            if rid in self._parents or rid in self._tracked:
                raise InvalidRequestError("request_id", rid, "must not be the id of a live request")
        children = [
            Request(request_id=rid, prompt_token_ids=token_ids, sampling_params=child_params(params, i),
                    eos_token_ids=self.tokenizer.eos_token_ids, cache_salt=parsed.cache_salt or cache_salt)
            for i, rid in enumerate(child_ids)
        ]
        # a sibling can take the prompt's full blocks from the cache if there is one before the last token
        share = params.n > 1 and self.config.enable_prefix_caching and len(token_ids) > self.block_size
        return ParentRequest(request_id, parsed.text, children, share_prefill=share)

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, cache_salt: str = ""
    ) -> str:
        return self.add(self.make_request(prompt, params, request_id, cache_salt))

    def add(self, parent: ParentRequest) -> str:
        """Admit a request made by `make_request`; its id."""
        self._parents[parent.request_id] = parent
        self._admit(parent, parent.admit_first())
        return parent.request_id

    def _admit(self, parent: ParentRequest, indexes: range) -> None:
        for index in indexes:
            request = parent.children[index]
            detokenizer = IncrementalDetokenizer.for_request(self.tokenizer, request.prompt_token_ids,
                                                             request.sampling_params)
            self.core.add_request(request)
            self._tracked[request.request_id] = _Tracked(request, parent, index, detokenizer)

    def abort_request(self, request_id: str) -> bool:
        """End a request (all its samples) now and free its blocks; False if it is not live."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return False
        for request in parent.children[: parent.num_admitted]:
            if self._tracked.pop(request.request_id, None) is not None:
                self.core.abort(request.request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    # -- one iteration ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        new_tokens = self.core.step()
        now = time.monotonic()
        changed: dict[str, ParentRequest] = {}
        for new in new_tokens:
            tracked = self._tracked[new.request_id]
            tracked.parent.update(self._take(tracked, new), now)
            changed[tracked.parent.request_id] = tracked.parent
        outputs = []
        for parent in changed.values():
            if parent.ready_for_rest():
                self._admit(parent, parent.admit_rest())
            if parent.finished:
                del self._parents[parent.request_id]
            outputs.append(parent.request_output())
        if not self._parents:
            self._check_idle()
        return outputs

    def _take(self, tracked: _Tracked, new: NewTokens) -> CompletionOutput:
        """Detokenize a sample's new tokens one by one; a stop string found at token k ends the sample
        there (tokens after k are dropped from its output)."""
        request = tracked.request
        detok = tracked.detokenizer
        num_kept = len(new.token_ids)
        for k, token_id in enumerate(new.token_ids):
            if tracked.logprobs is not None:
                tracked.logprobs.append(position_logprobs(new.logprobs[k], self._token_text))
                tracked.cumulative_logprob += new.logprobs[k].logprob
            detok.add_token(token_id)
            if detok.stop_matched is not None:
                num_kept = k + 1
                if not request.status.finished:
                    self.core.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = detok.stop_matched
                break
        else:
            if request.status.finished:
                detok.flush()
        num_dropped = len(new.token_ids) - num_kept
        if request.status.finished:
            del self._tracked[request.request_id]
        return CompletionOutput(
            index=tracked.index,
            text=detok.text,
            token_ids=request.output_token_ids[: len(request.output_token_ids) - num_dropped],
            cumulative_logprob=tracked.cumulative_logprob,
            logprobs=list(tracked.logprobs) if tracked.logprobs is not None else None,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            error=new.error,
        )

    def _token_text(self, token_id: int) -> str:
        """A token's text alone, as vLLM decodes a logprob's token (special tokens kept)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _check_idle(self) -> None:
        """Idle: every block must be back in the pool (the O(1) part of `check_integrity`)."""
        pool = self.block_pool
        if pool.num_free_blocks != pool.num_blocks or self.core.num_requests:
            raise AssertionError(
                f"idle engine holds {pool.num_blocks - pool.num_free_blocks} blocks "
                f"and {self.core.num_requests} requests: a leak"
            )

    def close(self) -> None:
        """Release what outlives a call: the tensor-parallel follower processes (no-op at tp_size 1)."""
        self.runtime.close()

    def check_integrity(self) -> None:
        self.core.check_integrity()
