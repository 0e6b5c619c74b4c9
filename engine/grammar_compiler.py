"""Structured-output constraints compiled for one tokenizer: a cache of ready matchers, one per distinct spec.

    StructuredOutput ──grammar_text()──► llguidance grammar ──LLMatcher(tokenizer)──► template matcher (cached)
                                                                        │ deep_copy (µs)
                                                                        ▼
                                                       GrammarState: one per request (engine/grammar_state.py)

Compiling a schema costs ~1 ms with llguidance (its lexer is built lazily, on the first masks), and the
llguidance tokenizer (vocabulary trie) ~0.3 s once per process; both happen in `prepare`, which servers call
on their gRPC threads before a request reaches the engine thread, so the engine loop only copies a cached
matcher. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance

from engine.errors import InvalidRequestError
from engine.grammar_state import GrammarState
from engine.structured_output import StructuredOutput
from engine.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 256  # distinct specs kept compiled (least recently used dropped first)


class GrammarCompiler:
    """Makes `GrammarState`s for one tokenizer and a model vocabulary of `vocab_size` ids (the logits' width,
    which may exceed the tokenizer's: the extra ids are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._templates: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def prepare(self, spec: StructuredOutput) -> None:
        """Compile `spec` into the cache now (InvalidRequestError if this tokenizer cannot serve it)."""
        self._template(spec)

    def new_state(self, spec: StructuredOutput, stop_token_ids: Sequence[int] = (),
                  output_token_ids: Sequence[int] = ()) -> GrammarState:
        """A fresh matcher for one request, having consumed `output_token_ids` (the tokens it generated
        before: a hand-off or a migration replays them). InvalidRequestError if they break the grammar."""
        state = GrammarState(self._template(spec).deep_copy(), self._vocab_size, stop_token_ids)
        for i, token_id in enumerate(output_token_ids):
            if not state.accept(token_id):
                raise InvalidRequestError(f"output_token_ids[{i}]", token_id,
                                          f"does not match the request's structured output: {state.error}")
        return state

    def _template(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        with self._lock:
            template = self._templates.get(spec)
            if template is not None:
                self._templates.move_to_end(spec)
                return template
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend_json(), n_vocab=self._vocab_size,
                    eos_token=sorted(self._tokenizer.eos_token_ids))
            template = llguidance.LLMatcher(self._ll_tokenizer, spec.grammar_text(), log_level=0)
            if template.is_error():
                raise InvalidRequestError(f"structured_output.{spec.kind}", getattr(spec, spec.kind),
                                          f"cannot be compiled for this model's tokenizer: {template.get_error()}")
            self._templates[spec] = template
            if len(self._templates) > MAX_CACHED_GRAMMARS:
                self._templates.popitem(last=False)
            return template
