"""Per-request sampling and stopping parameters.

Defaults follow vLLM's `SamplingParams` where the meaning is the same. `validate()` runs when the object
is made, so an invalid object never reaches the engine; every error names the field, the value and what
is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.structured_output import StructuredOutput

MAX_SEED = 2**64 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: -100 bans a token, +100 all but forces it
# A temperature below this samples greedily (vLLM's _SAMPLING_EPS): dividing float32 logits by it could
# overflow to inf, and the distribution it would give is the argmax anyway, to within float32 rounding.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt (the offline LLM and the OpenAI API fan them out; one engine request each)
    max_tokens: int = 16
    min_tokens: int = 0  # eos and stop_token_ids are masked (and stop strings not looked for) until this many
    temperature: float = 1.0  # 0 (anything below GREEDY_BELOW_TEMPERATURE) means greedy
    top_p: float = 1.0  # in (0, 1]; 1 disables; the best token always stays, however small top_p is
    top_k: int = 0  # 0 or -1 disables (vLLM), else >= 1
    min_p: float = 0.0  # in [0, 1]; 0 disables
    repetition_penalty: float = 1.0  # > 0; applied to prompt and output tokens (HF/vLLM semantics)
    presence_penalty: float = 0.0  # in [-2, 2]; output tokens only
    frequency_penalty: float = 0.0  # in [-2, 2]; output tokens only
    seed: int | None = None  # same seed -> same tokens, whatever else is in the batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (and the sampled token's)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    structured_output: StructuredOutput | None = None  # the output must match it (checked when it is made)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = dict(self.logit_bias or {})
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def validate(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise InvalidRequestError("n", self.n, "must be an integer >= 1")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", self.max_tokens, "must be an integer >= 1")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("min_tokens", self.min_tokens, f"must be in [0, max_tokens={self.max_tokens}]")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError("temperature", self.temperature,
                                      f"must be >= 0 (below {GREEDY_BELOW_TEMPERATURE:g} means greedy)")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", self.top_p, "must be in (0, 1]")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidRequestError("top_k", self.top_k, "must be 0 or -1 (disabled) or an integer >= 1")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", self.min_p, "must be in [0, 1]")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidRequestError("repetition_penalty", self.repetition_penalty, "must be > 0 (1 disables)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(name, value, "must be in [-2, 2]")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed <= MAX_SEED:
                raise InvalidRequestError("seed", self.seed, f"must be in [0, {MAX_SEED}]")
        for i, text in enumerate(self.stop):
            if not isinstance(text, str) or text == "":
                raise InvalidRequestError(f"stop[{i}]", text, "must be a non-empty string")
        for i, token_id in enumerate(self.stop_token_ids):
            _check_int(f"stop_token_ids[{i}]", token_id)
            if token_id < 0:
                raise InvalidRequestError(f"stop_token_ids[{i}]", token_id, "must be a token id >= 0")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise InvalidRequestError("structured_output", self.structured_output,
                                      "must be a StructuredOutput (engine/structured_output.py)")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if self.logprobs < 0:
                raise InvalidRequestError("logprobs", self.logprobs, "must be >= 0 (the number of top logprobs)")
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias", token_id)
            if token_id < 0:
                raise InvalidRequestError("logit_bias", token_id, "keys must be token ids >= 0")
            _check_number(f"logit_bias[{token_id}]", bias)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias[{token_id}]", bias,
                                          f"must be in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, value, "must be an integer")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(name, value, "must be a finite number")
