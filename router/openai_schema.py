"""The OpenAI request bodies duet serves, as pydantic models, and the public GenerateRequests they become.

What is judged here: JSON types, the integer ranges the wire carries (int64, uint64 for `seed`), so no value can
overflow a protobuf field, and what only makes sense over HTTP (`top_logprobs` needs `logprobs`, `content: null`
only for an assistant, `stream_options` only when streaming). Value ranges (temperature >= 0, top_p in (0, 1],
...) are judged once, by the engine's `SamplingParams` behind the router's Generate, for every entry point alike.

Every parameter OpenAI documents is either a field here, implemented as OpenAI and vLLM define it, or refused:
the models forbid unknown fields, so a parameter duet does not implement (`suffix`, `audio`, `prediction`, ...)
is a 400 that names it, never silently dropped. `user` is accepted (OpenAI's end-user id for abuse monitoring:
nothing for duet to do with it). vLLM's extensions that map to duet's sampling parameters (top_k,
min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos, ...) and `cache_salt` are accepted too.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from duet.v1 import generation_pb2 as pb
from engine.sampling_params import MAX_SEED
from router.structured_request import ResponseFormat

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
UInt64 = Annotated[int, Field(ge=0, le=2**64 - 1)]
MAX_TIMEOUT_S = 24 * 3600.0
MAX_CHOICES = 128  # prompts x n in one request: each choice is a request on the cluster
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs (and the router's max_logprobs)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "min_tokens")
FLAG_FIELDS = ("ignore_eos", "include_stop_str_in_output")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with `usage` and no choices; every other chunk has usage null


class _Request(_Body):
    model: str | None = None  # None: the served model
    max_tokens: Int64 | None = None  # None: what is left of the context after the prompt
    min_tokens: Int64 | None = None  # vLLM's
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None  # vLLM's
    min_p: float | None = None  # vLLM's
    repetition_penalty: float | None = None  # vLLM's
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: UInt64 | None = None  # with n > 1, choice i samples with seed + i (vLLM's rule)
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None  # vLLM's
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    logit_bias: dict[Int64, float] | None = None  # token id (a JSON string key, parsed) -> bias in [-100, 100]
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's
    include_stop_str_in_output: bool = False  # vLLM's
    skip_special_tokens: bool | None = None  # vLLM's
    user: str | None = None  # accepted, unused (see the module docstring)
    cache_salt: str | None = None  # vLLM's: isolates prefix-cache reuse (e.g. per tenant)
    request_id: str | None = None  # duet's: the id the router and workers log, and the response's "id"
    timeout: Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)] | None = None  # duet's: seconds, the deadline
    response_format: ResponseFormat | None = None  # structured outputs: router/structured_request.py

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:  # as the offline engine judges it
            raise ValueError(f"seed={self.seed} is invalid: must be at most {MAX_SEED - self.n + 1} with n={self.n}: "
                             "sample i samples with seed + i")
        return self

    def sampling(self) -> pb.SamplingParams:
        """The sampling parameters every choice shares (each choice's seed is set by the caller)."""
        msg = pb.SamplingParams()
        max_tokens = self.max_tokens
        if isinstance(self, ChatCompletionRequest) and self.max_completion_tokens is not None:
            max_tokens = self.max_completion_tokens  # OpenAI's newer name wins, as in vLLM
        if max_tokens is not None:
            msg.max_tokens = max_tokens
        for name in SAMPLING_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(msg, name, value)
        for name in FLAG_FIELDS:
            setattr(msg, name, getattr(self, name))
        if self.skip_special_tokens is not None:
            msg.skip_special_tokens = self.skip_special_tokens
        if self.stop is not None:
            msg.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop)
        msg.stop_token_ids.extend(self.stop_token_ids or ())
        msg.logit_bias.update(self.logit_bias or {})
        top_n = self.top_logprobs_wanted()
        if top_n is not None:
            msg.logprobs = top_n
        return msg

    def top_logprobs_wanted(self) -> int | None:
        raise NotImplementedError


class CompletionRequest(_Request):
    # one prompt (text or token ids) or a list of them
    prompt: str | Annotated[list[str], Field(min_length=1)] | Annotated[list[Int64], Field(min_length=1)] | \
        Annotated[list[Annotated[list[Int64], Field(min_length=1)]], Field(min_length=1)]
    echo: bool = False  # the prompt's text before each choice's text
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # top-n per token (+ the sampled one)
    best_of: Annotated[int, Field(ge=1)] | None = None  # only best_of == n (the same thing): no server-side ranking

    @model_validator(mode="after")
    def _check(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported: duet returns every sample; leave best_of "
                             f"unset or equal to n={self.n}")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported: it asks for the prompt's logprobs, which duet "
                             "does not compute; use echo or logprobs")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(self.prompts())} prompts x n={self.n} choices is too many: at most {MAX_CHOICES}")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, Field(validate_default=True)] = None
    name: str | None = None  # OpenAI's participant name: accepted, as most chat templates have no place for it
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content")
    @classmethod
    def _content_null_only_for_assistant(cls, content, info: ValidationInfo):
        role = info.data.get("role")
        if content is None and role != "assistant":
            raise ValueError(f"content is required for role {role!r} (null only for an assistant message)")
        return content

    def text(self) -> str:
        """The content as one string: text parts joined with newlines (as vLLM), null as ""."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Int64 | None = None
    tools: list[dict] | None = None  # router/structured_request.py: the template renders them, calls are parsed
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (router/structured_request.py)
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: bool = True  # vLLM's

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def to_generate_requests(body: CompletionRequest | ChatCompletionRequest) -> list[pb.GenerateRequest]:
    """One GenerateRequest per prompt (a chat is one prompt), without request id or per-choice seed."""
    sampling = body.sampling()
    salt = body.cache_salt or ""
    if isinstance(body, ChatCompletionRequest):
        msg = pb.GenerateRequest(sampling=sampling, cache_salt=salt)
        for m in body.messages:
            # OpenAI's "developer" role is the system role of newer models; templates know "system"
            added = msg.chat.messages.add(role="system" if m.role == "developer" else m.role, content=m.text(),
                                          tool_call_id=m.tool_call_id or "")
            if m.tool_calls:
                added.tool_calls_json = json.dumps([call.model_dump() for call in m.tool_calls])
        msg.chat.add_generation_prompt = body.add_generation_prompt
        return [msg]
    out = []
    for prompt in body.prompts():
        msg = pb.GenerateRequest(sampling=sampling, cache_salt=salt)
        if isinstance(prompt, str):
            msg.text = prompt
        else:
            msg.token_ids.ids.extend(prompt)
        out.append(msg)
    return out



class TokenizeRequest(_Body):
    """vLLM's /tokenize body: a prompt, or chat messages (the template applied as for a chat completion)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True  # for a prompt (a chat's template places its own special tokens)
    add_generation_prompt: bool = True
    tools: list[dict] | None = None  # with messages: rendered by the template, as for a chat completion
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Int64]
