"""Errors that name what is wrong: the field, the value given, and what is allowed.

Servers map `InvalidRequestError` to gRPC INVALID_ARGUMENT / HTTP 400; the engine raises it before a
request touches any shared state, so a bad request never disturbs the others in a batch.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request field holds a value outside what is allowed."""

    def __init__(self, field: str, value: object, allowed: str):
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={_short(value)} is invalid: {allowed}")


class ExceedsContextError(InvalidRequestError):
    """The prompt, or the prompt with max_tokens after it, is longer than an engine's max_model_len. To a
    client that is bad input; to a worker whose own limit is below the router's it means "not here"
    (FAILED_PRECONDITION), so the router may try another worker."""


class RequestFailed(RuntimeError):
    """One request failed on its own inside an engine step (e.g. its sampling raised); the step went on for
    the others. Servers report it as that request's error, never as the worker's."""


class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded: unknown architecture, missing or mis-shaped tensors, bad config."""


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
