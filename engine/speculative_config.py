"""`speculative_config` in vLLM's form: which proposer guesses tokens ahead, how many, and when to back off.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4, "quantization": "int4"}

Keys are vLLM's where vLLM has one (`disable_by_batch_size` included); duet adds `min_acceptance_rate`, the
per-request back-off, and `min_speedup`, the measured one per batch size. A key duet does not implement is
refused, never dropped, and so is a key of the other method. Methods: "ngram" (prompt lookup:
engine/ngram_proposer.py) and "draft_model" (a smaller checkpoint with the target's tokenizer, or the target
itself held quantized: engine/drafter.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

METHODS = ("ngram", "draft_model")
# Steps with more live requests than this verify no guesses: past it a step is compute-bound and verifying k more
# tokens per sequence costs time instead of saving it (llama.cpp's lookup decoding: 1.10x at 1 slot, 0.77x at 8).
# Measured on the default model: benchmarks/speculative_bench.py, RESULTS.md.
DISABLE_BY_BATCH_SIZE = 4
# A request whose guesses were accepted at less than this rate (over its recent drafts) stops drafting for a while
MIN_ACCEPTANCE_RATE = 0.25
# Speculation at a batch size whose measured tokens/s falls under this fraction of plain decoding's is switched off
# for a while (engine/speculation_payoff.py); 0: never by measurement
MIN_SPEEDUP = 0.97


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram: the shortest suffix n-gram looked up (0: set from prompt_lookup_max)
    prompt_lookup_max: int = 0  # ngram: the longest (0: set from prompt_lookup_min; both 0: 5 and 5, as vLLM)
    disable_by_batch_size: int = DISABLE_BY_BATCH_SIZE  # more live requests than this: no speculation this step
    min_acceptance_rate: float = MIN_ACCEPTANCE_RATE  # per request: back off below it
    min_speedup: float = MIN_SPEEDUP  # per batch size: off while measured tokens/s < this x plain's
    model: str = ""  # draft_model: the draft checkpoint (a Hugging Face directory or a .gguf file)
    quantization: str = ""  # draft_model: how the draft's linears are held (engine_config.QUANTIZATIONS; "": auto)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is invalid: must be one of "
                             f"{', '.join(METHODS)}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.method == "draft_model":
            self._check_draft_model()
        else:
            for key in ("model", "quantization"):
                if getattr(self, key):
                    raise ValueError(f"speculative_config {key}={getattr(self, key)!r} is invalid for method "
                                     f"{self.method!r}: it is a draft_model key")
            self._check_lookup()
        _check_int("disable_by_batch_size", self.disable_by_batch_size, 1)
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(f"speculative_config min_acceptance_rate={rate!r} is invalid: must be in [0, 1]")
        speedup = self.min_speedup
        if isinstance(speedup, bool) or not isinstance(speedup, (int, float)) or not 0 <= speedup <= 2:
            raise ValueError(f"speculative_config min_speedup={speedup!r} is invalid: must be in [0, 2] (0: off)")

    def _check_draft_model(self) -> None:
        from engine.engine_config import QUANTIZATIONS  # (engine_config imports this module)

        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"speculative_config model={self.model!r} is invalid: method 'draft_model' needs the "
                             "draft checkpoint's path")
        if self.quantization and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative_config quantization={self.quantization!r} is invalid: must be one of "
                             f"{', '.join(QUANTIZATIONS)}")
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, key):
                raise ValueError(f"speculative_config {key}={getattr(self, key)!r} is invalid for method "
                                 "'draft_model': it is an ngram key")
        object.__setattr__(self, "quantization", self.quantization or "auto")

    def _check_lookup(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        _check_int("prompt_lookup_min", low, 0)
        _check_int("prompt_lookup_max", high, 0)
        if not low and not high:
            low = high = 5
        low, high = low or high, high or low
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min={low} and prompt_lookup_max={high} are invalid: "
                             "min must be <= max")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def parse(cls, value: str | Mapping | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a JSON object's text (the command line's --speculative-config), a mapping, or a config."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = json_object(value, "speculative_config")
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config {value!r} is invalid: must be a JSON object")
        known = {name for name in cls.__dataclass_fields__}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"speculative_config keys {', '.join(unknown)} are unknown or not implemented: "
                             f"allowed {', '.join(sorted(known))}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)


def json_object(text: str, what: str) -> dict:
    """The JSON object `text` holds; ValueError naming `what` if it is not JSON or not an object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {text[:80]!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} {text[:80]!r} is invalid: must be a JSON object")
    return value


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"speculative_config {name}={value!r} is invalid: must be an int >= {low}")
