"""`duet demo`: the main job on the embedded model. Starts a local cluster (redis, router, two prefill
workers and one decode worker as processes), streams a handful of chat requests through the public gRPC
API (the first warms a prefill worker's prefix cache; the rest share its long system prompt, so the router
sends them to that worker), prints each answer with the worker that prefilled it, TTFT, TPOT and cached
prompt tokens, and shuts the cluster down."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from duet.client import Client, stream_to_record
from engine.sampling_params import SamplingParams

SYSTEM = "You are a terse assistant. Answer in one sentence. " * 4
NUM_PREFILL = 2
QUESTIONS = ["What is a KV cache?", "Why page it into blocks?", "What does a prefill worker do?",
             "Explain continuous batching.", "Ünïcödé and 日本語 survive detokenization?"]


def wait_for_index(client, prompt, worker: str, timeout_s: float = 15.0) -> None:
    """Until the router's index shows `worker` holding a cached prefix of `prompt` (its KV events travel
    worker -> Redis -> router asynchronously; on a loaded machine that takes a moment), at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        route = client.explain_route(prompt)
        if any(e.worker_id == worker and e.cached_tokens > 0 for e in route.prefill):
            return
        time.sleep(0.05)


def run_demo(model: Path | None, max_tokens: int = 24, worker_args: list[str] | None = None) -> int:
    from deploy.local_cluster import ClusterConfig, LocalCluster

    t0 = time.monotonic()
    config = ClusterConfig(model_dir=str(model) if model else None, num_prefill=NUM_PREFILL, num_decode=1,
                           worker_args=worker_args or [])
    with LocalCluster(config).start() as cluster:
        print(f"cluster ready in {time.monotonic() - t0:.1f}s: router at {cluster.router_address} "
              f"({NUM_PREFILL} prefill, 1 decode, redis at {cluster.redis_url.rsplit('@', 1)[-1]})", flush=True)
        conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
        params = [SamplingParams(max_tokens=max_tokens, temperature=0)] + [
            SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=i)
            for i in range(len(QUESTIONS) - 1)
        ]
        with Client(cluster.router_address) as client:
            first = stream_to_record(client.generate(conversations[0], params[0], timeout_s=60))
            wait_for_index(client, conversations[1], first["prefill_worker"])
            with ThreadPoolExecutor(len(QUESTIONS) - 1) as pool:  # the rest stream concurrently
                rest = list(pool.map(lambda cp: stream_to_record(client.generate(*cp, timeout_s=60)),
                                     zip(conversations[1:], params[1:])))
        for question, record in zip(QUESTIONS, [first, *rest]):
            timing = record["timing"]
            tpot = f" tpot={1000 * record['tpot_s']:.1f}ms" if record["tpot_s"] is not None else ""
            print(f"\nQ: {question}\nA: {record['text']!r}\n   [{record['finish_reason']}] "
                  f"prefill={record['prefill_worker']} tokens={len(record['token_ids'])} "
                  f"cached_prompt_tokens={record['cached_tokens']}/"
                  f"{record['prompt_tokens']} ttft={1000 * record['ttft_s']:.1f}ms{tpot} "
                  f"(prefill {1000 * timing['prefill_s']:.1f}ms, kv transfer {1000 * timing['transfer_s']:.1f}ms)")
        print("\n(the embedded model has random weights: the answers are gibberish by design; "
              "pass --model DIR for a real checkpoint)")
    print("cluster stopped")
    return 0
