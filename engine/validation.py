"""Checks on a tokenized request that need the model's limits; shared by the offline engine, the router
and the workers, so a request is judged the same everywhere. Each raises `InvalidRequestError`."""

from __future__ import annotations

from collections.abc import Sequence

from engine.errors import ExceedsContextError, InvalidRequestError
from engine.sampling_params import SamplingParams


def check_token_ids(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    for i, t in enumerate(token_ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidRequestError(f"{field}[{i}]", t, f"must be a token id in [0, {vocab_size})")


def check_token_ids_fast(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """`check_token_ids` for ids that are ints already (decoded from protobuf): two C-speed passes (min, max),
    and the per-id walk only to name the first bad one."""
    if token_ids and not (0 <= min(token_ids) and max(token_ids) < vocab_size):
        check_token_ids(field, token_ids, vocab_size)


def check_request(
    token_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    max_logprobs: int,
    prompt_field: str = "prompt_token_ids",
    routed: bool = False,
) -> None:
    """The prompt fits the context and the vocabulary, and so does the prompt with max_tokens after it (as
    vLLM's API server judges it: no request is admitted that could only end by filling the context); stop
    ids and logprobs are within the model's limits.

    `routed=True` is the guard a worker applies to a request the router already judged: the internal plane is
    trusted (the router validated the public request once, against the model's limits), so a worker only
    refuses what would break it under its own settings (its max_model_len and max_logprobs may be set lower
    than the router's; an id outside the vocabulary would fail a whole batch step), and its ids are ints
    already, so they are checked by `check_token_ids_fast`.
    """
    check_ids = check_token_ids_fast if routed else check_token_ids
    if not token_ids:
        raise InvalidRequestError(prompt_field, list(token_ids), "must hold at least one token id")
    check_ids(prompt_field, token_ids, vocab_size)
    if len(token_ids) > max_model_len:
        raise ExceedsContextError(
            "prompt", f"{len(token_ids)} tokens", f"must be at most max_model_len={max_model_len} tokens"
        )
    if len(token_ids) + params.max_tokens > max_model_len:
        raise ExceedsContextError(
            "max_tokens", params.max_tokens,
            f"must be at most {max_model_len - len(token_ids)}: this model's maximum context length is "
            f"{max_model_len} tokens and the prompt holds {len(token_ids)}")
    check_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    for token_id in params.logit_bias:
        if token_id >= vocab_size:
            raise InvalidRequestError("logit_bias", token_id, f"keys must be token ids in [0, {vocab_size})")
    if params.logprobs is not None and params.logprobs > max_logprobs:
        raise InvalidRequestError("logprobs", params.logprobs, f"must be in [0, {max_logprobs}]")
