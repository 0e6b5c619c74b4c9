"""Structured output in the sampler: each constrained row's disallowed tokens get logit -inf.

Applied to the raw logits before penalties and temperature, so every later filter and the draw see only
allowed tokens; the logprobs a request asked for stay those of the raw distribution (vLLM's default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from engine.grammar_state import BITS_PER_WORD


class AllowedTokens(Protocol):
    """What the sampler needs of a row's grammar (engine/grammar_state.py's `GrammarState`)."""

    num_words: int

    def fill_bitmask(self, row: torch.Tensor) -> None: ...

    def masks_along(self, token_ids: Sequence[int]) -> list[AllowedTokens]:
        """What may come next after each prefix of `token_ids` (a speculative row's positions), the state
        itself unchanged."""
        ...


class GrammarDeadEnd(RuntimeError):
    """A row's grammar allows no next token: that request cannot go on and fails alone."""


def apply_grammar_masks(logits: torch.Tensor, grammars: Sequence[AllowedTokens | None]) -> torch.Tensor:
    """`logits` [B, V] itself when no row is constrained, else a new tensor with each constrained row's
    disallowed tokens at -inf (`logits` is never written). GrammarDeadEnd if a row allows no token."""
    constrained = [i for i, g in enumerate(grammars) if g is not None]
    if not constrained:
        return logits
    vocab = logits.shape[1]
    num_words = max(grammars[i].num_words for i in constrained)
    bitmask = torch.zeros(len(constrained), num_words, dtype=torch.int32)
    for j, i in enumerate(constrained):
        grammars[i].fill_bitmask(bitmask[j])
    allowed = unpack_bitmask(bitmask, vocab)
    dead = (~allowed.any(dim=1)).nonzero().flatten().tolist()
    if dead:
        raise GrammarDeadEnd(f"structured output: the grammar allows no next token (a dead end) for sampling "
                             f"row(s) {[constrained[j] for j in dead]}")
    index = torch.tensor(constrained, device=logits.device)
    rows = logits.index_select(0, index).masked_fill_(~allowed.to(logits.device), -math.inf)
    return logits.index_copy(0, index, rows)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [n, W] -> bool [n, vocab]: token i allowed iff bit (i % 32) of word (i // 32) is set (ids past
    the bitmask's 32 * W are not allowed)."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return torch.cat([bits, bits.new_zeros(bits.shape[0], vocab - bits.shape[1])], dim=1)
