"""A public `GenerateRequest` to prompt token ids and engine `SamplingParams`, judged once, here, with the
engine's own checks (same tokenizer, same chat template, `check_request`). Raises `InvalidRequestError`."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.proto_convert import sampling_from_proto
from duet.v1 import generation_pb2 as pb
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from engine.validation import check_request

MAX_REQUEST_ID_CHARS = 256


@dataclass(frozen=True)
class BuiltRequest:
    """A public request judged valid: its prompt as token ids, its sampling parameters as the engine takes
    them, and the same parameters in wire form, which the router forwards to the workers as received
    (validated once here; workers decode it without re-judging, see workers.proto: Trust)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: pb.SamplingParams


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    max_logprobs: int = 20


def build_request(msg: pb.GenerateRequest, tokenizer: Tokenizer, limits: ModelLimits) -> BuiltRequest:
    if len(msg.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"{len(msg.request_id)} chars", f"must be <= {MAX_REQUEST_ID_CHARS}")
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("prompt", None, "must be set: one of text, token_ids or chat")
    if kind == "text":
        if not msg.text:
            raise InvalidRequestError("text", "", "must be a non-empty string")
        token_ids = tokenizer.encode(msg.text)
        field = "text"
    elif kind == "token_ids":
        token_ids = list(msg.token_ids.ids)
        field = "token_ids.ids"
    else:
        token_ids = _chat_token_ids(msg.chat, tokenizer)
        field = "chat"
    params = sampling_from_proto(msg.sampling)
    if not token_ids:
        raise InvalidRequestError(field, [], "must encode to at least one token")
    check_request(
        token_ids, params, vocab_size=limits.vocab_size, max_model_len=limits.max_model_len,
        max_logprobs=limits.max_logprobs, prompt_field=field,
    )
    return BuiltRequest(token_ids, params, msg.sampling)


def _chat_token_ids(chat: pb.ChatMessages, tokenizer: Tokenizer) -> list[int]:
    if not chat.messages:
        raise InvalidRequestError("chat.messages", [], "must hold at least one message")
    if not tokenizer.has_chat_template:
        raise InvalidRequestError("chat", "messages", "the model has no chat template: send text or token_ids")
    messages = []
    for i, m in enumerate(chat.messages):
        if m.role not in ("system", "user", "assistant", "tool"):
            raise InvalidRequestError(f"chat.messages[{i}].role", m.role, "must be system, user, assistant or tool")
        messages.append({"role": m.role, "content": m.content})
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    try:
        return tokenizer.apply_chat_template_ids(messages, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # a template's raise_exception(), e.g. roles out of order
        raise InvalidRequestError("chat.messages", "conversation", f"rejected by the chat template: {e}") from None
