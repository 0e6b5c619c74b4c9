"""The OpenAI request bodies duet serves, as pydantic models, and their public GenerateRequest.

What is judged here: JSON types, and the integer ranges the wire carries (int64, uint64 for `seed`), so no
value can overflow a protobuf field. Value ranges (temperature >= 0, top_p in (0, 1], ...) are judged once,
by the engine's `SamplingParams` behind the router's Generate, for every entry point alike. Fields OpenAI
defines that duet does not serve yet are issue 17's to add one by one; unknown fields are kept (not
refused) until then, as before.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from duet.v1 import generation_pb2 as pb
from router.structured_request import ResponseFormat

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
UInt64 = Annotated[int, Field(ge=0, le=2**64 - 1)]
MAX_TIMEOUT_S = 24 * 3600.0

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed")


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: UInt64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    ignore_eos: bool = False  # vLLM's extension
    request_id: str | None = None  # duet's: the id the router and workers log, and the response's "id"
    timeout: Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)] | None = None  # duet's: seconds, the deadline
    response_format: ResponseFormat | None = None  # router/structured_request.py


class CompletionRequest(_Request):
    prompt: str | list[Int64]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[dict] | None = None  # router/structured_request.py
    tool_choice: str | dict | None = None


def to_generate_request(body: CompletionRequest | ChatCompletionRequest) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(request_id=body.request_id or "")
    if isinstance(body, ChatCompletionRequest):
        for m in body.messages:
            msg.chat.messages.add(role=m.role, content=m.content)
    elif isinstance(body.prompt, str):
        msg.text = body.prompt
    else:
        msg.token_ids.ids.extend(body.prompt)
    for name in SAMPLING_FIELDS:
        value = getattr(body, name)
        if value is not None:
            setattr(msg.sampling, name, value)
    if body.stop is not None:
        msg.sampling.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    msg.sampling.ignore_eos = body.ignore_eos
    return msg
