"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a few strings, or a
Lark grammar. Exactly one is set.

It is part of `SamplingParams` (so it travels wherever they do: the router, the prefill worker, the decode
worker, a migration) and is checked when it is made, without a tokenizer: a bad schema, regex or grammar
raises `InvalidRequestError` naming the field before any worker sees it. The grammar library is llguidance
(chosen by measurement, benchmarks/RESULTS.md "Structured outputs"); `grammar()` is its grammar text,
which `engine/grammar_compiler.py` turns into a matcher for one tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance

from engine.errors import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
ANY_JSON_OBJECT = '{"type": "object"}'  # what `json_object` means (as vLLM's llguidance backend has it)
# JSON is written as json.dumps writes it: one space after ":" and ",", no other whitespace. Free whitespace
# (llguidance's default) lets a model pad forever between tokens (vLLM offers the same switch as
# --structured-outputs-config.disable_any_whitespace); a schema's "x-guidance" options still override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on the output text. Frozen and hashable: compiled grammars are cached by it."""

    json_schema: str | None = None  # a JSON schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the whole output matches it (Rust `regex` syntax)
    choice: tuple[str, ...] | None = None  # the whole output is exactly one of these
    grammar: str | None = None  # a Lark grammar (llguidance's dialect; GBNF is accepted too)

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice) if isinstance(self.choice, list) else self.choice)
        set_kinds = [k for k in KINDS if self._is_set(k)]
        if len(set_kinds) != 1:
            raise InvalidRequestError("structured_output", set_kinds or None,
                                      f"exactly one of {', '.join(KINDS)} must be set")
        self.validate()

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is not False and value is not None

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._is_set(k))

    def validate(self) -> None:
        """Types, then the grammar itself (llguidance compiles it without a tokenizer: ~1 ms for a schema)."""
        kind = self.kind
        field = f"structured_output.{kind}"
        value = getattr(self, kind)
        if kind == "json_object":
            if value is not True:
                raise InvalidRequestError(field, value, "must be true or unset")
        elif kind == "choice":
            if not value or not all(isinstance(c, str) and c for c in value):
                raise InvalidRequestError(field, list(value) if isinstance(value, tuple) else value,
                                          "must be a non-empty list of non-empty strings")
        elif not isinstance(value, str) or not value:
            raise InvalidRequestError(field, value, "must be a non-empty string")
        if kind == "json_schema":
            try:
                schema = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(field, value, f"must be a JSON schema as JSON text: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(field, value, "must be a JSON schema: a JSON object (or true/false)")
        try:
            error = llguidance.LLMatcher.validate_grammar(self.grammar_text())
        except ValueError as e:
            error = str(e)
        if error:
            raise InvalidRequestError(field, value, f"is not a valid {_NAMES[kind]}: {error.strip()}")

    def grammar_text(self) -> str:
        """The llguidance grammar for this constraint (cheap: it is parsed when a matcher is made)."""
        kind = self.kind
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.json_schema, defaults=JSON_LAYOUT)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_LAYOUT)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(self.choice)))
        return llguidance.grammar_from("grammar", self.grammar)


_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
          "choice": "choice list", "grammar": "Lark/GBNF grammar"}
