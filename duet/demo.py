"""`duet demo`: the main job, by default on the embedded SmolLM2-135M-Instruct. Starts a local cluster (redis,
router, two prefill workers and one decode worker as processes), streams chat requests through the public gRPC
API and prints each answer with where it was served (prefill and decode worker), TTFT, TPOT and cached prompt
tokens, then shuts the cluster down:

- a two-turn chat: the second turn resends the first (system prompt, question, answer), so its prefill reuses
  the first turn's cached blocks on the same prefill worker;
- questions sharing one system prompt: the first warms a prefill worker's prefix cache, the rest stream
  concurrently and the router sends them to that worker.

Decoding is greedy, so the answers are the model's most likely ones and end at EOS (or `max_tokens`)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from duet.client import Client, stream_to_record
from engine.default_model import DEFAULT_MODEL_LABEL, is_default_model
from engine.sampling_params import SamplingParams

NUM_PREFILL = 2
NUM_DECODE = 1
CHAT_SYSTEM = "You are a helpful assistant. Answer in one short sentence."
CHAT_TURNS = ["What is the capital of France?", "And what is the capital of Germany?"]
# Long enough to fill several KV blocks, so the cache reuse shows in `cached` of every question after the first.
SHARED_SYSTEM = ("You are a concise assistant for a geography and science quiz. Answer every question with one "
                 "short, correct sentence. Do not add explanations, lists, or follow-up questions. If a question "
                 "asks for a number, give the number and its unit. If a question asks for a name, give the name.")
SHARED_QUESTIONS = ["What is the largest planet in the solar system?", "What is the chemical symbol for gold?",
                    "Which ocean is the largest?"]


@dataclass(frozen=True)
class Answer:
    """One streamed answer as the demo prints it (client-side TTFT/TPOT, server-side routing and usage)."""

    question: str
    text: str
    finish_reason: str
    num_tokens: int
    prefill_worker: str
    decode_worker: str
    cached_tokens: int
    prompt_tokens: int
    ttft_s: float
    tpot_s: float | None  # None for a one-token answer

    @classmethod
    def from_record(cls, question: str, record: dict) -> Answer:
        return cls(question=question, text=record["text"], finish_reason=record["finish_reason"],
                   num_tokens=len(record["token_ids"]), prefill_worker=record["prefill_worker"],
                   decode_worker=record["decode_worker"], cached_tokens=record["cached_tokens"],
                   prompt_tokens=record["prompt_tokens"], ttft_s=record["ttft_s"], tpot_s=record["tpot_s"])

    def lines(self) -> str:
        tpot = f" tpot={1000 * self.tpot_s:.1f}ms" if self.tpot_s is not None else ""
        return (f"Q: {self.question}\nA: {self.text.strip()}\n"
                f"   [{self.finish_reason}] prefill={self.prefill_worker} decode={self.decode_worker} "
                f"tokens={self.num_tokens} cached_prompt_tokens={self.cached_tokens}/{self.prompt_tokens} "
                f"ttft={1000 * self.ttft_s:.1f}ms{tpot}")


def wait_for_index(client: Client, prompt: list[dict], worker: str, timeout_s: float = 15.0) -> None:
    """Until the router's index shows `worker` holding a cached prefix of `prompt` (its KV events travel
    worker -> Redis -> router asynchronously; on a loaded machine that takes a moment), at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        route = client.explain_route(prompt)
        if any(e.worker_id == worker and e.cached_tokens > 0 for e in route.prefill):
            return
        time.sleep(0.05)


def model_label(model: Path) -> str:
    return DEFAULT_MODEL_LABEL if is_default_model(model) else str(model)


def run_demo(model: Path, max_tokens: int = 64, worker_args: list[str] | None = None) -> int:
    """Run the demo on `model` (a checkpoint dir or .gguf file) and print it; returns the exit code (0)."""
    from deploy.local_cluster import ClusterConfig, LocalCluster

    t0 = time.monotonic()
    config = ClusterConfig(model_dir=str(model), num_prefill=NUM_PREFILL, num_decode=NUM_DECODE,
                           worker_args=worker_args or [])
    print(f"loading {model_label(model)} in {1 + NUM_PREFILL + NUM_DECODE} processes (router, {NUM_PREFILL} "
          f"prefill, {NUM_DECODE} decode) ...", flush=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    with LocalCluster(config).start() as cluster:
        print(f"cluster ready in {time.monotonic() - t0:.1f}s: router at {cluster.router_address} "
              f"({NUM_PREFILL} prefill, {NUM_DECODE} decode, redis at {cluster.redis_url.rsplit('@', 1)[-1]})",
              flush=True)
        with Client(cluster.router_address) as client:
            def ask(messages: list[dict]) -> Answer:
                return Answer.from_record(messages[-1]["content"],
                                          stream_to_record(client.generate(messages, params, timeout_s=120)))

            print("\n== a two-turn chat (turn 2 resends turn 1: its prefix is cached) ==", flush=True)
            history = [{"role": "system", "content": CHAT_SYSTEM}]
            previous: Answer | None = None
            for turn in CHAT_TURNS:
                history.append({"role": "user", "content": turn})
                if previous is not None:  # so the router sees the previous turn's blocks before routing this one
                    wait_for_index(client, history, previous.prefill_worker)
                previous = ask(history)
                history.append({"role": "assistant", "content": previous.text})
                print(previous.lines(), flush=True)

            print("\n== questions sharing a system prompt (the router sends them to the worker that cached it) ==",
                  flush=True)
            conversations = [[{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": q}]
                             for q in SHARED_QUESTIONS]
            first = ask(conversations[0])
            print(first.lines(), flush=True)
            wait_for_index(client, conversations[1], first.prefill_worker)
            with ThreadPoolExecutor(len(conversations) - 1) as pool:  # the rest stream concurrently
                for answer in pool.map(ask, conversations[1:]):
                    print(answer.lines(), flush=True)
        print()
    print("cluster stopped")
    return 0
