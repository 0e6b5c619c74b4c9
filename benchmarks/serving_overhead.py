"""What serving adds to a token: `duet up`'s inter-token latency at concurrency 1 against the same engine's decode
step offline, in one run (issue 20 part 5's target: ITL within 10 % of the offline step).

    .venv/bin/python benchmarks/serving_overhead.py [--model PATH] [--repeats 3] [--requests 8] [--max-tokens 64]
                                                    [--threads N]

Default: the embedded default model, as `duet demo` and `duet up` serve it. Each repeat, interleaved:

    offline   the same --requests chats (the bench's ~300-token system prompt and a question each, greedy,
              ignore_eos, N tokens), one at a time through the engine in this process (`LLMEngine.step`: scheduler,
              model, sampling, detokenization), each step's output timed as it returns: TPOT p50 and ITL p50 as
              `duet bench serve` computes them from its chunks' arrival times
    served    `duet bench serve --workload chat --concurrency 1` against one `duet up` (1 prefill + 1 decode, started
              once, HTTP, SSE): TPOT p50 and ITL p50 over those chats

Both sides are medians of the same kind over the same tokens, so a burst of this shared machine's noise moves
neither much (until 2026-11-29 the offline figure was one generation's (t_N - t_1) / (N - 1), a mean, which moved
by up to 25 % between repeats).

Prints min / median / max over repeats of each and of served / offline. The offline engine runs in this process
while the cluster idles, so both see the same machine; it is small and shared: read the ratios.

Also the CPU time a token of each part of the cluster while serving (utime + stime; Linux's /proc), which a shared
machine's noise moves far less than the latencies: the decode worker's engine (the thread named `decode-engine` and
its OpenMP pool, which take it from worker/engine_thread.py) and the rest of the decode worker (gRPC, KV receive,
heartbeats), the router, the prefill worker and redis-server: the serving work a token beside the engine. On a
machine whose cores the engine's threads fill, that work is taken from the engine's steps. (The load generator's
own cost a chunk: benchmarks/load_client_cpu.py.)
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from router_cpu import child_pid, cpu_s  # noqa: E402
from serve_compare import serving  # noqa: E402  (the same readiness probe: a served completion)

from duet.bench_serve.workloads import chat_sessions  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

PORT = 18400  # serve_compare's: wait_ready probes it
SYSTEM_PROMPT_TOKENS, SEED = 300, 0  # the chats both sides run (given to `duet bench serve` too)
SERVED_PROCESSES = {"decode worker": "duet decode", "router": "duet router", "prefill worker": "duet prefill",
                    "redis-server": "redis-server"}  # name -> what its command line holds (children of `duet up`)
ENGINE_THREAD = "decode-engine"  # decode_worker/decode_loop.py's EngineThread: its OS name, and its pool's


def offline_latency_ms(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(TPOT p50, ITL p50) of `prompts` generated one at a time offline, from the times the engine's steps return
    each one's tokens (duet/bench_serve/stream_timer.py's definitions: TPOT per request, ITL per pair of successive
    outputs, pooled)."""
    engine, params = llm.engine, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    tpot_ms, itl_ms = [], []
    for prompt in prompts:
        engine.add_request({"prompt_token_ids": prompt}, params)
        times_s = []
        while engine.has_unfinished_requests():
            gained = engine.step()
            if gained:
                times_s.append(time.perf_counter())
        tpot_ms.append(1000 * (times_s[-1] - times_s[0]) / (max_tokens - 1))
        itl_ms += [1000 * (b - a) for a, b in zip(times_s, times_s[1:])]
    return statistics.median(tpot_ms), statistics.median(itl_ms)


