"""`duet bench serve`'s settings: the command's flags, judged once, as one dataclass.

A flag that does not apply to the chosen workload or load mode is an error, never silently ignored; so is a
workload without its load mode (chat and multiturn need exactly one of --request-rate or --concurrency; a trace
runs on its own timestamps unless given one of them).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path

from benchmarks.sim.trace_replay import TRACE_BLOCK_TOKENS, load_trace
from duet.bench_serve.arrivals import poisson_arrivals_s
from duet.bench_serve.load import Endpoint, LoadPlan
from duet.bench_serve.workloads import (
    FIRST_TRACE_TOKEN_ID,
    Session,
    TraceBlocks,
    chat_sessions,
    multiturn_sessions,
    trace_sessions,
)

WORKLOADS = ("chat", "multiturn", "trace")
API_KEY_ENV_VAR = "OPENAI_API_KEY"
DEFAULTS = {"num_requests": 100, "num_conversations": 10, "turns": 3, "system_prompt_tokens": 300,
            "system_prompt": "shared", "trace_block_tokens": TRACE_BLOCK_TOKENS, "time_scale": 1.0, "vocab_size": 32000}
SYSTEM_PROMPTS = ("shared", "per-session")  # --system-prompt: one for every session, or one of its own each
CHAT_MAX_TOKENS = 64
# Which workloads each workload-specific flag applies to (dest -> workloads).
_WORKLOAD_FLAGS = {"num_requests": ("chat", "trace"), "num_conversations": ("multiturn",), "turns": ("multiturn",),
                   "system_prompt_tokens": ("chat", "multiturn"), "system_prompt": ("chat", "multiturn"),
                   "trace_block_tokens": ("trace",),
                   "time_scale": ("trace",), "vocab_size": ("trace",)}


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


@dataclass(frozen=True)
class ServeBenchConfig:
    url: str  # base URL, without /v1
    workload: str  # one of WORKLOADS
    trace_path: Path | None  # trace only
    model: str | None  # None: the first of GET /v1/models
    api_key: str | None
    num_requests: int | None  # chat: how many; trace: the first N lines (None: all)
    num_conversations: int | None  # multiturn
    turns: int | None  # multiturn
    system_prompt_tokens: int | None  # chat, multiturn: about this many words (~ tokens)
    system_prompt: str | None  # chat, multiturn: one of SYSTEM_PROMPTS
    trace_block_tokens: int | None  # trace: tokens per trace block (512 = the trace's own size)
    time_scale: float | None  # trace on its timestamps: arrival = timestamp * this
    vocab_size: int | None  # trace: token ids drawn from [FIRST_TRACE_TOKEN_ID, vocab_size)
    request_rate: float | None  # open loop, Poisson (inf: all at once)
    concurrency: int | None  # closed loop
    max_tokens: int | None  # chat, multiturn: per request; trace: a cap on output_length (None: none)
    temperature: float
    ignore_eos: bool
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    seed: int
    timeout_s: float
    json_path: Path | None
    records_path: Path | None
    plot_path: Path | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeBenchConfig:
        """Judge the parsed flags; raises ValueError naming the flag, the value and what is allowed."""
        kind, *rest = args.workload
        if kind not in WORKLOADS:
            raise ValueError(f"--workload {kind!r} is invalid: choose chat, multiturn or trace FILE")
        if kind == "trace" and len(rest) != 1:
            raise ValueError(f"--workload trace needs exactly one FILE (a Mooncake-format JSONL), got {len(rest)}")
        if kind != "trace" and rest:
            raise ValueError(f"--workload {kind} takes no argument, got {' '.join(rest)!r}")
        modes = [flag(f) for f in ("request_rate", "concurrency") if getattr(args, f) is not None]
        if kind != "trace" and len(modes) != 1:
            raise ValueError(f"--workload {kind} needs exactly one of --request-rate R (open loop, Poisson) or "
                             f"--concurrency N (closed loop), got {' and '.join(modes) or 'neither'}")
        if kind == "trace" and len(modes) > 1:
            raise ValueError("give at most one of --request-rate or --concurrency with a trace (neither: the "
                             "trace's own timestamps)")
        if kind == "trace" and modes and args.time_scale is not None:
            raise ValueError(f"--time-scale {args.time_scale} scales the trace's timestamps, which {modes[0]} "
                             "replaces: give one or the other")
        values = {}
        for dest, workloads in _WORKLOAD_FLAGS.items():
            given = getattr(args, dest)
            if given is not None and kind not in workloads:
                raise ValueError(f"{flag(dest)} {given} does not apply to --workload {kind}: it is for "
                                 f"{' and '.join(workloads)}")
            values[dest] = given if given is not None or kind not in workloads else DEFAULTS[dest]
        if kind == "trace":
            values["num_requests"] = args.num_requests  # None: the whole trace
            values["time_scale"] = None if modes else values["time_scale"]  # Poisson or closed loop: no timestamps
        if values.get("trace_block_tokens") is not None and values["trace_block_tokens"] > TRACE_BLOCK_TOKENS:
            raise ValueError(f"--trace-block-tokens {values['trace_block_tokens']} is invalid: must be in "
                             f"[1, {TRACE_BLOCK_TOKENS}] (the trace's own block size)")
        if values.get("vocab_size") is not None and values["vocab_size"] <= FIRST_TRACE_TOKEN_ID:
            raise ValueError(f"--vocab-size {values['vocab_size']} is invalid: must be > {FIRST_TRACE_TOKEN_ID} "
                             f"(trace token ids are drawn from [{FIRST_TRACE_TOKEN_ID}, vocab size))")
        if not math.isfinite(args.temperature) or args.temperature < 0:
            raise ValueError(f"--temperature {args.temperature} is invalid: must be a finite number >= 0")
        for name in ("json_path", "records_path", "plot_path"):
            path = getattr(args, name)
            if path is not None and not path.parent.is_dir():
                raise ValueError(f"{flag(name.removesuffix('_path'))} {path} is invalid: no directory {path.parent}")
        if args.plot_path is not None and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib, which is not installed: pip install 'duet[plot]' "
                             "(or pip install matplotlib)")
        max_tokens = args.max_tokens if args.max_tokens is not None or kind == "trace" else CHAT_MAX_TOKENS
        return cls(url=normalized_url(args.url), workload=kind, trace_path=Path(rest[0]) if rest else None,
                   model=args.model, api_key=args.api_key or os.environ.get(API_KEY_ENV_VAR) or None,
                   **values, request_rate=args.request_rate, concurrency=args.concurrency, max_tokens=max_tokens,
                   temperature=args.temperature, ignore_eos=args.ignore_eos, slo_ttft_ms=args.slo_ttft_ms,
                   slo_tpot_ms=args.slo_tpot_ms, seed=args.seed, timeout_s=args.timeout_s, json_path=args.json_path,
                   records_path=args.records_path, plot_path=args.plot_path)

    def endpoint(self) -> Endpoint:
        return Endpoint(self.url, self.api_key, self.timeout_s)

    def plan(self) -> LoadPlan:
        return LoadPlan(concurrency=self.concurrency)

    def sessions(self) -> list[Session]:
        """The workload's sessions, with arrival times for an open loop. Reads the trace (OSError, or TraceError
        naming the bad line)."""
        if self.workload == "chat":
            sessions: list[Session] = chat_sessions(self.num_requests, self.system_prompt_tokens, self.max_tokens,
                                                    self.seed, shared=self.system_prompt == "shared")
        elif self.workload == "multiturn":
            sessions = multiturn_sessions(self.num_conversations, self.turns, self.system_prompt_tokens,
                                          self.max_tokens, self.seed, shared=self.system_prompt == "shared")
        else:
            requests = load_trace(self.trace_path, limit=self.num_requests, time_scale=self.time_scale or 1.0)
            blocks = TraceBlocks(self.trace_block_tokens, self.vocab_size, self.seed)
            sessions = trace_sessions(requests, blocks, self.max_tokens)
        if self.request_rate is not None:
            for session, arrival_s in zip(sessions, poisson_arrivals_s(len(sessions), self.request_rate, self.seed)):
                session.arrival_s = arrival_s
        return sessions

    def to_json(self) -> dict:
        """The settings as recorded with the results (the API key left out)."""
        out = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "api_key"}
        return {k: str(v) if isinstance(v, Path) or v == math.inf else v for k, v in out.items()}


def normalized_url(url: str) -> str:
    """http(s)://host[:port][/prefix] without a trailing slash or /v1 (the client appends /v1/...)."""
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
        raise ValueError(f"--url {url!r} is invalid: must be http://HOST:PORT or https://... (the server's base URL)")
    url = url.rstrip("/")
    return url.removesuffix("/v1")
