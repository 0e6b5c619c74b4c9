"""Token ids -> text deltas, one generated token at a time, with stop strings.

Two hold-backs make every delta final (a caller streams it and never takes it back):

1. Characters. A byte-level token can end in the middle of a UTF-8 character, and decoding it alone gives
   U+FFFD. The prefix/read-offset technique (as in vLLM and TGI) decodes a short window of recent tokens:

       ids:   ... | prefix window  | new tokens |
                  ^ prefix_offset  ^ read_offset
       prefix_text = decode(ids[prefix_offset:read_offset])   (already emitted)
       new_text    = decode(ids[prefix_offset:])
       delta       = new_text[len(prefix_text):]  once new_text does not end in U+FFFD

   Decoding from a few tokens back, rather than the new tokens alone, keeps what a decoder does at the start of
   a string (sentencepiece strips the leading space) out of the delta. The window holds the last emitted chunk
   plus the tokens not yet emitted, so each token costs O(window), not O(output length); tokens that decode to
   nothing (skipped special tokens) are dropped from it. The window only grows while the text keeps ending in
   U+FFFD (a run of invalid bytes), until a token completes it or `flush()`.

2. Stop strings. Text that could still become the start of a stop string (the longest suffix that is a proper
   prefix of one) is held back; a match is searched for only in that held text plus the new delta. Among the
   matches, the one that ends first wins (ties: the longer), as if the text arrived one character at a time,
   so the result does not depend on how the text was split into tokens.

Invariant (tested): with no stop string matched, the deltas plus `flush()` concatenate to
`tokenizer.decode(output_ids, skip_special_tokens)`, for decoders that work byte by byte (byte-level BPE).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token (vLLM uses 5 as well)


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas; one object per request.

    `add_token` returns the new final text (possibly ""); after a stop string matched, `stop_matched` names it,
    `finished` is True, and further tokens add nothing. `flush()` at the end of generation returns what was held
    back (an incomplete character comes out as U+FFFD, as in `decode`).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        if isinstance(stop, str):
            stop = (stop,)
        for stop_str in stop:
            if not isinstance(stop_str, str) or not stop_str:
                raise ValueError(f"stop={list(stop)!r} is invalid: every stop string must be a non-empty str")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = tuple(dict.fromkeys(stop))
        self._include_stop = include_stop_str_in_output
        self._max_stop_chars = max((len(stop_str) for stop_str in self._stops), default=0)
        self._min_tokens = min_tokens  # stop strings are looked for once more tokens than this were added (vLLM)
        self._num_tokens = 0

        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT_CHAR):  # a prompt cut mid-character would corrupt the first delta
            context, context_text = [], ""
        self._ids = context  # the window: ids[0:read_offset] is the prefix window
        self._read_offset = len(context)
        self._prefix_text = context_text
        self._held = ""  # final text held back because it may begin a stop string
        self._chunks: list[str] = []  # everything emitted
        self.stop_matched: str | None = None
        self.finished = False

    @classmethod
    def for_request(cls, tokenizer: Decoder, prompt_token_ids: Sequence[int], params: SamplingParams
                    ) -> IncrementalDetokenizer:
        """The detokenizer a request's sampling parameters ask for (special tokens, stop strings, min_tokens)."""
        return cls(tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                   include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)

    @property
    def text(self) -> str:
        """All text emitted so far (cut at the stop string once one matched)."""
        return "".join(self._chunks)

    def add_token(self, token_id: int) -> str:
        """Add one generated token; return the text that became final with it (often "")."""
        if self.finished:
            return ""
        self._num_tokens += 1
        self._ids.append(token_id)
        new_text = self._decode(self._ids)
        if new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # maybe an incomplete character: wait for the next token
        if len(new_text) <= len(self._prefix_text):
            self._ids.pop()  # decodes to nothing (a skipped special token): forget it
            return ""
        delta = new_text[len(self._prefix_text):]
        self._ids = self._ids[self._read_offset:]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return self._emit(delta, final=False)

    def flush(self) -> str:
        """End of generation: return the held-back text (none if a stop string matched) and finish."""
        if self.finished:
            return ""
        tail = self._decode(self._ids)[len(self._prefix_text):]
        out = self._emit(tail, final=True)
        self.finished = True
        return out

    def _emit(self, delta: str, final: bool) -> str:
        text = self._held + delta
        if self._num_tokens <= self._min_tokens:  # under min_tokens: no stop string may end the text
            self._chunks.append(text)
            self._held = ""
            return text
        match = self._find_stop(text)
        if match is not None:
            start, stop_str = match
            out = text[: start + len(stop_str) if self._include_stop else start]
            self._held = ""
            self.stop_matched = stop_str
            self.finished = True
        else:
            keep = 0 if final else self._stop_prefix_chars(text)
            out, self._held = text[: len(text) - keep], text[len(text) - keep:]
        self._chunks.append(out)
        return out

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first, the longer one on a tie; None if none."""
        best = None
        for stop_str in self._stops:
            start = text.find(stop_str)
            if start >= 0 and (best is None or (start + len(stop_str), start) < (best[0] + len(best[1]), best[0])):
                best = (start, stop_str)
        return best

    def _stop_prefix_chars(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for size in range(min(len(text), self._max_stop_chars - 1), 0, -1):
            suffix = text[-size:]
            if any(stop_str.startswith(suffix) for stop_str in self._stops):
                return size
        return 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""
