"""The router's CPU time per output token under load, for two source trees interleaved (a change against its parent).

    .venv/bin/python benchmarks/router_cpu.py --trees /tmp/before /work/main [--rounds 2] [--repeats 3]
                                              [--concurrency 16] [--num-requests 48]

For each tree, `duet up` (1 prefill + 1 decode, default model) is started with PYTHONPATH at the tree, and `duet bench
serve --workload chat --concurrency C` (N chats x 64 tokens) is run `--repeats` times against it; the router's and
the decode worker's CPU seconds (utime + stime from /proc, all threads) over each run are divided by the run's output
tokens (the decode worker's include its engine). The trees alternate `--rounds` times so the machine's drift hits
both. The first repeat of each start warms the cluster and is printed but not summarized. Prints each run, then
min / median / max per tree of router and decode worker ms a token, output tok/s, TPOT p50, ITL p50 and TTFT p50.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_compare import PORT, serving  # noqa: E402


def cpu_s(pid: int | str) -> float:
    """CPU seconds (user + system) of a process, all its threads; or of one thread, given as "PID/task/TID"."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pid(parent: int, needle: str) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if needle in cmdline and int(stat[1]) == parent:
            return int(entry.name)
    raise SystemExit(f"no child of {parent} runs {needle!r}")


def run_tree(tree: str, args: argparse.Namespace, tmp: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, "-m", "duet", "up", "--port", str(PORT + 1), "--http-port", str(PORT)]
    rows = []
    with serving(cmd, tmp / "up.log", cwd=tree, env=env) as up:
        router, decode = child_pid(up.pid, "duet router"), child_pid(up.pid, "duet decode")
        for repeat in range(args.repeats):
            out = tmp / f"{repeat}.json"
            router_s, decode_s = cpu_s(router), cpu_s(decode)
            subprocess.run([sys.executable, "-m", "duet", "bench", "serve", "--url", f"http://127.0.0.1:{PORT}",
                            "--workload", "chat", "--num-requests", str(args.num_requests), "--concurrency",
                            str(args.concurrency), "--max-tokens", "64", "--json", str(out)],
                           check=True, capture_output=True, cwd=tree, env=env)
            router_s, decode_s = cpu_s(router) - router_s, cpu_s(decode) - decode_s
            d = json.loads(out.read_text())
            tokens = d["output_tokens_per_s"] * d["duration_s"]
            rows.append({"tree": tree, "repeat": repeat, "router_ms_per_token": 1000 * router_s / tokens,
                         "decode_ms_per_token": 1000 * decode_s / tokens, "tok_s": d["output_tokens_per_s"],
                         "tpot_p50_ms": d["tpot_ms"]["p50"], "itl_p50_ms": d["itl_ms"]["p50"],
                         "ttft_p50_ms": d["ttft_ms"]["p50"]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs=2, required=True, help="two source trees (git worktrees)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=48)
    args = p.parse_args()
    print(f"# {dt.date.today()} {platform.node()} {os.cpu_count()} CPUs; config: {vars(args)}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for tree in args.trees:
                rows += run_tree(tree, args, Path(tmp))
    for tree in args.trees:
        kept = [r for r in rows if r["tree"] == tree and r["repeat"] > 0]
        summary = []
        for key in ("router_ms_per_token", "decode_ms_per_token", "tok_s", "tpot_p50_ms", "itl_p50_ms", "ttft_p50_ms"):
            values = [r[key] for r in kept]
            summary.append(f"{key} {min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}")
        print(f"{tree}: " + "; ".join(summary))


if __name__ == "__main__":
    main()
