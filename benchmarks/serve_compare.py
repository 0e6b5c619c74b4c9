"""The same OpenAI-API load against `duet up` (1 prefill + 1 decode, 1 prefill + 2 decode, 1 + 1 without the
decode-side prefix cache, and 1 + 1 with `--local-prefill-tokens N` as `duet-1p1d-local:N`, 0: every prompt through
the prefill worker), vLLM's OpenAI server and llama.cpp's, one after another, through `duet bench serve` (issue 20
part 7).

    .venv/bin/python benchmarks/serve_compare.py                       # vLLM from $DUET_VLLM_VENV
    .venv/bin/python benchmarks/serve_compare.py --servers duet-1p1d,vllm --repeats 2
    .venv/bin/python benchmarks/serve_compare.py --servers duet-1p1d-gguf,llama.cpp   # llama.cpp from $DUET_LLAMA_VENV

duet and vLLM serve the dense copy of the default model (offline_throughput.dense_copy: the GGUF file's weights,
dequantized) in `--dtype`, so both engines compute the same numbers. `duet-1p1d-gguf` and `llama.cpp` serve the
GGUF file itself, kept quantized (duet's `--quantization auto`; llama-cpp-python's server, `pip install
'llama-cpp-python[server]'` in its own venv, see llama_cpp_worker.py; one request at a time, as that server
runs); `llama-server` is llama.cpp's native server on the same file (`--llama-server PATH` or $DUET_LLAMA_SERVER;
built with cmake from the llama.cpp tree vendored in llama-cpp-python's sdist), 16 slots, continuous batching.
Workloads, each a `duet bench serve` run (greedy, `ignore_eos`, `--max-tokens` each; a ~300-token system prompt
shared by every request):

    chat-c1     `--chat-requests` chats, one at a time (latency: TTFT, TPOT)
    chat-c16    3x as many chats, 16 in flight (throughput)
    multiturn   `--conversations` conversations of `--turns` turns, 4 in flight: each turn resends the history with
                the server's answers (what the decode-side cache and conditional disaggregation are for)
    multiturn-cold  the same, each conversation with a system prompt of its own: its first turn finds nothing cached
                (issue 20's "later turns' TTFT p90 <= half the first turn's" is read here)

Servers start fresh for each repeat (no cache carried between them) and run in the order given, repeat after repeat;
the machine is shared, so read ratios within one run. Prints one line per (server, workload): completed requests,
output tok/s, TTFT and TPOT p50 / p90, goodput and SLO attainment at the same `--slo-ttft-ms` / `--slo-tpot-ms` for
every server, and, for multiturn, the first turns against the later ones: TTFT p90 and the share of prompt tokens
the server reported cached.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import dense_copy  # noqa: E402

from engine.default_model import default_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PORT = 18400


SERVERS = ("duet-1p1d", "duet-1p2d", "duet-1p1d-no-decode-cache", "duet-1p1d-local:N", "vllm", "duet-1p1d-gguf",
           "llama.cpp", "llama-server")
LLAMA_SLOTS = 16  # llama-server's parallel sequences (continuous batching): as many as chat-c16 has in flight


def server_command(name: str, model: Path, dtype: str, venv: str, llama_venv: str = "/work/llama-venv",
                   llama_server: str = "llama-server") -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    duet = [sys.executable, "-m", "duet", "up", "--model", str(model), "--dtype", dtype, "--quantization", "none",
            "--port", str(PORT + 1), "--http-port", str(PORT)]
    if name == "duet-1p1d-gguf":
        return [sys.executable, "-m", "duet", "up", "--model", str(default_model_path()), "--dtype", dtype,
                "--port", str(PORT + 1), "--http-port", str(PORT)], env
    if name == "llama-server":  # llama.cpp's native server, built with cmake (llama_cpp_worker.py's recipe)
        return [llama_server, "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(PORT),
                "-t", str(os.cpu_count()), "-c", str(LLAMA_SLOTS * 512), "--parallel", str(LLAMA_SLOTS),
                "--seed", "0"], env
    if name == "llama.cpp":
        return [f"{llama_venv}/bin/python", "-m", "llama_cpp.server", "--model", str(default_model_path()),
                "--host", "127.0.0.1", "--port", str(PORT), "--n_threads", str(os.cpu_count()), "--n_ctx", "4096",
                "--seed", "0", "--interrupt_requests", "False"], env  # its default cuts a stream when the next arrives
    if name == "duet-1p1d":
        return duet, env
    if name == "duet-1p2d":
        return duet + ["--decode", "2"], env
    if name.startswith("duet-1p1d-local:"):  # conditional disaggregation's threshold N (0: every prompt disaggregated)
        return duet + ["--local-prefill-tokens", str(int(name.split(":")[1]))], env
    if name == "duet-1p1d-no-decode-cache":
        return duet + ["--decode-args=--no-prefix-caching"], env
    if name == "vllm":
        env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
        return [f"{venv}/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--dtype", dtype, "--max-model-len", "2048", "--port", str(PORT), "--seed", "0"], env
    raise SystemExit(f"--servers: {name!r} is not one of {', '.join(SERVERS)}")


@contextmanager
def serving(cmd: list[str], log_path: Path, **popen_args) -> Iterator[subprocess.Popen]:
    """The server `cmd` started in its own process group (output to log_path), once it serves on PORT; stopped
    (SIGTERM to the group, if still running) on the way out."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **popen_args)
        try:
            wait_ready(process)
            yield process
        finally:
            if process.poll() is None:
                os.killpg(process.pid, 15)
            process.wait(timeout=60)


