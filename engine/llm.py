"""Offline API: `LLM(model_dir).generate(prompts, params)` and its streaming twin."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import fields
from pathlib import Path

from engine.config import EngineConfig
from engine.default_model import model_or_default
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, Prompt
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}


class LLM:
    """An engine in this process. `model` is a Hugging Face checkpoint directory or a .gguf file; None uses the
    embedded default, SmolLM2-135M-Instruct (engine/default_model.py). Keyword arguments are `EngineConfig` fields."""

    def __init__(self, model: str | Path | None = None, **engine_args):
        unknown = set(engine_args) - _ENGINE_FIELDS
        if unknown:
            raise TypeError(f"unknown engine arguments {sorted(unknown)}: allowed are {sorted(_ENGINE_FIELDS)}")
        model = model_or_default(model)
        self.engine = LLMEngine(model, EngineConfig(**engine_args))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop tensor-parallel follower processes (with tp_size > 1); the LLM is unusable afterwards."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion as one continuously batched workload; outputs in prompt order."""
        request_ids = self._admit(prompts, sampling_params)
        final = {out.request_id: out for out in self._drain(request_ids) if out.finished}
        return [final[rid] for rid in request_ids]

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield each step's `RequestOutput` (with `new_text` / `new_token_ids` deltas) as tokens arrive.

        Every prompt is validated before any is admitted: a bad one raises `InvalidRequestError`
        naming `prompts[i]` and nothing runs. Closing the iterator early aborts what is left.
        """
        yield from self._drain(self._admit(prompts, sampling_params))

    def _admit(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[str]:
        """Validate every prompt, then admit them all; their request ids in prompt order."""
        batch = _as_batch(prompts)
        params = _params_for(batch, sampling_params)
        requests = []
        for i, (prompt, p) in enumerate(zip(batch, params)):
            try:
                requests.append(self.engine.make_request(prompt, p))
            except InvalidRequestError as e:
                raise InvalidRequestError(f"prompts[{i}].{e.field}", e.value, e.allowed) from None
        return [self.engine.add(request) for request in requests]

    def _drain(self, request_ids: list[str]) -> Iterator[RequestOutput]:
        """Step the engine until these requests finish; abort the rest if the consumer stops early."""
        live = set(request_ids)
        try:
            while live:
                for out in self.engine.step():
                    if out.request_id in live:
                        if out.finished:
                            live.discard(out.request_id)
                        yield out
        finally:
            for request_id in live:
                self.engine.abort_request(request_id)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, with the checkpoint's chat template applied."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template_ids(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise InvalidRequestError("prompts", prompts, "must hold at least one prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _params_for(batch: list[Prompt], params: SamplingParams | Sequence[SamplingParams] | None) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * len(batch)
    params = list(params)
    if len(params) != len(batch):
        raise InvalidRequestError("sampling_params", f"{len(params)} items", f"must be one per prompt ({len(batch)})")
    return params
