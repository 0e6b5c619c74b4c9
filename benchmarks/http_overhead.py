"""What the OpenAI HTTP layer costs on top of the router's gRPC API, and what `n` saves over n requests.

    python benchmarks/http_overhead.py [--model smollm2|small|PATH] [--tokens 64] [--repeats 7] [--n 4]

One local cluster (redis, router with HTTP, 1 prefill, 1 decode), one greedy request at a time, the same prompt
and token count through three clients, interleaved in each repeat: the gRPC client (the ceiling: the HTTP layer
is a client of it inside the router process), the official `openai` client streaming (SSE), and the same
without streaming. Per mode it prints min/median/max over repeats of the end-to-end time and of the median gap
between streamed chunks, and each HTTP mode's ratio to gRPC. Then `n`: one completion with n seeded samples
against n single requests sent together (the same seeds), end-to-end time and prompt tokens the prefill worker
computed (from the router's cached-token counter). The machine is small and shared: read ratios.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_throughput import MODEL_SPECS, ensure_checkpoint  # noqa: E402

from deploy.local_cluster import ClusterConfig, LocalCluster  # noqa: E402
from duet.client import Client  # noqa: E402
from engine import SamplingParams  # noqa: E402

PROMPT = ("You are a careful assistant. Answer briefly and precisely, and say so when you do not know. " * 3
          + "Question: what is the capital of France?")


def fmt_ms(values: list[float]) -> str:
    return f"{1000 * min(values):7.1f} / {1000 * statistics.median(values):7.1f} / {1000 * max(values):7.1f}"


def fmt_ratio(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def median_gap(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else float("nan")


def run_grpc(client: Client, tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    arrivals = []
    for msg in client.generate(PROMPT, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)):
        if msg.token_ids:
            arrivals.append(time.perf_counter())
    return time.perf_counter() - start, median_gap(arrivals)


def run_http(http: openai.OpenAI, model: str, tokens: int, stream: bool) -> tuple[float, float]:
    start = time.perf_counter()
    if not stream:
        out = http.completions.create(model=model, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == tokens
        return time.perf_counter() - start, float("nan")
    arrivals = []
    for chunk in http.completions.create(model=model, prompt=PROMPT, max_tokens=tokens, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True}):
        if chunk.choices:
            arrivals.append(time.perf_counter())
    return time.perf_counter() - start, median_gap(arrivals)


def cached_tokens(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "duet_router_actual_cached_tokens_total")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (the default model), a random model of "
                   "offline_throughput.py's MODEL_SPECS, or a checkpoint dir / .gguf file")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--n", type=int, default=4)
    args = p.parse_args(argv)
    model_dir = ensure_checkpoint(args.model) if args.model in MODEL_SPECS or args.model == "smollm2" else args.model
    print(f"# http_overhead {dt.date.today()} {platform.node()} model={args.model} ({Path(model_dir).name}) "
          f"tokens={args.tokens} repeats={args.repeats} n={args.n}", flush=True)
    config = ClusterConfig(model_dir=str(model_dir), worker_args=["--num-kv-blocks", "512", "--max-model-len", "1024"],
                           router_args=["--max-model-len", "1024"], http_port=0)
    with LocalCluster(config).start() as cluster, Client(cluster.router_address) as client, \
            openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="none", max_retries=0, timeout=300) as http:
        model = http.models.list().data[0].id
        for _ in range(2):  # warm: the prompt's prefix is cached from here on, for every mode alike
            run_grpc(client, args.tokens)
            run_http(http, model, args.tokens, True)
        modes = {"grpc": lambda: run_grpc(client, args.tokens),
                 "http stream": lambda: run_http(http, model, args.tokens, True),
                 "http json": lambda: run_http(http, model, args.tokens, False)}
        e2e: dict[str, list[float]] = {m: [] for m in modes}
        gap: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.repeats):
            for name, run in modes.items():
                total, g = run()
                e2e[name].append(total)
                gap[name].append(g)
        print(f"{'mode':<12} {'e2e ms min / med / max':>27} {'chunk gap ms':>27} {'e2e / grpc':>22}")
        for name in modes:
            ratios = [a / b for a, b in zip(e2e[name], e2e["grpc"])]
            gaps = fmt_ms(gap[name]) if name != "http json" else f"{'-':>27}"
            print(f"{name:<12} {fmt_ms(e2e[name]):>27} {gaps:>27} {fmt_ratio(ratios):>22}")

        tokens = 16
        times: dict[str, list[float]] = {"n": [], "singles": []}
        prefilled: dict[str, list[float]] = {"n": [], "singles": []}
        for r in range(args.repeats):
            for mode in ("n", "singles"):
                salt = f"n-bench-{mode}-{r}"  # a fresh prefix each time: the first sample computes it
                before = cached_tokens(cluster.http_url)
                start = time.perf_counter()
                if mode == "n":
                    http.completions.create(model=model, prompt=PROMPT, n=args.n, max_tokens=tokens, temperature=1,
                                            seed=7, extra_body={"ignore_eos": True, "cache_salt": salt})
                else:
                    with concurrent.futures.ThreadPoolExecutor(args.n) as pool:
                        list(pool.map(lambda i, salt=salt: http.completions.create(
                            model=model, prompt=PROMPT, max_tokens=tokens, temperature=1, seed=7 + i,
                            extra_body={"ignore_eos": True, "cache_salt": salt}), range(args.n)))
                times[mode].append(time.perf_counter() - start)
                prefilled[mode].append(cached_tokens(cluster.http_url) - before)
        prompt_tokens = httpx.post(cluster.http_url + "/tokenize", json={"prompt": PROMPT}, timeout=10).json()["count"]
        print(f"\nn={args.n} samples of {tokens} tokens (prompt {prompt_tokens} tokens), fresh prefix each:")
        print(f"{'mode':<12} {'e2e ms min / med / max':>27} {'cached prompt tokens (median)':>31}")
        for mode in ("n", "singles"):
            print(f"{mode:<12} {fmt_ms(times[mode]):>27} {statistics.median(prefilled[mode]):>31.0f}")
        ratios = [a / b for a, b in zip(times["n"], times["singles"])]
        print(f"n / singles e2e: {fmt_ratio(ratios)}")


if __name__ == "__main__":
    main()
