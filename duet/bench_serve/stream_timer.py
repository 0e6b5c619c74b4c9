"""One streamed OpenAI response (server-sent events), timed as its lines arrive.

Kept minimal on purpose, so that the client is never the bottleneck: per line one prefix test and one
`json.loads`, one clock reading kept per text chunk; every derived figure is computed once, in `fill`. What counts
(see request_record.py): a *text chunk* is one whose first choice carries non-empty text (`delta.content` for
chat, `text` for completions). A chat stream's opening role-only chunk, a finish-only chunk and a chunk of tokens
whose text the server holds back (an incomplete UTF-8 character) are not text chunks, so they move neither TTFT nor
ITL. A request that completes without any text has no TTFT.
"""

from __future__ import annotations

import json

from duet.bench_serve.request_record import RequestRecord, ms

MAX_ERROR_CHARS = 300


class StreamTimer:
    """Feed it each SSE line of one response with the time it arrived (`feed`), or the reason it failed (`fail`),
    then `fill` the request's record. Times are `time.perf_counter()` seconds."""

    def __init__(self, chat: bool, start_s: float, keep_text: bool = False):
        self.chat, self.start_s, self.keep_text = chat, start_s, keep_text
        self.chunk_times_s: list[float] = []
        self.text_parts: list[str] = []  # only with keep_text (multi-turn needs the answer)
        self.usage: dict | None = None
        self.finish_reason: str | None = None
        self.done = False  # "data: [DONE]" arrived
        self.error: str | None = None

    def feed(self, line: str, now_s: float) -> None:
        if not line.startswith("data:"):
            return  # blank separators, ": keep-alive" comments, "event:" lines
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            self.fail(f"a stream line is not JSON: {payload[:80]!r}")
            return
        if "error" in chunk:  # an error after the stream started: the status was already 200
            error = chunk["error"]
            self.fail(f"error event: {error.get('message', error) if isinstance(error, dict) else error}")
            return
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not choices:
            return
        choice = choices[0]
        text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
        if text:
            self.chunk_times_s.append(now_s)
            if self.keep_text:
                self.text_parts.append(text)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def fail(self, error: str) -> None:
        if self.error is None:  # the first reason is the one that matters
            self.error = error[:MAX_ERROR_CHARS]

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def fill(self, record: RequestRecord, end_s: float) -> None:
        """Everything the stream told, into `record` (its http_status already set by the caller)."""
        if self.error is None and record.http_status == 200 and not self.done:
            self.fail("the stream ended without 'data: [DONE]'")
        record.ok = self.error is None and record.http_status == 200
        record.error = self.error
        record.finish_reason = self.finish_reason
        record.e2e_ms = ms(end_s - self.start_s)
        record.text_chunks = len(self.chunk_times_s)
        if self.chunk_times_s:
            record.ttft_ms = ms(self.chunk_times_s[0] - self.start_s)
            record.itl_ms = [ms(b - a) for a, b in zip(self.chunk_times_s, self.chunk_times_s[1:])]
        usage = self.usage or {}
        if usage.get("completion_tokens") is not None:
            record.output_tokens, record.output_tokens_from = int(usage["completion_tokens"]), "usage"
        else:
            record.output_tokens, record.output_tokens_from = record.text_chunks, "chunks"
        if usage.get("prompt_tokens") is not None:
            record.prompt_tokens = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            record.cached_tokens = int(details["cached_tokens"])
        if record.ttft_ms is not None and record.output_tokens >= 2:
            record.tpot_ms = round((record.e2e_ms - record.ttft_ms) / (record.output_tokens - 1), 3)
