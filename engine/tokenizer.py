"""Text <-> token ids for one checkpoint, without transformers (except to convert a GGUF file's tokenizer).

A thin layer over the `tokenizers` library (tokenizer.json) plus jinja2 for the chat template. It reproduces
what `transformers.AutoTokenizer` (5.x) does with the same directory, because the router tokenizes and the
workers detokenize with it, and "same answer everywhere" starts with the same ids:

- encode: tokenizer.json's pipeline as written, post-processor included (that is where a BOS comes from).
  `add_bos_token` / `add_eos_token` in tokenizer_config.json are ignored, as transformers 5 ignores them
  whenever a tokenizer.json exists. Truncation and padding stored in tokenizer.json are switched off, as
  transformers switches them off for a plain `encode`.
- special tokens: the named ones (`bos_token`, `eos_token`, ... and any other `*_token` string) and the extra
  ones (`extra_special_tokens` / `additional_special_tokens`) from tokenizer_config.json, falling back to
  special_tokens_map.json when the config has no `added_tokens_decoder`. Any that tokenizer.json does not
  list as an added token is registered as a special added token, as transformers does; so it is never split
  by encode and is dropped by `decode(skip_special_tokens=True)`.
- chat template: chat_template.jinja if present, else tokenizer_config.json's `chat_template`; rendered in
  transformers' jinja environment (sandboxed, trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`,
  `strftime_now`, a `tojson` that does not escape HTML, `{% generation %}` accepted).

A GGUF file carries no tokenizer.json, only llama.cpp's tokenizer metadata (vocabulary, merges, special
token ids, chat template); `from_gguf` has transformers convert it (its GGUF tokenizer conversion, which
`AutoTokenizer.from_pretrained(..., gguf_file=...)` runs) and keeps the resulting `tokenizers` pipeline,
so the ids are transformers' on the same file.

Not reproduced: transformers' per-class overrides of the pipeline (transformers 5 rebuilds e.g. a qwen2 or
LlamaTokenizer tokenizer from tokenizer.json's vocab and merges with the class's own normalizer and
pre-tokenizer; the real checkpoints' tokenizer.json already say the same thing), sentencepiece-only
checkpoints, and `clean_up_tokenization_spaces` for BPE models (transformers 5 ignores it there too).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from engine.errors import InvalidRequestError, ModelLoadError

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers aliases these to each other


class Tokenizer:
    """Encode, decode and render chat templates for one checkpoint.

    Immutable once built (the chat template compiles on first use), so one instance can serve every request.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: dict[str, str] | None = None,
        extra_special_tokens: Sequence[str] = (),
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        clean_up_tokenization_spaces: bool = False,
        name: str = "tokenizer",
    ):
        """`special_tokens` maps names (`bos_token`, ...) to token strings; `eos_token_ids` are extra ids that
        end generation (from generation_config.json), united with the id of `special_tokens["eos_token"]`.
        Takes over `backend`: registers the special tokens in it and switches off its truncation and padding."""
        self._backend = backend
        self._special_tokens = dict(special_tokens or {})
        self._name = name
        self._chat_template_source = chat_template
        self._chat_template: jinja2.Template | None = None  # compiled on first use
        backend.no_truncation()
        backend.no_padding()
        self._register_special_tokens([*self._special_tokens.values(), *extra_special_tokens])
        self._special_ids = frozenset(
            self._token_id(token) for token in [*self._special_tokens.values(), *extra_special_tokens]
        )
        eos_token = self._special_tokens.get("eos_token")
        self._eos_token_ids = frozenset([*eos_token_ids, *([self._token_id(eos_token)] if eos_token else [])])
        bos_token = self._special_tokens.get("bos_token")
        self._bos_token_id = self._token_id(bos_token) if bos_token else None
        # transformers skips the clean-up for BPE models: it deletes real spaces before punctuation there.
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja and
        generation_config.json (all but the first optional) from a checkpoint directory."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"{tokenizer_file} not found: a checkpoint needs a tokenizers-format tokenizer.json "
                "(sentencepiece-only checkpoints are not supported; convert them with transformers first)"
            )
        config = _read_json(path / "tokenizer_config.json")
        special_tokens = _named_special_tokens(config)
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra, dict):  # named model-specific tokens ({"image_token": "<image>"})
            special_tokens.update({key: text for key, value in extra.items() if (text := _token_text(value))})
            extra = []
        extra = [_token_text(token) for token in extra]
        if "added_tokens_decoder" not in config:  # legacy checkpoints: special_tokens_map.json wins
            legacy = _read_json(path / "special_tokens_map.json")
            special_tokens.update(_named_special_tokens(legacy))
            extra += [_token_text(token) for token in legacy.get("additional_special_tokens") or []]
        template_file = path / "chat_template.jinja"
        chat_template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                         else _default_template(config.get("chat_template")))
        generation = _read_json(path / "generation_config.json")
        eos = generation.get("eos_token_id")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        return cls(
            backend,
            special_tokens=special_tokens,
            extra_special_tokens=list(dict.fromkeys(token for token in extra if token)),
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            chat_template=chat_template,
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
            name=str(path),
        )

    @classmethod
    def from_path(cls, model_path: str | Path) -> Tokenizer:
        """The tokenizer of a model path: a GGUF file's (`from_gguf`) or a checkpoint directory's (`from_dir`)."""
        from engine.gguf_file import is_gguf_path

        return cls.from_gguf(model_path) if is_gguf_path(model_path) else cls.from_dir(model_path)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer a GGUF file's metadata describes, converted by transformers (see the module docstring);
        generation ends at the file's eos, and at its end-of-turn / end-of-message tokens where it names them
        (llama.cpp stops at all three). Raises ModelLoadError for a file that is not a supported GGUF."""
        from engine.gguf_file import open_gguf
        from engine.gguf_tokenizer import converted_tokenizer

        file = open_gguf(path)  # refuses bad files and architectures with the engine's own messages
        converted = converted_tokenizer(file)
        backend = BackendTokenizer.from_str(converted.backend_json)
        backend.encode_special_tokens = converted.encode_special_tokens
        eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        return cls(
            backend,
            special_tokens=converted.special_tokens,
            extra_special_tokens=converted.extra_special_tokens,
            eos_token_ids=[int(file.number(key)) for key in eos_keys if file.has(key)],
            chat_template=converted.chat_template,
            clean_up_tokenization_spaces=converted.clean_up_tokenization_spaces,
            name=str(file.path),
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens and padding entries included (== the model's vocab for tiny models)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: generation_config.json's `eos_token_id` (int or list) and `eos_token`'s id."""
        return self._eos_token_ids

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of the named and extra special tokens (transformers' `all_special_ids`, as a set)."""
        return self._special_ids

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens (`bos_token` -> its text, ...); the chat template sees these as variables."""
        return dict(self._special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template_source is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > LONG_TEXT_CHARS:
            return self._encode_releasing_gil(text, add_special_tokens)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def _encode_releasing_gil(self, text: str, add_special_tokens: bool) -> list[int]:
        """Same ids as `encode`: tokenizers' batch entry point releases the GIL while it works (the single one
        holds it), so a long prompt on one thread does not stop a server's other threads for its duration."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for: the longest vocabulary entry in
        UTF-8 (byte-level symbols such as 'Ġ' take 2 bytes for 1, so this is never below the truth).
        A text longer than `max_text_bytes(n)` therefore encodes to more than n tokens."""
        return max(len(token.encode()) for token in self._backend.get_vocab(with_added_tokens=True))

    def max_text_bytes(self, num_tokens: int) -> int:
        """UTF-8 bytes beyond which a text surely encodes to more than `num_tokens` tokens, so a caller can
        refuse it without encoding it. A normalizer may shorten text before it is split (Unicode composition:
        up to 3 bytes to 1, e.g. Hangul jamo), hence the factor 4 when there is one."""
        return num_tokens * self.max_token_bytes * (4 if self._backend.normalizer is not None else 1)

    @property
    def supports_tools(self) -> bool:
        """The chat template renders tool definitions: it reads the `tools` variable (transformers' test too)."""
        source = self._chat_template_source
        return source is not None and "tools" in source

    def backend_json(self) -> str:
        """The whole `tokenizers` pipeline as tokenizer.json text (what grammar libraries build their
        vocabulary view from)."""
        return self._backend.to_str()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; an incomplete UTF-8 sequence (at the end or anywhere) comes out as U+FFFD."""
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The vocabulary entries of `ids` (byte-level symbols, not text); None for an id outside the vocab."""
        return [self._backend.id_to_token(int(token_id)) for token_id in ids]

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry (e.g. a special token's text); None if there is none."""
        return self._backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """Render `messages` the way `transformers` `apply_chat_template(..., tokenize=False)` does.

        `template_kwargs` (e.g. `tools`, `enable_thinking`) are visible to the template and override the special
        token variables. Raises `InvalidRequestError` when there are no messages or the model has no template,
        and `jinja2.TemplateError` when the template rejects the conversation (`raise_exception`).
        """
        if not messages:
            raise InvalidRequestError("messages", messages, "must hold at least one message")
        for message in messages:
            if not isinstance(message, dict):
                raise InvalidRequestError("messages", message, "every message must be a dict (role, content, ...)")
        # transformers drops None-valued keys (OpenAI clients send content=None) and aliases reasoning fields.
        chat = [_alias_reasoning({key: value for key, value in message.items() if value is not None})
                for message in messages]
        variables = {"tools": None, "documents": None, **self._special_tokens, **template_kwargs}
        return self._template().render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)

    def apply_chat_template_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                                **template_kwargs) -> list[int]:
        """Token ids of the rendered chat, encoded without adding special tokens again: the template writes the
        BOS itself if the model wants one (transformers' `tokenize=True`)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def _template(self) -> jinja2.Template:
        if self._chat_template is None:
            if self._chat_template_source is None:
                raise InvalidRequestError(
                    "messages", "<chat>",
                    f"the model at {self._name} has no chat template (no chat_template in tokenizer_config.json, "
                    "no chat_template.jinja); send a plain prompt instead",
                )
            self._chat_template = _compile_chat_template(self._chat_template_source)
        return self._chat_template

    def _token_id(self, token: str) -> int:
        token_id = self._backend.token_to_id(token)
        assert token_id is not None, f"special token {token!r} has no id after registration"
        return token_id

    def _register_special_tokens(self, tokens: Iterable[str]) -> None:
        added = {token.content for token in self._backend.get_added_tokens_decoder().values()}
        missing = [token for token in dict.fromkeys(tokens) if token not in added]
        if missing:
            self._backend.add_tokens([AddedToken(token, special=True) for token in missing])


LONG_TEXT_CHARS = 16 * 1024  # from here on `encode` releases the GIL: the batch call's overhead is noise there


def _compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant spans for training masks; rendering ignores it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want the plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _clean_up_tokenization(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _named_special_tokens(config: dict) -> dict[str, str]:
    # Besides the standard names, transformers treats any other `*_token` string (image_token, ...) as a named
    # special token.
    named = {}
    for key, value in config.items():
        text = _token_text(value) if key in NAMED_SPECIAL_TOKENS else value if isinstance(value, str) else None
        if key.endswith("_token") and text:
            named[key] = text
    return named


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _default_template(value: Any) -> str | None:
    # Several named templates are stored as [{"name": ..., "template": ...}]; "default" is the chat one.
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data
