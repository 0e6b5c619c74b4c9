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


class FixedMask:
    """An allowed-token bitmask computed ahead (one position of a speculative row)."""

    def __init__(self, bitmask: torch.Tensor):
        self.bitmask = bitmask
        self.num_words = bitmask.numel()

    def fill_bitmask(self, row: torch.Tensor) -> None:
        row.copy_(self.bitmask)

    def masks_along(self, token_ids: Sequence[int]) -> list[FixedMask]:
        raise TypeError("a fixed mask has no grammar to advance")


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

    def masks_along(self, token_ids: Sequence[int]) -> list[FixedMask]:
        """The allowed-token masks after each prefix of `token_ids` (len + 1 of them: a speculative row's positions),
        taking the tokens tentatively and rolling them back, so this state is unchanged. From a token the grammar
        rejects (or one that ends the request) on, the masks repeat the last one: no draw there can be kept, as the
        draw before it cannot equal that token."""
        rows = torch.zeros(len(token_ids) + 1, self.num_words, dtype=torch.int32)
        self.fill_bitmask(rows[0])
        taken = 0
        for j, token_id in enumerate(token_ids):
            ends = token_id in self._stop_token_ids or self.error is not None
            # try_consume_tokens takes what the grammar allows and, unlike consume_token, leaves no error behind
            if ends or self._matcher.try_consume_tokens([token_id]) != 1:
                rows[j + 1 :] = rows[j]
                break
            taken += 1
            self.fill_bitmask(rows[j + 1])
        if taken:
            self._matcher.rollback(taken)
        return [FixedMask(row) for row in rows]

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
