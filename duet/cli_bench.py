"""`duet bench route TRACE`: replay a Mooncake-format trace through our prefill policy and the baselines.
`duet bench serve --url URL ...`: load on a running OpenAI-compatible server (duet, vLLM, llama.cpp's server).

The simulator and its assumptions are in `benchmarks/sim/trace_replay.py`; the policies in
`benchmarks/sim/baseline_policies.py`; the load generator in `duet/bench_serve/`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from duet.cli_common import positive

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


def _request_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: a number of requests/s > 0, or 'inf'") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is invalid: must be > 0 requests/s (or 'inf': all at once)")
    return value


def add_bench_commands(sub: argparse._SubParsersAction) -> None:
    from benchmarks.sim.baseline_policies import DUET_VARIANTS, POLICY_NAMES

    bench = sub.add_parser("bench", help="benchmarks: routing policies on a trace (no cluster), load on a server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("route", help="replay a Mooncake-format trace through the prefill routing policies",
                             description=__doc__)
    p.add_argument("trace", type=Path, help="JSONL: timestamp (ms), input_length, output_length, hash_ids")
    p.add_argument("--workers", type=positive(int), default=DEFAULT_WORKERS, help="simulated prefill workers")
    p.add_argument("--cache-blocks", type=_cache_blocks, default=DEFAULT_CACHE_BLOCKS,
                   help="LRU cache per worker, in trace blocks (512 tokens), or 'inf' (default: %(default)s)")
    p.add_argument("--tokens-per-s", type=positive(float), default=DEFAULT_TOKENS_PER_S,
                   help="prefill speed of one worker, uncached tokens/s (default: %(default)s)")
    p.add_argument("--fixed-s", type=float, default=0.002, help="per-prefill overhead, s (default: %(default)s)")
    p.add_argument("--time-scale", type=positive(float), default=DEFAULT_TIME_SCALE,
                   help="arrival time = trace timestamp * this (<1: more load; default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of every policy's tie-breaking (default: 0)")
    p.add_argument("--limit", type=positive(int), default=None, help="replay only the first N requests")
    p.add_argument("--policies", default=",".join(POLICY_NAMES),
                   help="comma-separated, in output order (default: %(default)s; ablations of ours: "
                        f"{', '.join(DUET_VARIANTS)})")
    p.add_argument("--json", action="store_true", help="one JSON object per policy per line, nothing else on stdout")
    p.set_defaults(func=cmd_bench_route)
    add_serve_command(bench_sub)


def add_serve_command(bench_sub: argparse._SubParsersAction) -> None:
    from duet.bench_serve import config

    p = bench_sub.add_parser("serve", help="load on an OpenAI-compatible server (duet, vLLM, llama.cpp), streamed "
                             "and timed per request", description=__doc__.splitlines()[1])
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000 (/v1/... appended)")
    p.add_argument("--model", help="the model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", help=f"bearer token (default: ${config.API_KEY_ENV_VAR}, if set)")
    p.add_argument("--workload", nargs="+", default=["chat"], metavar=("KIND", "FILE"),
                   help="chat | multiturn | trace FILE (a Mooncake-format JSONL; default: chat)")
    g = p.add_argument_group("workload")
    d = config.DEFAULTS
    g.add_argument("--num-requests", type=positive(int), metavar="N",
                   help=f"chat: requests (default: {d['num_requests']}); trace: the first N lines (default: all)")
    g.add_argument("--num-conversations", type=positive(int), metavar="C",
                   help=f"multiturn: conversations (default: {d['num_conversations']})")
    g.add_argument("--turns", type=positive(int), metavar="T",
                   help=f"multiturn: turns per conversation (default: {d['turns']})")
    g.add_argument("--system-prompt-tokens", type=positive(int), metavar="N",
                   help="chat, multiturn: the system prompt's length in words, about as many tokens "
                        f"(default: {d['system_prompt_tokens']})")
    g.add_argument("--system-prompt", choices=config.SYSTEM_PROMPTS,
                   help="chat, multiturn: one system prompt every session shares (cached after the first), or one "
                        f"of its own per session (each first turn uncached; default: {d['system_prompt']})")
    g.add_argument("--trace-block-tokens", type=positive(int), metavar="N",
                   help="trace: tokens per trace block (default: the trace's 512; smaller scales prompts down to "
                        "fit a small context)")
    g.add_argument("--time-scale", type=positive(float), metavar="X",
                   help="trace on its timestamps: arrival = timestamp * this (<1: more load; default: 1)")
    g.add_argument("--vocab-size", type=positive(int), metavar="V",
                   help="trace: prompt token ids are drawn from [100, this): at most the model's vocabulary "
                        f"(default: {d['vocab_size']})")
    g = p.add_argument_group("load (chat and multiturn: exactly one; trace: at most one, else its timestamps)")
    g.add_argument("--request-rate", type=_request_rate, metavar="R",
                   help="open loop: Poisson arrivals of sessions at this rate per s, seeded by --seed; "
                        "inf: all at once")
    g.add_argument("--concurrency", type=positive(int), metavar="N",
                   help="closed loop: this many sessions in flight at all times")
    g = p.add_argument_group("requests")
    g.add_argument("--max-tokens", type=positive(int), metavar="N",
                   help=f"chat, multiturn: output tokens per request (default: {config.CHAT_MAX_TOKENS}); trace: a cap "
                        "on each line's output_length (default: none)")
    g.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos (vLLM's and duet's extension) so every request makes exactly max_tokens "
                        "tokens (default: on; --no-ignore-eos for servers that refuse the field)")
    g.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals (default: 0)")
    g.add_argument("--timeout-s", type=positive(float), default=300.0, metavar="S",
                   help="per request: to connect, and between two reads of the response (default: %(default)s)")
    g = p.add_argument_group("SLO and output")
    g.add_argument("--slo-ttft-ms", type=positive(float), metavar="MS",
                   help="a request meets the SLO only if it completed and its TTFT is at most this")
    g.add_argument("--slo-tpot-ms", type=positive(float), metavar="MS", help="... and its TPOT at most this")
    g.add_argument("--json", dest="json_path", type=Path, metavar="OUT",
                   help="write the summary, the config and every request's record as one JSON object")
    g.add_argument("--records", dest="records_path", type=Path, metavar="OUT.jsonl",
                   help="write one JSON record per request")
    g.add_argument("--plot", dest="plot_path", type=Path, metavar="OUT.png",
                   help="latency CDFs and output throughput over time (needs matplotlib: pip install 'duet[plot]')")
    p.set_defaults(func=cmd_bench_serve)


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


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from benchmarks.sim.trace_replay import TraceError
    from duet.bench_serve.config import ServeBenchConfig
    from duet.bench_serve.load import Sampling, run, run_load, served_model
    from duet.bench_serve.metrics import SLO, summarize
    from duet.bench_serve.report import format_table, summary_json, write_json, write_records

    try:
        config = ServeBenchConfig.from_args(args)
        sessions = config.sessions()
    except OSError as e:
        print(f"error: cannot read trace {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except (ValueError, TraceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model = config.model or run(served_model(config.endpoint()))  # OSError: `duet` prints it, status 1
    sampling = Sampling(model, config.temperature, config.ignore_eos)
    num_requests = sum(s.num_turns for s in sessions)
    header = {**config.to_json(), "model": model, "requests": num_requests}
    print("config: " + " ".join(f"{k}={v}" for k, v in header.items() if v is not None), flush=True)
    with tqdm(total=num_requests, file=sys.stderr, unit="req", desc="bench serve",
              disable=not sys.stderr.isatty()) as bar:  # a bar for people, not for pipes
        records = run(run_load(config.endpoint(), sessions, sampling, config.plan(),
                            on_record=lambda record: bar.update(1)))
    summary = summarize(records, SLO(config.slo_ttft_ms, config.slo_tpot_ms))
    print(format_table(summary))
    failed = [r for r in records if not r.ok]
    if failed:
        first = failed[0]
        print(f"warning: {len(failed)} of {len(records)} requests failed; the first, request {first.request_index}: "
              f"{first.error}", file=sys.stderr)
    if config.json_path is not None:
        write_json(config.json_path, summary_json(summary, header, records))
    if config.records_path is not None:
        write_records(config.records_path, records)
    if config.plot_path is not None:
        from duet.bench_serve.plot import plot_run

        plot_run(config.plot_path, records, f"duet bench serve: {config.workload} on {model} at {config.url}")
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
    """Stand-alone entry (`python -m duet.cli_bench bench route TRACE`), same as `duet bench route TRACE` (and
    `bench serve`): an error is one line, status 2 for a bad value, 1 for a server that cannot be reached."""
    parser = argparse.ArgumentParser(prog="duet")
    add_bench_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
