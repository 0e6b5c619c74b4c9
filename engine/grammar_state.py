"""One request's place in its structured-output grammar: which tokens may come next, and the tokens taken.

It lives with the engine's `Request` (`request.grammar`) from the moment the engine core admits it: the
sampler asks it for the allowed-token bitmask of each step (engine/grammar_mask.py), and the engine core's
update step feeds it each accepted token. A request handed to a decode worker, or migrated, gets a new one
that replays the tokens generated so far (`GrammarCompiler.new_state`), so the constraint continues exactly.

Once the grammar is complete only an end-of-sequence token is allowed (the tokenizer's EOS, and the request's
own stop token ids): the request then stops as any other. A grammar that allows nothing next (a dead end) or
rejects a token puts the state in error; the engine fails that request alone with `error` as the reason.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch

BITS_PER_WORD = 32  # the bitmask: int32 words, bit (i % 32) of word (i // 32) allows token i


class GrammarState:
    """Not thread-safe: the engine thread alone uses it once the request is admitted."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, stop_token_ids: Sequence[int] = ()):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._stop_token_ids = [t for t in stop_token_ids if 0 <= t < vocab_size]
        self.error: str | None = None

    @property
    def num_words(self) -> int:
        return -(-self.vocab_size // BITS_PER_WORD)

    @property
    def is_complete(self) -> bool:
        """The output so far is a whole match: only an end of sequence may follow."""
        return self._matcher.is_accepting()

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` (int32 [num_words], CPU, contiguous)."""
        assert row.dtype == torch.int32 and row.is_contiguous() and row.device.type == "cpu"
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self._stop_token_ids and self._matcher.is_accepting():
            for token_id in self._stop_token_ids:  # a stop token ends the request like EOS
                row[token_id // BITS_PER_WORD] |= _bit(token_id % BITS_PER_WORD)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (and `error` set) if the grammar rejects it."""
        if self.error is not None:
            return False
        if token_id in self._stop_token_ids and self._matcher.is_accepting():
            return True  # the request stops here; the matcher has nothing left to check
        if self._matcher.consume_token(token_id):
            return True
        self.error = f"token {token_id} does not match the grammar: {self._matcher.get_error().strip()}"
        return False


def _bit(i: int) -> int:
    """Bit i of an int32 word, as a Python int that fits int32 (bit 31 is the sign bit)."""
    return -(1 << 31) if i == 31 else 1 << i
