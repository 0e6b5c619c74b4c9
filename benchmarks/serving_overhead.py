"""What serving adds to a token: `duet up`'s inter-token latency at concurrency 1 against the same engine's decode
step offline, in one run (issue 20 part 5's target: ITL within 10 % of the offline step).

    .venv/bin/python benchmarks/serving_overhead.py [--model PATH] [--repeats 3] [--requests 8] [--max-tokens 64]

Default: the embedded default model, as `duet demo` and `duet up` serve it. Each repeat, interleaved:

    offline   LLM.generate of one chat prompt (the bench's ~300-token system prompt and a question) with max_tokens
              N and with 1, greedy, ignore_eos: (t_N - t_1) / (N - 1) is the decode step with its Python around it
    served    `duet bench serve --workload chat --concurrency 1` against one `duet up` (1 prefill + 1 decode, started
              once, HTTP, SSE): TPOT p50 and ITL p50 over --requests chats of N tokens

Prints min / median / max over repeats of each and of served / offline. The offline engine runs in this process
while the cluster idles, so both see the same machine; it is small and shared: read the ratios.
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
from serve_compare import wait_ready  # noqa: E402  (the same readiness probe: a served completion)

from duet.bench_serve.workloads import chat_sessions  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

PORT = 18400  # serve_compare's: wait_ready probes it


def offline_step_ms(llm: LLM, prompt: list[int], max_tokens: int) -> float:
    def timed(n: int) -> float:
        start_s = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - start_s

    return 1000 * (timed(max_tokens) - timed(1)) / (max_tokens - 1)


def served(args: argparse.Namespace, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "duet", "bench", "serve", "--url", f"http://127.0.0.1:{PORT}",
                    "--workload", "chat", "--num-requests", str(args.requests), "--concurrency", "1",
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
    args = p.parse_args()
    print(f"# {dt.date.today()} {platform.node()} {os.cpu_count()} CPUs; config: {vars(args)}", flush=True)
    llm = LLM(args.model)
    messages = chat_sessions(1, 300, args.max_tokens, seed=0)[0].request(0).payload["messages"]  # its first chat
    prompt = llm.tokenizer.apply_chat_template_ids(messages)
    offline_step_ms(llm, prompt, 8)  # warm
    cmd = [sys.executable, "-m", "duet", "up", "--port", str(PORT + 1), "--http-port", str(PORT)]
    if args.model:
        cmd += ["--model", args.model]
    offline, tpot, itl = [], [], []
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "up.log", "w") as log:
        up = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(up)
            served(args, Path(tmp) / "warm.json")
            for repeat in range(args.repeats):
                offline.append(offline_step_ms(llm, prompt, args.max_tokens))
                d = served(args, Path(tmp) / f"{repeat}.json")
                tpot.append(d["tpot_ms"]["p50"])
                itl.append(d["itl_ms"]["p50"])
                print(f"repeat {repeat}: offline {offline[-1]:.2f} ms a token; served TPOT p50 {tpot[-1]:.2f}, "
                      f"ITL p50 {itl[-1]:.2f} ms", flush=True)
        finally:
            os.killpg(up.pid, 15)
            up.wait(timeout=60)
    print(f"offline step ms (min / median / max): {spread(offline)}")
    print(f"served TPOT p50 ms: {spread(tpot)}; ITL p50 ms: {spread(itl)}")
    print(f"served / offline, TPOT: {spread([t / o for t, o in zip(tpot, offline)])}; "
          f"ITL: {spread([i / o for i, o in zip(itl, offline)])}")


if __name__ == "__main__":
    main()
