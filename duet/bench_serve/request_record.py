"""One request as the load generator saw it: the unit every figure of `duet bench serve` is computed from.

Times are milliseconds, rounded to the microsecond when the record is made, and every statistic is computed from
the rounded values: the summary can be recomputed exactly from the saved records (`--records`, or `records` in
`--json`).

How tokens are counted: `output_tokens` is the final usage chunk's `completion_tokens` (`output_tokens_from` =
"usage"); a server that sends no usage gets the number of text chunks instead ("chunks"), which undercounts when
a chunk carries several tokens. `itl_ms` holds one gap per pair of successive text chunks, not per token: a chunk
that carries several tokens (speculative decoding, a detokenizer holding back partial characters) is one gap, so
`len(itl_ms) == text_chunks - 1` and it may be shorter than `output_tokens - 1`. TPOT is per token:
(e2e - ttft) / (output_tokens - 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def ms(seconds: float) -> float:
    """Seconds -> milliseconds, rounded to the microsecond (the precision records keep)."""
    return round(seconds * 1000.0, 3)


@dataclass
class RequestRecord:
    request_index: int  # 0.. in the workload's order (session by session, turn by turn)
    session_index: int  # the conversation (chat and trace: one request each)
    turn: int  # 0.. within the conversation
    max_tokens: int  # what was asked
    scheduled_s: float | None = None  # open loop: the planned send time, s after the run's start; closed: None
    start_s: float | None = None  # when it was sent, s after the run's start; None: never sent
    ok: bool = False  # HTTP 200, a stream that ended with [DONE] and no error event
    http_status: int | None = None  # None: no response (connection refused, timeout) or never sent
    error: str | None = None
    finish_reason: str | None = None
    ttft_ms: float | None = None  # send -> first chunk with text
    e2e_ms: float | None = None  # send -> end of the stream
    tpot_ms: float | None = None  # (e2e - ttft) / (output_tokens - 1); None below 2 output tokens
    itl_ms: list[float] = field(default_factory=list)  # between successive text chunks (see the module docstring)
    output_tokens: int = 0
    output_tokens_from: str = "usage"  # "usage" (the server's count) or "chunks" (text chunks counted)
    text_chunks: int = 0
    prompt_tokens: int | None = None  # from the usage; None when the server sent none
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server reports it

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> RequestRecord:
        return cls(**obj)

    def chunk_times_s(self) -> list[float]:
        """When each text chunk arrived, s after the run's start (empty for a request with no text)."""
        if self.start_s is None or self.ttft_ms is None:
            return []
        times = [self.start_s + self.ttft_ms / 1000.0]
        for gap_ms in self.itl_ms:
            times.append(times[-1] + gap_ms / 1000.0)
        return times
