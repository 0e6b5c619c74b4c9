"""An OpenAI response's JSON, built from its choices' gRPC messages: the whole response, or its SSE chunks as
messages arrive (the first chunk of a chat choice carries the assistant role; `stream_options.include_usage`
adds a last chunk with the usage), with logprobs in chat's and completions' shapes."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

from duet.v1 import generation_pb2 as pb
from router.openai_choices import Choice
from router.openai_schema import ChatCompletionRequest, CompletionRequest
from router.structured_request import ToolPlan, chat_message

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token the model rules out gets this logprob (as vLLM)


class TokenTexts:
    """Token ids as text: one id alone, as logprobs show it (special tokens included, as vLLM), and a prompt."""

    def __init__(self, decode: Callable[..., str]):
        self._decode = decode
        self._one = functools.lru_cache(maxsize=1 << 16)(lambda token_id: decode([token_id], False))

    def __call__(self, token_id: int) -> str:
        return self._one(token_id)

    def prompt(self, token_ids: Sequence[int]) -> str:
        return self._decode(list(token_ids), False)


class Reply:
    """One request's JSON. `chunks` is called with each message as it arrives (streaming), `whole` once every
    choice has ended (not streaming); both record the message in its `Choice`."""

    def __init__(self, body: CompletionRequest | ChatCompletionRequest, request_id: str, model_id: str,
                 texts: TokenTexts, tool_plan: ToolPlan | None = None):
        self.body, self.request_id, self.model_id, self.texts = body, request_id, model_id, texts
        self.tool_plan = tool_plan  # chat with tools: answers parsed into tool_calls (never streamed)
        self.chat = isinstance(body, ChatCompletionRequest)
        self.created = int(time.time())
        self.top_n = body.top_logprobs_wanted()  # None: no logprobs
        self.include_usage = body.stream_options is not None and body.stream_options.include_usage
        self._echo = not self.chat and body.echo
        self._started: set[int] = set()  # choices whose first chunk went out
        self._text_offsets: dict[int, int] = {}  # completions' logprobs.text_offset, per choice

    def whole(self, choices: list[Choice]) -> dict:
        out = []
        for choice in choices:
            text = "".join(choice.text)
            entry: dict = {"index": choice.index}
            finish_reason = choice.finish_reason
            if self.chat:
                entry["message"], finish_reason = chat_message(text, finish_reason, self.tool_plan)
                entry["logprobs"] = self._chat_logprobs(choice.logprobs)
            else:
                entry["text"] = self._echoed(choice) + text
                entry["logprobs"] = self._completion_logprobs(choice, choice.logprobs, len(self._echoed(choice)))
            entry.update(finish_reason=finish_reason, stop_reason=choice.stop_reason)
            out.append(entry)
        return {"id": self.request_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_id, "choices": out,
                "usage": usage_json(choices, self.body.n)}

    def chunks(self, choice: Choice, msg: pb.GenerateResponse) -> list[dict]:
        """The SSE chunks one message makes (a chat choice's first message sends the role first, as OpenAI: the
        SDK's stream helpers read the role from that delta)."""
        choice.add(msg)
        first = choice.index not in self._started
        self._started.add(choice.index)
        out = []
        if self.chat:
            if first:
                out.append(self._chunk({"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}))
            entry = {"index": choice.index, "delta": {"content": msg.text},
                     "logprobs": self._chat_logprobs(msg.logprobs)}
        else:
            echoed = self._echoed(choice) if first else ""
            entry = {"index": choice.index, "text": echoed + msg.text,
                     "logprobs": self._completion_logprobs(choice, msg.logprobs, len(echoed))}
        entry["finish_reason"] = msg.finish_reason or None
        if msg.finish_reason:
            entry["stop_reason"] = choice.stop_reason
        out.append(self._chunk(entry))
        return out

    def usage_chunk(self, choices: list[Choice]) -> dict | None:
        """stream_options.include_usage: the last chunk, with the usage of every choice and no choices."""
        if not self.include_usage:
            return None
        return {**self._chunk(None), "usage": usage_json(choices, self.body.n)}

    def _chunk(self, entry: dict | None) -> dict:
        chunk = {"id": self.request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.model_id, "choices": [] if entry is None else [entry]}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk

    def _echoed(self, choice: Choice) -> str:
        """echo (completions): the prompt's text before the choice's."""
        if not self._echo:
            return ""
        prompt = self.body.prompts()[choice.prompt_index]
        return prompt if isinstance(prompt, str) else self.texts.prompt(prompt)

    def _chat_logprobs(self, logprobs: Sequence[pb.TokenLogprob]) -> dict | None:
        """Chat's `logprobs`: {"content": one entry per token, with its `top_logprobs` best alternatives}."""
        if self.top_n is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            token = self.texts(token_id)
            return {"token": token, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(token.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top[: self.top_n]]}
                            for lp in logprobs]}

    def _completion_logprobs(self, choice: Choice, logprobs: Sequence[pb.TokenLogprob], skip_chars: int
                             ) -> dict | None:
        """Completions' `logprobs`: parallel lists; `top_logprobs` maps the sampled token and the top-n to their
        logprobs (vLLM's shape); `text_offset` is each token's first character in the choice's text, counted
        across a stream's chunks (`skip_chars`: echoed prompt text before the tokens)."""
        if self.top_n is None:
            return None
        offset = self._text_offsets.get(choice.index, 0) + skip_chars
        tokens, offsets = [], []
        for lp in logprobs:
            tokens.append(self.texts(lp.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        self._text_offsets[choice.index] = offset
        return {"tokens": tokens, "token_logprobs": [max(lp.logprob, LOGPROB_FLOOR) for lp in logprobs],
                "top_logprobs": [self._top_by_text(lp) for lp in logprobs], "text_offset": offsets}

    def _top_by_text(self, lp: pb.TokenLogprob) -> dict[str, float]:
        """The top-n and the sampled token, text -> logprob; tokens that decode to the same text (e.g. partial
        UTF-8 bytes, all U+FFFD) share a key, which keeps the best of them."""
        out: dict[str, float] = {}
        for t in (*lp.top, lp):
            out.setdefault(self.texts(t.token_id), max(t.logprob, LOGPROB_FLOOR))
        return out


def usage_json(choices: list[Choice], n: int) -> dict:
    """OpenAI's usage: each prompt counted once (with its sample 0's cached tokens), every choice's tokens."""
    firsts = [c.usage for c in choices[::n] if c.usage is not None]
    prompt_tokens = sum(u.prompt_tokens for u in firsts)
    completion = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached_prompt_tokens(u) for u in firsts)}}


def cached_prompt_tokens(usage: pb.Usage) -> int:
    """Prompt tokens served from a cache, either the prefill worker's or the decode worker's: both caches hold
    prefixes of the same prompt, so their union is the longer one (a sum would count the overlap twice)."""
    return max(usage.cached_tokens, usage.decode_cached_tokens)