def wait_ready(process: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with status {process.returncode} before serving")
        try:  # a one-token completion: /v1/models may answer before any worker serves
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=2) as response:
                model = json.load(response)["data"][0]["id"]
            body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                if response.status == 200:
                    return
        except (OSError, ValueError, KeyError, IndexError):
            pass
        time.sleep(1)
    raise SystemExit(f"the server did not serve within {timeout_s:.0f} s")


def bench(args: argparse.Namespace, workload: str, out: Path) -> dict:
    base = [sys.executable, "-m", "duet", "bench", "serve", "--url", f"http://127.0.0.1:{PORT}",
            "--max-tokens", str(args.max_tokens), "--json", str(out), "--slo-ttft-ms", f"{args.slo_ttft_ms:g}",
            "--slo-tpot-ms", f"{args.slo_tpot_ms:g}"]
    if workload == "chat-c1":
        extra = ["--workload", "chat", "--num-requests", str(args.chat_requests), "--concurrency", "1"]
    elif workload == "chat-c16":
        extra = ["--workload", "chat", "--num-requests", str(3 * args.chat_requests), "--concurrency", "16"]
    elif workload in ("multiturn", "multiturn-cold"):
        extra = ["--workload", "multiturn", "--num-conversations", str(args.conversations), "--turns",
                 str(args.turns), "--concurrency", "4"]
        if workload == "multiturn-cold":
            extra += ["--system-prompt", "per-session"]
    else:
        raise SystemExit(f"--workloads: {workload!r} is not one of chat-c1, chat-c16, multiturn, multiturn-cold")
    subprocess.run(base + extra, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def by_turn(records: list[dict]) -> str:
    """A conversation's first turn against its later ones: TTFT p90 and the share of prompt tokens the server
    reported cached (usage.prompt_tokens_details.cached_tokens; duet counts both workers' caches); "-" for a
    workload of one turn, or a share the server does not report."""
    def summary(turns: list[dict]) -> str:
        ttft = np.percentile([r["ttft_ms"] for r in turns], 90)
        counted = [r for r in turns if r["prompt_tokens"] and r["cached_tokens"] is not None]
        share = (f"{sum(r['cached_tokens'] for r in counted) / sum(r['prompt_tokens'] for r in counted):.2f}"
                 if counted else "-")
        return f"{ttft:.0f}, {share}"

    ok = [r for r in records if r["ok"] and r["ttft_ms"] is not None]
    first, later = [r for r in ok if r["turn"] == 0], [r for r in ok if r["turn"] > 0]
    return f"{summary(first)} / {summary(later)}" if first and later else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", default="duet-1p1d,duet-1p2d,duet-1p1d-no-decode-cache,vllm")
    p.add_argument("--workloads", default="chat-c1,chat-c16,multiturn")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chat-requests", type=int, default=16)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="the SLOs goodput counts against, every server")
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--vllm-venv", default=os.environ.get("DUET_VLLM_VENV", str(Path.home() / ".cache/duet/vllm-venv")))
    p.add_argument("--llama-venv", default=os.environ.get("DUET_LLAMA_VENV", "/work/llama-venv"))
    p.add_argument("--llama-server", default=os.environ.get("DUET_LLAMA_SERVER", "llama-server"),
                   help="llama.cpp's native server binary (for --servers llama-server)")
    args = p.parse_args()
    model = dense_copy(default_model_path())
    print(f"config: {vars(args)} model={model}", flush=True)
    print("| repeat | server | workload | completed | output tok/s | TTFT p50 / p90 ms | TPOT p50 / p90 ms | goodput "
          "req/s | SLO attainment | turn 1 / later turns: TTFT p90 ms, cached share |\n"
          "|---:|---|---|---:|---:|---|---|---:|---:|---|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in args.servers.split(","):
                cmd, env = server_command(name, model, args.dtype, args.vllm_venv, args.llama_venv, args.llama_server)
                with serving(cmd, Path(tmp) / f"{name}-{repeat}.log", env=env, cwd=tmp):
                    for workload in args.workloads.split(","):
                        d = bench(args, workload, Path(tmp) / f"{name}-{workload}-{repeat}.json")
                        ttft, tpot = d["ttft_ms"], d["tpot_ms"]
                        print(f"| {repeat} | {name} | {workload} | {d['completed']}/{d['requests']} | "
                              f"{d['output_tokens_per_s']:.1f} | {ttft['p50']:.0f} / {ttft['p90']:.0f} | "
                              f"{tpot['p50']:.1f} / {tpot['p90']:.1f} | {d['goodput_rps']:.2f} | "
                              f"{d['slo_attainment']:.2f} | {by_turn(d['records'])} |", flush=True)
                time.sleep(2)


if __name__ == "__main__":
    main()
