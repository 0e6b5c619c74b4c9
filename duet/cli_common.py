"""Flags shared by `duet` commands, mapped onto `EngineConfig` and `SamplingParams`."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from engine.engine_config import EngineConfig, add_engine_flags


def positive(kind):
    """An argparse type: a `kind` (int or float) > 0, finite."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value > 0 or (kind is float and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text} is invalid: must be > 0")
        return value
    return parse


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids={text!r} is invalid: must be comma-separated ints") from None


def _parse_bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--logit-bias={text!r} is invalid: must be TOKEN_ID=BIAS, e.g. 42=-100") \
            from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """--model and every engine setting's flag (engine/engine_config.py's ENGINE_FLAGS, the one spelling)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", type=Path, default=None,
                   help="HF checkpoint dir or .gguf file (default: the embedded SmolLM2-135M-Instruct GGUF)")
    add_engine_flags(g)


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 32, logprobs: bool = True) -> None:
    """The sampling flags, `--max-tokens` defaulting to `max_tokens`; `--logprobs` only where the command
    shows logprobs (`logprobs=True`)."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 or -1 disables")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=_parse_ids, default=[])
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--min-tokens", type=int, default=0, help="no eos, stop id or stop string before this many tokens")
    g.add_argument("--logit-bias", type=_parse_bias, action="append", default=[], metavar="TOKEN_ID=BIAS",
                   help="add BIAS (in [-100, 100]) to a token's logit; -100 bans it (repeatable)")
    if logprobs:
        g.add_argument("--logprobs", type=int, default=None, help="top-n logprobs per token")


def engine_config(args: argparse.Namespace, **fields: object) -> EngineConfig:
    """The `EngineConfig` the engine flags of `args` spell (plus `fields` that have no flag here)."""
    return EngineConfig.from_flags(args, **fields)


def sampling_params(args: argparse.Namespace):
    from engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
        logit_bias=dict(args.logit_bias),
        logprobs=getattr(args, "logprobs", None),  # None where the command has no --logprobs
    )
