"""The offline engine: validate and admit requests, step the engine core, detokenize, stop strings.

Contract: `add_request` either raises `InvalidRequestError` without touching any shared state, or
admits the request; so a bad request never disturbs the others. `step` runs one iteration of the
`EngineCore` and returns a `RequestOutput` for every request that gained tokens or finished in it.
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
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.runtime import build_runtime
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.validation import check_request

log = logging.getLogger("duet.engine")

Prompt = str | list[int]


class _Tracked:
    """Engine-side state of one live request: its detokenizer and output bookkeeping."""

    def __init__(self, request: Request, detokenizer: IncrementalDetokenizer):
        self.request = request
        self.detokenizer = detokenizer
        self.logprobs: list[TokenLogprobs] | None = [] if request.sampling_params.logprobs is not None else None
        self.first_token_time_s: float | None = None


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
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    # -- requests --------------------------------------------------------------------------------

    def make_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, cache_salt: str = ""
    ) -> Request:
        """Validate and tokenize; raises `InvalidRequestError` naming the field. Touches no engine state."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", prompt, "must be a non-empty string or list of token ids")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
        else:
            raise InvalidRequestError("prompt", prompt, "must be a string or a list of token ids")
        check_request(
            token_ids, params, vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
            max_logprobs=self.config.max_logprobs,
        )
        if params.structured_output is not None:  # compiled on the caller's thread, not inside a step
            self.core.grammar_compiler.prepare(params.structured_output)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif request_id in self._tracked:
            raise InvalidRequestError("request_id", request_id, "must not be the id of a live request")
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.tokenizer.eos_token_ids,
            cache_salt=cache_salt,
        )

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, cache_salt: str = ""
    ) -> str:
        return self.add(self.make_request(prompt, params, request_id, cache_salt))

    def add(self, request: Request) -> str:
        """Admit a request made by `make_request`."""
        detokenizer = IncrementalDetokenizer.for_request(self.tokenizer, request.prompt_token_ids,
                                                         request.sampling_params)
        self.core.add_request(request)
        self._tracked[request.request_id] = _Tracked(request, detokenizer)
        return request.request_id

    def abort_request(self, request_id: str) -> bool:
        """End a request now and free its blocks; False if it is not live."""
        if self._tracked.pop(request_id, None) is None:
            return False
        self.core.abort(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    # -- one iteration ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        new_tokens = self.core.step()
        now = time.monotonic()
        outputs = [self._take(self._tracked[new.request_id], new, now) for new in new_tokens]
        if not self._tracked:
            self._check_idle()
        return outputs

    def _take(self, tracked: _Tracked, new: NewTokens, now: float) -> RequestOutput:
        """Detokenize a request's new tokens one by one; a stop string found at token k ends the request
        there (tokens after k are dropped from its output)."""
        request = tracked.request
        if tracked.first_token_time_s is None:
            tracked.first_token_time_s = now
        detok = tracked.detokenizer
        delta = ""
        num_kept = len(new.token_ids)
        for k, token_id in enumerate(new.token_ids):
            if tracked.logprobs is not None:
                tracked.logprobs.append(new.logprobs[k])
            delta += detok.add_token(token_id)
            if detok.stop_matched is not None:
                num_kept = k + 1
                if not request.status.finished:
                    self.core.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = detok.stop_matched
                break
        else:
            if request.status.finished:
                delta += detok.flush()
        num_dropped = len(new.token_ids) - num_kept
        token_ids = request.output_token_ids[: len(request.output_token_ids) - num_dropped]
        output = self._output(tracked, token_ids, new.token_ids[:num_kept], delta, now, new.error)
        if request.status.finished:
            del self._tracked[request.request_id]
        return output

    def _check_idle(self) -> None:
        """Idle: every block must be back in the pool (the O(1) part of `check_integrity`)."""
        pool = self.block_pool
        if pool.num_free_blocks != pool.num_blocks or self.core.num_requests:
            raise AssertionError(
                f"idle engine holds {pool.num_blocks - pool.num_free_blocks} blocks "
                f"and {self.core.num_requests} requests: a leak"
            )

    def _output(self, tracked: _Tracked, token_ids: list[int], new_token_ids: list[int], new_text: str,
                now: float, error: str | None = None) -> RequestOutput:
        request = tracked.request
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=token_ids,
            text=tracked.detokenizer.text,
            new_token_ids=new_token_ids,
            new_text=new_text,
            finished=request.status.finished,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=list(tracked.logprobs) if tracked.logprobs is not None else None,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            arrival_time_s=request.arrival_time_s,
            first_token_time_s=tracked.first_token_time_s,
            finished_time_s=now if request.status.finished else None,
            error=error,
        )

    def close(self) -> None:
        """Release what outlives a call: the tensor-parallel follower processes (no-op at tp_size 1)."""
        self.runtime.close()

    def check_integrity(self) -> None:
        self.core.check_integrity()
