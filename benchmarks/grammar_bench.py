"""xgrammar vs llguidance on the default model's tokenizer (SmolLM2, 49152 tokens), in the same run.

    .venv/bin/pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi  # benchmark only: its pip metadata would
                                                                   # pull torch, transformers and triton
    PYTHONPATH=$PWD .venv/bin/python benchmarks/grammar_bench.py [--repeats 10]

Two figures per library, each repeated (min / median / max):
- compile: a realistic JSON schema (an order with nested objects, arrays, enums, a pattern and bounds) to a
  ready matcher, with no cache (a fresh compiler each repeat), the first token mask included (llguidance
  builds its lexer lazily, so its first mask carries part of what xgrammar does at compile time);
- mask: the per-token cost on the decode path: fill one row's bitmask, then accept the token, over the
  tokens of a valid document (the model's own tokenization of it), i.e. exactly what the engine does per
  step per structured request. Plus the same for the built-in "any JSON object" grammar.
The tokenizer setup (once per model, cached by the engine) is printed too.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from engine.default_model import default_model_path
from engine.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 80},
                "email": {"type": "string"},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
                    "unit_price": {"type": "number", "minimum": 0},
                    "category": {"enum": ["book", "music", "food", "tool"]},
                },
                "required": ["sku", "quantity", "unit_price", "category"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "customer", "items", "status"],
    "additionalProperties": False,
}
DOCUMENT = {
    "order_id": "ABC-123456",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.org", "vip": True},
    "items": [
        {"sku": "B-001", "quantity": 2, "unit_price": 12.5, "category": "book"},
        {"sku": "F-17", "quantity": 10, "unit_price": 0.99, "category": "food"},
    ],
    "status": "paid",
    "notes": None,
}


def stats(xs: list[float]) -> str:
    return f"{min(xs) * 1e3:.3f} / {statistics.median(xs) * 1e3:.3f} / {max(xs) * 1e3:.3f}"


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, vocab_size: int):
        import xgrammar as xgr

        self.xgr = xgr
        backend = tok._backend
        vocab = backend.get_vocab(with_added_tokens=True)
        encoded = [""] * vocab_size
        for token, i in vocab.items():
            if i < vocab_size:
                encoded[i] = token
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        self.info = xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                                      stop_token_ids=sorted(tok.eos_token_ids),
                                      add_prefix_space=meta["add_prefix_space"])
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def matcher(self, schema: str | None):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if schema is None:
            return self.xgr.GrammarMatcher(compiler.compile_builtin_json_grammar())
        compiled = compiler.compile_json_schema(schema)
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m) -> None:
        m.fill_next_token_bitmask(self.bitmask, 0)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer, vocab_size: int):
        import llguidance
        import llguidance.torch

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tok._backend.to_str(), n_vocab=vocab_size,
                                                eos_token=sorted(tok.eos_token_ids))
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self.fill_row = llguidance.torch.fill_next_token_bitmask

    def matcher(self, schema: str | None):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else '{"type": "object"}')
        m = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, m) -> None:
        self.fill_row(m, self.bitmask, 0)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer.from_gguf(default_model_path())
    vocab_size = tok.vocab_size
    doc_tokens = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False) + [min(tok.eos_token_ids)]
    print(f"# grammar_bench: {time.strftime('%Y-%m-%d')} {platform.machine()} {platform.processor() or ''} "
          f"python {platform.python_version()}, vocab {vocab_size}, document {len(doc_tokens)} tokens, "
          f"repeats {args.repeats}, torch threads 1")
    schema = json.dumps(SCHEMA)
    print("| library | tokenizer setup ms | schema compile + first mask ms (min / median / max) | "
          "schema mask+accept per token ms | json_object compile ms | json_object mask+accept per token ms |")
    print("|---|---:|---|---|---|---|")
    for cls in (XGrammar, LLGuidance):
        start = time.perf_counter()
        lib = cls(tok, vocab_size)
        setup_s = time.perf_counter() - start
        row = [lib.name, f"{setup_s * 1e3:.0f}"]
        for which in (schema, None):
            compile_s, per_token_s = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                m = lib.matcher(which)
                lib.fill(m)
                compile_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                for token in doc_tokens:
                    lib.fill(m)
                    assert lib.accept(m, token), f"{lib.name} rejected token {token}"
                per_token_s.append((time.perf_counter() - start) / len(doc_tokens))
            row += [stats(compile_s), stats(per_token_s)]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