def engine_cpu_s(pid: int) -> float:
    """CPU seconds of process pid's threads named ENGINE_THREAD (those that ended are not counted)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == ENGINE_THREAD:
                total += cpu_s(f"{pid}/task/{task.name}")
        except OSError:  # the thread ended meanwhile
            pass
    return total


def cluster_cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each part of the cluster: the decode worker split into its engine and the rest."""
    seconds = {name: cpu_s(pid) for name, pid in pids.items()}
    seconds["decode engine"] = engine_cpu_s(pids["decode worker"])
    seconds["decode worker"] -= seconds["decode engine"]
    return seconds


def served(args: argparse.Namespace, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "duet", "bench", "serve", "--url", f"http://127.0.0.1:{PORT}",
                    "--workload", "chat", "--num-requests", str(args.requests), "--concurrency", "1",
                    "--system-prompt-tokens", str(SYSTEM_PROMPT_TOKENS), "--seed", str(SEED),
                    "--max-tokens", str(args.max_tokens), "--json", str(out)], check=True, capture_output=True)
    return json.loads(out.read_text())


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: the embedded default model)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None,
                   help="engine threads on both sides (default: torch's, all cores); fewer than the cores leaves "
                        "the serving path a core of its own")
    args = p.parse_args()
    print(f"# {dt.date.today()} {platform.node()} {os.cpu_count()} CPUs; config: {vars(args)}", flush=True)
    llm = LLM(args.model, num_threads=args.threads)
    prompts = [llm.tokenizer.apply_chat_template_ids(session.request(0).payload["messages"])
               for session in chat_sessions(args.requests, SYSTEM_PROMPT_TOKENS, args.max_tokens, SEED)]
    offline_latency_ms(llm, prompts[:1], 8)  # warm
    cmd = [sys.executable, "-m", "duet", "up", "--port", str(PORT + 1), "--http-port", str(PORT)]
    if args.model:
        cmd += ["--model", args.model]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    tokens = args.requests * args.max_tokens  # ignore_eos: exactly max_tokens each, on both sides
    offline_tpot, offline_itl, tpot, itl = [], [], [], []
    cpu_ms = {name: [] for name in ["decode engine", *SERVED_PROCESSES]}
    with tempfile.TemporaryDirectory() as tmp, serving(cmd, Path(tmp) / "up.log") as up:
        pids = {name: child_pid(up.pid, needle) for name, needle in SERVED_PROCESSES.items()}
        served(args, Path(tmp) / "warm.json")
        for repeat in range(args.repeats):
            o_tpot, o_itl = offline_latency_ms(llm, prompts, args.max_tokens)
            offline_tpot.append(o_tpot)
            offline_itl.append(o_itl)
            start = cluster_cpu_s(pids)
            d = served(args, Path(tmp) / f"{repeat}.json")
            end = cluster_cpu_s(pids)
            for name in start:
                cpu_ms[name].append(1000 * (end[name] - start[name]) / tokens)
            tpot.append(d["tpot_ms"]["p50"])
            itl.append(d["itl_ms"]["p50"])
            print(f"repeat {repeat}: offline TPOT p50 {o_tpot:.2f}, ITL p50 {o_itl:.2f} ms; served TPOT p50 "
                  f"{tpot[-1]:.2f}, ITL p50 {itl[-1]:.2f} ms", flush=True)
    print(f"offline TPOT p50 ms (min / median / max): {spread(offline_tpot)}; ITL p50 ms: {spread(offline_itl)}")
    print(f"served TPOT p50 ms: {spread(tpot)}; ITL p50 ms: {spread(itl)}")
    print(f"served / offline, TPOT: {spread([t / o for t, o in zip(tpot, offline_tpot)])}; "
          f"ITL: {spread([i / o for i, o in zip(itl, offline_itl)])}")
    print("CPU ms a token while serving: " + "; ".join(f"{name} {spread(values)}" for name, values in cpu_ms.items()))
    beside = [sum(values[i] for name, values in cpu_ms.items() if name != "decode engine") for i in range(args.repeats)]
    print(f"serving work beside the engine, CPU ms a token: {spread(beside)}")


if __name__ == "__main__":
    main()
