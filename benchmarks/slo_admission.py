"""SLO-aware admission under overload (issue 20 part 6): goodput of `duet up` (1 prefill + 1 decode, default
model) at 1.5x its capacity, with and without the router's `--slo-ttft-ms`, through `duet bench serve`.

    .venv/bin/python benchmarks/slo_admission.py
    .venv/bin/python benchmarks/slo_admission.py --slo-ttft-ms 1500 --rates 0.3,0.6,0.9,1.2 --repeats 5
    .venv/bin/python benchmarks/slo_admission.py --up-args "--local-prefill-tokens 256"   # with local prefills

Load: the Mooncake-format trace (../shared/data/traces), prompts scaled to `--trace-block-tokens` tokens a block
(distinct prefixes, so prefill is the work that queues), each output capped at `--max-tokens`, open loop (Poisson at
`--request-rate`, seeded), `--num-requests` a run. Goodput = requests within the TTFT SLO (and completed) per second
of the run; a refused request (429) counts as not good, as a missed one does.

0. warm-up: each server first serves `--num-requests` of the trace's prompts under their own seed at 1 req/s, so
   its prefill worker has measured its speed (a fresh one reports none, and the router's default is a guess);
1. capacity: one server without admission, swept over `--rates`, each rate with prompts of its own (a seed each:
   the same prompts again would be prefix-cache hits); capacity = the highest goodput seen (the rate that gave it
   is the capacity rate);
2. overload: 1.5x the capacity rate, `--repeats` times against that server (no admission), then as many times
   against a fresh one with `--slo-ttft-ms` (admission), seeds 1..repeats for both.
Prints one line per run, then goodput / capacity (min / median / max) for each, and the admission's
prediction quality from the router's metrics (mean observed / predicted TTFT).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_compare  # noqa: E402

_TRACE_NAME = Path("data") / "traces" / "mooncake_synthetic_trace.jsonl"
# the project's shared data: next to the repository, else /work/shared (as tests/conftest.py looks)
_TRACES = (Path(__file__).resolve().parents[2] / "shared" / _TRACE_NAME, Path("/work/shared") / _TRACE_NAME)
TRACE = next((p for p in _TRACES if p.exists()), _TRACES[-1])


def start_server(slo_ttft_ms: float | None, log_path: Path, up_args: str = "") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "duet", "up", "--port", str(serve_compare.PORT + 1), "--http-port",
           str(serve_compare.PORT), "--metrics-port", str(serve_compare.PORT + 2), *shlex.split(up_args)]
    if slo_ttft_ms is not None:
        cmd += ["--slo-ttft-ms", f"{slo_ttft_ms:g}"]
    process = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    serve_compare.wait_ready(process)
    return process


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, 15)
    process.wait(timeout=60)
    time.sleep(2)


WARM_UP_SEED = 1000  # prompts of their own for each server's warm-up, and for each rate of the sweep
SWEEP_SEED = 100


def bench(args: argparse.Namespace, rate: float, seed: int, out: Path) -> dict:
    result = subprocess.run([sys.executable, "-m", "duet", "bench", "serve", "--url", f"http://127.0.0.1:{serve_compare.PORT}",
                    "--workload", "trace", str(args.trace), "--trace-block-tokens", str(args.trace_block_tokens),
                    "--vocab-size", "49152", "--num-requests", str(args.num_requests), "--request-rate", f"{rate:g}",
                    "--max-tokens", str(args.max_tokens), "--slo-ttft-ms", f"{args.slo_ttft_ms:g}",
                    "--seed", str(seed), "--json", str(out)], capture_output=True, text=True)
    if not out.exists():
        raise SystemExit(f"duet bench serve failed: {result.stderr[-2000:]}")
    return json.loads(out.read_text())


def prediction_ratio() -> tuple[float, int, float]:
    """(mean observed / predicted TTFT, first tokens measured, requests refused) from the router's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{serve_compare.PORT + 2}/metrics", timeout=5).read().decode()

    def sample(name: str) -> float:
        found = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, flags=re.M)
        return float(found.group(1)) if found else 0.0

    count = sample("duet_router_ttft_prediction_ratio_count")
    ratio = sample("duet_router_ttft_prediction_ratio_sum") / count if count else float("nan")
    return ratio, int(count), sample("duet_router_slo_rejected_requests_total")


