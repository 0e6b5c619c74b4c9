"""The prompt forms the offline API takes, as vLLM spells them, and the one duet adds.

    "text"                                   a text prompt (tokenized with the model's special tokens)
    {"prompt": "text"}                       the same (vLLM's TextPrompt)
    {"prompt_token_ids": [1, 2, 3]}          token ids, used as given (vLLM's TokensPrompt)
    [1, 2, 3]                                duet's short form of the same: a bare list of ints is one prompt

A dict may also carry "cache_salt" (vLLM's key: a tenant's prefix-cache namespace). Any other key (vLLM's
multi_modal_data, mm_processor_kwargs, ...) is refused by name: duet serves text-only decoders, and a
key dropped silently would give an answer to a different question. A dict is never tokenized as text.

The short form costs nothing and is unambiguous: no other form is a list of ints (a batch is a list of
prompts, and a prompt is never an int), so `[1, 2, 3]` is one prompt and `[[1, 2], [3]]` two.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, TypedDict

from typing_extensions import NotRequired

from engine.errors import InvalidRequestError


class TextPrompt(TypedDict):
    """vLLM's text prompt dict (the keys duet supports)."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """vLLM's token-ids prompt dict (the keys duet supports)."""

    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


Prompt = str | TextPrompt | TokensPrompt | Mapping[str, object] | Sequence[int]
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


class ParsedPrompt(NamedTuple):
    text: str | None  # the prompt's text when it was given as text (RequestOutput.prompt), else None
    token_ids: list[int] | None  # the ids when given as ids; None: tokenize `text`
    cache_salt: str


def parse_prompt(prompt: Prompt) -> ParsedPrompt:
    """One prompt in any accepted form, else `InvalidRequestError` naming the field as the dict form would
    (`prompt`, `prompt_token_ids[i]`, the refused key), so a caller can prefix it (`prompts[3].`)."""
    if isinstance(prompt, str):
        return _text(prompt, "")
    if isinstance(prompt, Mapping):
        return _from_dict(prompt)
    if isinstance(prompt, (list, tuple)):
        return ParsedPrompt(None, _token_ids(prompt), "")
    raise InvalidRequestError("prompt", prompt, "must be a string, a list of token ids, or a dict with 'prompt' or "
                                             "'prompt_token_ids'")


def as_prompt_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A single prompt as a batch of one; a batch as a list. An empty batch is refused."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError("prompts", prompts, "must be a prompt or a list of prompts")
    if not prompts:
        raise InvalidRequestError("prompts", prompts, "must hold at least one prompt")
    if all(_is_int(t) for t in prompts):
        return [prompts]  # duet's short form: one prompt of token ids
    return list(prompts)


def _from_dict(prompt: Mapping[str, object]) -> ParsedPrompt:
    for key in prompt:
        if key not in PROMPT_KEYS:
            raise InvalidRequestError(str(key), prompt[key],
                                      f"duet serves text-only models: a prompt dict may hold only "
                                      f"{', '.join(PROMPT_KEYS)}")
    salt = prompt.get("cache_salt", "")
    if not isinstance(salt, str):
        raise InvalidRequestError("cache_salt", salt, "must be a string")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InvalidRequestError("prompt", prompt, "a prompt dict must hold exactly one of 'prompt' (text) and "
                                                 "'prompt_token_ids'")
    if "prompt" in prompt:
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise InvalidRequestError("prompt", text, "must be a string (token ids go in 'prompt_token_ids')")
        return _text(text, salt)
    return ParsedPrompt(None, _token_ids(prompt["prompt_token_ids"]), salt)


def _text(text: str, salt: str) -> ParsedPrompt:
    if not text:
        raise InvalidRequestError("prompt", text, "must be a non-empty string")
    return ParsedPrompt(text, None, salt)


def _token_ids(ids: object) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequestError("prompt_token_ids", ids, "must be a list of token ids")
    if not ids:
        raise InvalidRequestError("prompt_token_ids", list(ids), "must hold at least one token id")
    for i, token_id in enumerate(ids):
        if not _is_int(token_id):
            raise InvalidRequestError(f"prompt_token_ids[{i}]", token_id, "must be an integer token id")
    return list(ids)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
