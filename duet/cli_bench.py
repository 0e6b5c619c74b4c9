"""`duet bench route TRACE`: replay a Mooncake-format trace through our prefill policy and the baselines.

The simulator and its assumptions are in `benchmarks/sim/trace_replay.py`; the policies in
`benchmarks/sim/baseline_policies.py`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

DEFAULT_WORKERS = 8
# 1,000 blocks of 512 tokens = 512k tokens per worker: ~64 GiB of bf16 KV for a Llama-3-8B-shaped model
# (128 KiB per token), about what one 80 GB GPU holds next to the weights.
DEFAULT_CACHE_BLOCKS = 1000
DEFAULT_TOKENS_PER_S = 10_000.0
# The trace's own timing: with 8 workers at 10k tokens/s the prompts, all uncached, would keep the cluster
# 75 % busy; the cache makes the difference between comfortable and queueing.
DEFAULT_TIME_SCALE = 1.0


def _cache_blocks(text: str) -> int | None:
    if text in ("inf", "none", "unbounded"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cache-blocks {text!r} is invalid: an integer >= 1 or 'inf'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--cache-blocks {value} is invalid: an integer >= 1 or 'inf'")
    return value


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value > 0 or (kind is float and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text} is invalid: must be > 0")
        return value
    return parse


def add_bench_commands(sub: argparse._SubParsersAction) -> None:
    from benchmarks.sim.baseline_policies import DUET_VARIANTS, POLICY_NAMES

    bench = sub.add_parser("bench", help="benchmarks that need no cluster")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("route", help="replay a Mooncake-format trace through the prefill routing policies",
                             description=__doc__)
    p.add_argument("trace", type=Path, help="JSONL: timestamp (ms), input_length, output_length, hash_ids")
    p.add_argument("--workers", type=_positive(int), default=DEFAULT_WORKERS, help="simulated prefill workers")
    p.add_argument("--cache-blocks", type=_cache_blocks, default=DEFAULT_CACHE_BLOCKS,
                   help="LRU cache per worker, in trace blocks (512 tokens), or 'inf' (default: %(default)s)")
    p.add_argument("--tokens-per-s", type=_positive(float), default=DEFAULT_TOKENS_PER_S,
                   help="prefill speed of one worker, uncached tokens/s (default: %(default)s)")
    p.add_argument("--fixed-s", type=float, default=0.002, help="per-prefill overhead, s (default: %(default)s)")
    p.add_argument("--time-scale", type=_positive(float), default=DEFAULT_TIME_SCALE,
                   help="arrival time = trace timestamp * this (<1: more load; default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of every policy's tie-breaking (default: 0)")
    p.add_argument("--limit", type=_positive(int), default=None, help="replay only the first N requests")
    p.add_argument("--policies", default=",".join(POLICY_NAMES),
                   help="comma-separated, in output order (default: %(default)s; ablations of ours: "
                        f"{', '.join(DUET_VARIANTS)})")
    p.add_argument("--json", action="store_true", help="one JSON object per policy per line, nothing else on stdout")
    p.set_defaults(func=cmd_bench_route)


def cmd_bench_route(args: argparse.Namespace) -> int:
    from benchmarks.sim.baseline_policies import ALL_POLICY_NAMES, compare_policies
    from benchmarks.sim.trace_replay import ReplayConfig, load_trace, offered_load

    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_POLICY_NAMES]
    if unknown or not names:
        print(f"error: --policies {args.policies!r} is invalid: choose from {', '.join(ALL_POLICY_NAMES)}",
              file=sys.stderr)
        return 2
    config = ReplayConfig(workers=args.workers, cache_blocks=args.cache_blocks, tokens_per_s=args.tokens_per_s,
                          fixed_s=args.fixed_s, seed=args.seed)
    try:
        requests = load_trace(args.trace, limit=args.limit, time_scale=args.time_scale)
    except OSError as e:
        print(f"error: cannot read trace {args.trace}: {e.strerror}", file=sys.stderr)
        return 2
    span_s = requests[-1].arrival_s - requests[0].arrival_s
    header = {"trace": str(args.trace), "requests": len(requests), "span_s": round(span_s, 1),
              "workers": config.workers, "cache_blocks": config.cache_blocks, "block_tokens": requests[0].block_tokens,
              "tokens_per_s": config.tokens_per_s, "fixed_s": config.fixed_s, "time_scale": args.time_scale,
              "seed": config.seed, "offered_load_no_cache": round(offered_load(requests, config), 3)}
    started = time.perf_counter()
    results = compare_policies(requests, config, names)
    elapsed_s = time.perf_counter() - started
    if args.json:
        print(json.dumps({"config": header}), file=sys.stderr)
        for r in results:
            print(json.dumps(r.summary()))
        return 0
    print("config: " + " ".join(f"{k}={v}" for k, v in header.items()))
    print("offered_load_no_cache = all prompt tokens / (span * workers * tokens_per_s); "
          "imbalance = max/mean per-worker prefill busy time; oracle = one worker with an infinite cache "
          "and workers x the speed")
    print(format_table([r.summary() for r in results]))
    print(f"({elapsed_s:.1f} s to simulate)")
    return 0


def format_table(rows: list[dict]) -> str:
    """A Markdown table of `ReplayResult.summary()` rows, TTFTs in seconds."""
    lines = ["| policy | token hit rate | TTFT mean s | TTFT p90 s | TTFT p99 s | imbalance |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['token_hit_rate']:.3f} | {r['ttft_mean_s']:.2f} | {r['ttft_p90_s']:.2f} "
                     f"| {r['ttft_p99_s']:.2f} | {r['imbalance']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m duet.cli_bench bench route TRACE`), same as `duet bench route TRACE`."""
    parser = argparse.ArgumentParser(prog="duet")
    add_bench_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