def line(kind: str, rate: float, seed: int, d: dict) -> str:
    ttft = d["ttft_ms"]
    return (f"| {kind} | {rate:.2f} | {seed} | {d['completed']}/{d['requests']} | {d['goodput_rps']:.2f} | "
            f"{d['slo_attainment']:.2f} | {ttft['p50'] or 0:.0f} / {ttft['p90'] or 0:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--rates", default="0.3,0.6,0.9", help="requests/s swept for the capacity")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--trace-block-tokens", type=int, default=4)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--port", type=int, default=serve_compare.PORT, help="HTTP port; gRPC and metrics take the next two")
    p.add_argument("--log-dir", type=Path, default=None, help="keep the servers' logs here (default: a temp dir)")
    p.add_argument("--up-args", default="--local-prefill-tokens 0",
                   help="more `duet up` flags for every server (default: prompts on the prefill worker, as `duet up "
                        "--slo-ttft-ms` runs, so the arms differ only by admission)")
    args = p.parse_args()
    serve_compare.PORT = args.port  # wait_ready and the commands below read it
    print(f"config: {vars(args)}", flush=True)
    header = "| server | offered req/s | seed | completed | goodput req/s | attainment | TTFT p50 / p90 ms |\n" \
             "|---|---:|---:|---:|---:|---:|---|"
    print(header, flush=True)
    goodput: dict[str, list[float]] = {"no admission": [], "admission": []}
    with tempfile.TemporaryDirectory() as tmp:
        logs = args.log_dir or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        process = start_server(None, logs / "plain.log", args.up_args)
        try:
            bench(args, 1.0, WARM_UP_SEED, Path(tmp) / "warm-up.json")  # the prefill speed measured, kernels warm
            sweep = {}
            for i, rate in enumerate(float(r) for r in args.rates.split(",")):
                # each rate its own prompts: the trace's prompts again would all be prefix-cache hits
                sweep[rate] = bench(args, rate, SWEEP_SEED + i, Path(tmp) / f"sweep-{rate}.json")
                print(line("sweep, no admission", rate, SWEEP_SEED + i, sweep[rate]), flush=True)
            capacity_rate = max(sweep, key=lambda r: sweep[r]["goodput_rps"])
            capacity = sweep[capacity_rate]["goodput_rps"]
            overload_rate = 1.5 * capacity_rate
            for seed in range(1, args.repeats + 1):
                d = bench(args, overload_rate, seed, Path(tmp) / f"plain-{seed}.json")
                goodput["no admission"].append(d["goodput_rps"])
                print(line("no admission", overload_rate, seed, d), flush=True)
            plain_ratio = prediction_ratio()
        finally:
            stop_server(process)
        process = start_server(args.slo_ttft_ms, logs / "admission.log", args.up_args)
        try:
            bench(args, 1.0, WARM_UP_SEED, Path(tmp) / "warm-up-admission.json")  # as the server without admission
            for seed in range(1, args.repeats + 1):
                d = bench(args, overload_rate, seed, Path(tmp) / f"admission-{seed}.json")
                goodput["admission"].append(d["goodput_rps"])
                print(line(f"--slo-ttft-ms {args.slo_ttft_ms:g}", overload_rate, seed, d), flush=True)
            admission_ratio = prediction_ratio()
        finally:
            stop_server(process)
    print(f"\ncapacity: {capacity:.2f} good req/s at {capacity_rate:g} req/s offered; "
          f"overload: {overload_rate:g} req/s")
    for name, values in goodput.items():
        fractions = [v / capacity for v in values]
        print(f"{name}: goodput / capacity min {min(fractions):.2f} median {statistics.median(fractions):.2f} "
              f"max {max(fractions):.2f}")
    for name, (ratio, count, refused) in (("no admission", plain_ratio), ("admission", admission_ratio)):
        print(f"{name}: observed / predicted TTFT mean {ratio:.2f} over {count} first tokens; {refused:.0f} refused")


if __name__ == "__main__":
    main()
