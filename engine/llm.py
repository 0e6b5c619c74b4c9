"""Offline API, vLLM's where names overlap: `LLM(model_dir).generate(prompts, params)` returns one
`RequestOutput` per prompt (`outputs[0].outputs[0].text`), `chat`, `get_tokenizer`, and `generate_stream`,
duet's streaming twin (deltas)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from tqdm import tqdm

from engine.config import EngineConfig
from engine.default_model import model_or_default
from engine.errors import InvalidRequestError
from engine.hf_style_tokenizer import HFStyleTokenizer
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.parallel_sampling import ParentRequest
from engine.prompt import Prompt, as_prompt_batch
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


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

    def get_tokenizer(self) -> HFStyleTokenizer:
        """The engine's tokenizer with a Hugging Face tokenizer's signatures and defaults (as vLLM's
        `get_tokenizer()`): `encode`, `decode`, `apply_chat_template`, ... (engine/hf_style_tokenizer.py)."""
        return HFStyleTokenizer(self.engine.tokenizer)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion as one continuously batched workload; outputs in prompt order,
        each holding its `sampling_params.n` samples in index order.

        `prompts`: one prompt or a list, each a string, `{"prompt": text}`, `{"prompt_token_ids": ids}` (vLLM's
        forms; either dict may add "cache_salt") or a bare list of token ids (engine/prompt.py). Every prompt is
        validated before any is admitted: a bad one raises `InvalidRequestError` naming `prompts[i]` and
        nothing runs. `use_tqdm`: a progress bar over prompts on stderr (as vLLM's).
        """
        parents = self._admit(prompts, sampling_params)
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(parents), desc="Processed prompts", unit="prompt", disable=not use_tqdm) as bar:
            for out in self._drain([p.request_id for p in parents]):
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        return [final[p.request_id] for p in parents]

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield deltas as tokens arrive (vLLM's `RequestOutputKind.DELTA`): per engine step, a `RequestOutput`
        for each prompt that progressed, its `outputs` holding only the samples that progressed, each with
        only this step's `text`, `token_ids` and `logprobs` (`cumulative_logprob` stays cumulative; the
        last delta of a sample carries its `finish_reason`). `finished` is True on a prompt's last yield.

        Prompts as in `generate`; every one is validated before any is admitted. Closing the iterator early
        aborts what is left.
        """
        parents = self._admit(prompts, sampling_params)
        sent: dict[tuple[str, int], CompletionOutput] = {}  # what the caller has of each sample so far
        for out in self._drain([p.request_id for p in parents]):
            deltas = []
            for sample in out.outputs:
                before = sent.get((out.request_id, sample.index))
                delta = _delta(sample, before)
                if delta is not None:
                    deltas.append(delta)
                    sent[(out.request_id, sample.index)] = sample
            yield dataclasses.replace(out, outputs=deltas)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the checkpoint's chat template applied
        (as vLLM's `chat`); `RequestOutput.prompt` is the rendered template. `chat_template_kwargs` are
        variables for the template (e.g. `enable_thinking`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt, **(chat_template_kwargs or {}))
            prompts.append(_ChatPrompt(text, tokenizer.encode(text, add_special_tokens=False)))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _admit(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[ParentRequest]:
        """Validate every prompt, then admit them all; in prompt order."""
        batch = as_prompt_batch(prompts)
        params = _params_for(batch, sampling_params)
        parents = []
        for i, (prompt, p) in enumerate(zip(batch, params)):
            try:
                if isinstance(prompt, _ChatPrompt):  # the template wrote any BOS: the ids go in as they are
                    parent = self.engine.make_request(prompt.token_ids, p)
                    parent.prompt = prompt.text
                else:
                    parent = self.engine.make_request(prompt, p)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"prompts[{i}].{e.field}", e.value, e.allowed) from None
            parents.append(parent)
        for parent in parents:
            self.engine.add(parent)
        return parents

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


class _ChatPrompt(NamedTuple):
    text: str  # the rendered chat template
    token_ids: list[int]


def _delta(sample: CompletionOutput, before: CompletionOutput | None) -> CompletionOutput | None:
    """What `sample` (cumulative) adds to `before` (None: nothing sent yet); None when it adds nothing."""
    if before is None:
        before = CompletionOutput(sample.index, "", [], None, [] if sample.logprobs is not None else None)
    if len(sample.token_ids) == len(before.token_ids) and sample.finished() == before.finished():
        return None
    return dataclasses.replace(
        sample,
        text=sample.text[len(before.text):],
        token_ids=sample.token_ids[len(before.token_ids):],
        logprobs=None if sample.logprobs is None else sample.logprobs[len(before.logprobs):],
    )


def _params_for(batch: list, params: SamplingParams | Sequence[SamplingParams] | None) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * len(batch)
    params = list(params)
    if len(params) != len(batch):
        raise InvalidRequestError("sampling_params", f"{len(params)} items", f"must be one per prompt ({len(batch)})")
    return params
