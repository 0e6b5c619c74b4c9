"""A public `GenerateRequest` to prompt token ids and engine `SamplingParams`, judged once, here, with the
engine's own checks (same tokenizer, same chat template, `check_request`). Raises `InvalidRequestError`.
An absent `max_tokens` is what is left of the context after the prompt (vLLM's OpenAI server's default), set in
the sampling parameters the workers receive.

Work before admission is bounded: a text (or a chat's messages together) longer than
`Tokenizer.max_text_bytes(max_model_len)` cannot fit the context whatever it says, so it is refused before
it is tokenized; what is tokenized is encoded with the GIL released (the router's other threads go on), and
at most `max_concurrent_long` long prompts are tokenized at once (the rest wait, within their deadline).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

from cluster.proto_convert import sampling_from_proto
from duet.v1 import generation_pb2 as pb
from engine.errors import ExceedsContextError, InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.tokenizer import LONG_TEXT_CHARS, Tokenizer
from engine.validation import check_request
from router.tool_definitions import parse_tools

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


class TokenizeTimeout(Exception):
    """The request's deadline passed while it waited for a tokenizing slot."""


class RequestBuilder:
    """Judges public requests (`build`); one per router, shared by its threads."""

    def __init__(self, tokenizer: Tokenizer, limits: ModelLimits, max_concurrent_long: int = 2):
        self.tokenizer, self.limits = tokenizer, limits
        self.max_prompt_bytes = tokenizer.max_text_bytes(limits.max_model_len)
        self._long_slots = threading.BoundedSemaphore(max_concurrent_long)

    def build(self, msg: pb.GenerateRequest, timeout_s: float | None = None) -> BuiltRequest:
        """The request judged valid, or `InvalidRequestError`; `TokenizeTimeout` if its prompt waited longer
        than `timeout_s` (the client's remaining deadline) to be tokenized."""
        if len(msg.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError("request_id", f"{len(msg.request_id)} chars",
                                      f"must be <= {MAX_REQUEST_ID_CHARS}")
        if msg.WhichOneof("prompt") is None:
            raise InvalidRequestError("prompt", None, "must be set: one of text, token_ids or chat")
        limits = self.limits
        sampling = msg.sampling
        default_max_tokens = not sampling.HasField("max_tokens")
        if default_max_tokens:  # judged with the largest it can become; set to the rest of the context below
            sampling = pb.SamplingParams()
            sampling.CopyFrom(msg.sampling)
            sampling.max_tokens = limits.max_model_len
        params = sampling_from_proto(sampling)  # cheap checks first: a bad field costs no tokenizing
        token_ids, field = self.tokenize(msg, timeout_s)
        if not token_ids:
            raise InvalidRequestError(field, [], "must encode to at least one token")
        if default_max_tokens:
            if len(token_ids) >= limits.max_model_len:
                raise ExceedsContextError(
                    "prompt", f"{len(token_ids)} tokens",
                    f"must be at most {limits.max_model_len - 1} tokens, to leave room for one generated token "
                    f"in this model's context of max_model_len={limits.max_model_len}")
            sampling.max_tokens = limits.max_model_len - len(token_ids)
            params = sampling_from_proto(sampling)
        check_request(token_ids, params, vocab_size=limits.vocab_size, max_model_len=limits.max_model_len,
                      max_logprobs=limits.max_logprobs, prompt_field=field)
        return BuiltRequest(token_ids, params, sampling)

    def tokenize(self, msg: pb.GenerateRequest, timeout_s: float | None = None,
                 add_special_tokens: bool = True) -> tuple[list[int], str]:
        """The prompt's token ids, as the workers will see them (the chat template applied as offline), and the
        field they came from; `InvalidRequestError` for a prompt that is absent, empty or too long to fit, and
        `TokenizeTimeout` as in `build`. Nothing else is judged (the length against max_model_len is `build`'s)."""
        kind = msg.WhichOneof("prompt")
        if kind == "text":
            if not msg.text:
                raise InvalidRequestError("text", "", "must be a non-empty string")
            self._check_text_bytes("text", len(msg.text.encode()))
            return self._tokenize(lambda: self.tokenizer.encode(msg.text, add_special_tokens), len(msg.text),
                                  timeout_s), "text"
        if kind == "token_ids":
            return list(msg.token_ids.ids), "token_ids.ids"
        if kind == "chat":
            messages, add_generation_prompt = self._chat_messages(msg.chat)
            tools = self._chat_tools(msg.chat.tools_json)
            return self._tokenize(lambda: _render_chat(self.tokenizer, messages, add_generation_prompt, tools),
                                  sum(len(m["content"]) for m in messages), timeout_s), "chat"
        raise InvalidRequestError("prompt", None, "must be set: one of text, token_ids or chat")

    def _check_text_bytes(self, field: str, num_bytes: int) -> None:
        if num_bytes > self.max_prompt_bytes:
            raise InvalidRequestError(
                field, f"{num_bytes} bytes",
                f"must be at most {self.max_prompt_bytes} bytes: a longer text cannot fit max_model_len="
                f"{self.limits.max_model_len} tokens (no token of this model stands for more than "
                f"{self.tokenizer.max_token_bytes} bytes)")

    def _tokenize(self, encode, num_chars: int, timeout_s: float | None) -> list[int]:
        if num_chars <= LONG_TEXT_CHARS:
            return encode()
        wait_s = None if timeout_s is None else min(max(timeout_s, 0.0), threading.TIMEOUT_MAX)
        if not self._long_slots.acquire(timeout=wait_s):
            raise TokenizeTimeout(f"the deadline passed while {num_chars} characters waited to be tokenized")
        try:
            return encode()
        finally:
            self._long_slots.release()

    def _chat_messages(self, chat: pb.ChatMessages) -> tuple[list[dict], bool]:
        if not chat.messages:
            raise InvalidRequestError("chat.messages", [], "must hold at least one message")
        if not self.tokenizer.has_chat_template:
            raise InvalidRequestError("chat", "messages", "the model has no chat template: send text or token_ids")
        messages = []
        for i, m in enumerate(chat.messages):
            if m.role not in ("system", "user", "assistant", "tool"):
                raise InvalidRequestError(f"chat.messages[{i}].role", m.role,
                                          "must be system, user, assistant or tool")
            message = {"role": m.role, "content": m.content}
            if m.tool_calls_json:
                message["tool_calls"] = self._message_tool_calls(f"chat.messages[{i}]", m)
            if m.tool_call_id:
                if m.role != "tool":
                    raise InvalidRequestError(f"chat.messages[{i}].tool_call_id", m.tool_call_id,
                                              f"is only for a tool message, not role {m.role!r}")
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        self._check_text_bytes("chat.messages", sum(len(m.content.encode()) + len(m.tool_calls_json.encode())
                                                    for m in chat.messages))
        add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        return messages, add_generation_prompt

    def _message_tool_calls(self, where: str, m: pb.ChatMessage) -> list[dict]:
        """An assistant message's tool calls as chat templates read them: OpenAI's shape with each call's
        `arguments` parsed from its JSON text into an object (as vLLM hands them to templates)."""
        field = f"{where}.tool_calls_json"
        if m.role != "assistant":
            raise InvalidRequestError(field, m.tool_calls_json,
                                      f"is only for an assistant message, not role {m.role!r}")
        if not self.tokenizer.supports_tools:
            raise InvalidRequestError(field, m.tool_calls_json, "this model's chat template has no tool support, so "
                                      "it cannot show the model its earlier tool calls")
        try:
            calls = json.loads(m.tool_calls_json)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(field, m.tool_calls_json, f"must be a JSON array of tool calls: {e}") from None
        if not isinstance(calls, list) or not calls:
            raise InvalidRequestError(field, m.tool_calls_json, "must be a non-empty JSON array of tool calls")
        out = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise InvalidRequestError(f"{field}[{j}]", call, 'must be {"id": ..., "type": "function", '
                                          '"function": {"name": ..., "arguments": "<JSON text>"}}')
            arguments = function.get("arguments", "{}")
            try:
                parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{field}[{j}].function.arguments", arguments,
                                          f"must be JSON text: {e}") from None
            out.append({"id": call.get("id", ""), "type": "function",
                        "function": {"name": function["name"], "arguments": parsed}})
        return out

    def _chat_tools(self, tools_json: str) -> list[dict] | None:
        """The tool definitions the chat template renders (None: no tools)."""
        if not tools_json:
            return None
        if not self.tokenizer.supports_tools:
            raise InvalidRequestError("chat.tools_json", tools_json, "this model's chat template has no tool support "
                                      "(it never reads `tools`), so tools cannot be offered to it: send the request "
                                      "without tools")
        self._check_text_bytes("chat.tools_json", len(tools_json.encode()))
        return parse_tools(tools_json)


def _render_chat(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool,
                 tools: list[dict] | None = None) -> list[int]:
    try:
        return tokenizer.apply_chat_template_ids(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except Exception as e:  # a template's raise_exception(), e.g. roles out of order
        raise InvalidRequestError("chat.messages", "conversation", f"rejected by the chat template: {e}") from None
