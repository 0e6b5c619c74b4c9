"""The tokenizer in a GGUF file's metadata, converted by transformers once per file and kept on disk.

A GGUF file carries llama.cpp's tokenizer metadata, not a tokenizer.json. transformers converts it
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`), parsing the whole file again and building the
vocabulary and merges in Python: ~6 s for SmolLM2's 49k tokens on a 2-core guest, in every process that loads
the model (`duet up` starts four at once). What the engine keeps of the result (`ConvertedTokenizer`: the
`tokenizers` pipeline as JSON, the special tokens, the chat template) is written to
$DUET_CACHE_DIR/tokenizers/ under a key of the file (resolved path, size, mtime) and of the versions that
converted it, so a later load reads one JSON file (~0.2 s) without importing transformers. Processes that load
the same file together convert it once (`cache_lock`), and the file is written under a temporary name and
renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from engine.cache_dir import cache_lock, duet_cache_dir
from engine.errors import ModelLoadError

if TYPE_CHECKING:
    from engine.gguf_file import GGUFFile

log = logging.getLogger("duet.tokenizer")

CACHE_FORMAT = 1  # bump when ConvertedTokenizer's fields change


class ConvertedTokenizer(NamedTuple):
    """What `engine.tokenizer.Tokenizer` takes from transformers' conversion of a GGUF tokenizer."""

    backend_json: str  # the `tokenizers` pipeline, as `Tokenizer.to_str()` writes it (before duet touches it)
    encode_special_tokens: bool
    special_tokens: dict[str, str]  # bos_token, eos_token, ... -> token text
    extra_special_tokens: list[str]
    chat_template: str | None
    clean_up_tokenization_spaces: bool


def converted_tokenizer(file: GGUFFile) -> ConvertedTokenizer:
    """The conversion of `file`'s tokenizer: from the cache when this file was converted by these versions of
    transformers, tokenizers and gguf before, else converted now and cached (where the cache is writable).
    Raises ModelLoadError when transformers cannot convert it."""
    cache_file = cache_path(file.path)
    cached = _read(cache_file)
    if cached is not None:
        return cached
    with cache_lock(f"tokenizer-{cache_file.stem}"):  # processes loading together: one converts, the others read
        cached = _read(cache_file)
        if cached is not None:
            return cached
        log.info("converting the tokenizer of %s with transformers (cached in %s)", file.path, cache_file)
        converted = _convert(file)
        _write(cache_file, converted)
    return converted


def cache_path(path: Path) -> Path:
    """Where the conversion of the GGUF file at `path` is kept (the file as it is now; any change of it, or of
    the converting libraries, gives another key)."""
    resolved = path.resolve()
    stat = resolved.stat()
    versions = [version(name) for name in ("transformers", "tokenizers", "gguf")]
    key = "\0".join(map(str, [CACHE_FORMAT, resolved, stat.st_size, stat.st_mtime_ns, *versions]))
    return duet_cache_dir() / "tokenizers" / f"{resolved.stem}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def _convert(file: GGUFFile) -> ConvertedTokenizer:
    from transformers import AutoTokenizer

    from engine.tokenizer import NAMED_SPECIAL_TOKENS

    try:
        converted = AutoTokenizer.from_pretrained(str(file.path.parent), gguf_file=file.path.name)
    except Exception as e:  # transformers raises ValueError, KeyError, ... for what it cannot convert
        raise ModelLoadError(f"{file.path}: the tokenizer in its metadata (tokenizer.ggml.*) cannot be "
                             f"converted by transformers ({type(e).__name__}: {e})") from None
    extra = converted.extra_special_tokens
    backend = converted.backend_tokenizer
    return ConvertedTokenizer(
        backend_json=backend.to_str(),
        encode_special_tokens=bool(backend.encode_special_tokens),
        special_tokens={name: str(token) for name, token in converted.special_tokens_map.items()
                        if isinstance(token, str) and name in NAMED_SPECIAL_TOKENS},
        extra_special_tokens=[str(token) for token in (extra.values() if isinstance(extra, dict) else extra)],
        chat_template=converted.chat_template,
        clean_up_tokenization_spaces=bool(converted.clean_up_tokenization_spaces),
    )


def _read(cache_file: Path) -> ConvertedTokenizer | None:
    try:
        fields = json.loads(cache_file.read_text(encoding="utf-8"))
        return ConvertedTokenizer(**fields)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:  # unreadable, not JSON, other fields: convert again
        log.warning("tokenizer cache %s unreadable (%s: %s): converting again", cache_file, type(e).__name__, e)
        return None


def _write(cache_file: Path, converted: ConvertedTokenizer) -> None:
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_file.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(converted._asdict(), out)
        os.replace(tmp, cache_file)
    except OSError as e:  # a read-only home: every load converts, as before the cache
        log.warning("tokenizer cache %s not written (%s): the next load converts again", cache_file, e)
