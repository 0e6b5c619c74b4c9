"""Where a disaggregated cluster's decode worker gets a draft model's prompt KV, end to end (issue 19 part 4): shipped
by the prefill worker with the target's (duet's choice, SGLang's) or recomputed by the decode worker, which feeds the
draft the prompt `MAX_CATCH_UP_TOKENS` a step before it can guess (vLLM's way, vllm#54926). Same run, same machine:

    shipped    prefill and decode workers with the draft; its KV travels after the target's
    catch-up   the decode worker alone has the draft (Runtime.draft_ships_kv patched off in the worker processes,
               through a sitecustomize on PYTHONPATH: the code path duet took for a draft of another shape until
               the layout learnt two shapes)
    no draft   neither: the floor

Each arm is a LocalCluster (1 prefill + 1 decode), all three up at once, one warm-up request each; then --repeats
rounds of one request per arm, the arms interleaved in a rotating order (the machine's load drifts), each a fresh
random prompt of --prompt-tokens (no prefix hit), greedy, --max-tokens: the client's time to the first token (TTFT)
and to its 16th and last; and the decode worker's draft prompt catch-up tokens over all of them.

    PYTHONPATH=. .venv/bin/python benchmarks/draft_kv_shipping.py [--prompt-tokens 1536] [--repeats 3]

The models are random (make_tiny_model, one tokenizer): a target shaped as SmolLM2-135M (30 layers, 9 heads, 3 KV
heads of 64) and a draft of another KV shape (4 layers, 2 KV heads of 64). Random drafts are rarely accepted; the
speculative config's back-offs are off so that both arms keep drafting: what differs is where the draft's prompt KV
comes from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from deploy.local_cluster import ClusterConfig, LocalCluster
from duet.client import Client
from engine.ports import pick_free_port
from engine.sampling_params import SamplingParams
from engine.tiny_model import make_tiny_model

PATCH = "import engine.runtime as r\nr.Runtime.draft_ships_kv = property(lambda self: False)\n"


def catch_up_tokens(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("duet_draft_prompt_catch_up_tokens_total"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def one_request(client: Client, prompt: list[int], params: SamplingParams) -> tuple[float, float, float]:
    """Seconds to the first token, the 16th and the last."""
    start = time.perf_counter()
    marks, n = [], 0
    for message in client.generate(prompt, params, timeout_s=600):
        if not message.token_ids:
            continue
        n += len(message.token_ids)
        now = time.perf_counter() - start
        if not marks:
            marks.append(now)
        if n >= 16 and len(marks) == 1:
            marks.append(now)
    marks.append(time.perf_counter() - start)
    return marks[0], marks[1] if len(marks) == 3 else marks[-1], marks[-1]


def start_arm(stack: contextlib.ExitStack, name: str, target: Path, spec: dict, args, patch_dir: Path
              ) -> tuple[Client, int]:
    """A running cluster for arm `name` (closed with `stack`), its client and its decode worker's metrics port."""
    port = pick_free_port()
    spec_args = ["--speculative-config", json.dumps(spec)]
    max_model_len = str(args.prompt_tokens + args.max_tokens + 64)
    config = ClusterConfig(model_dir=str(target), worker_args=["--max-model-len", max_model_len,
                                                               "--num-kv-blocks", "256"],
                           prefill_args=spec_args if name == "shipped" else [],
                           decode_args=[*(spec_args if name != "no draft" else []), "--metrics-port", str(port)],
                           router_args=["--max-model-len", max_model_len])
    saved = os.environ.get("PYTHONPATH")
    if name == "catch-up":  # the worker processes take the patch at startup
        os.environ["PYTHONPATH"] = os.pathsep.join([str(patch_dir), *filter(None, [saved])])
    try:
        cluster = stack.enter_context(LocalCluster(config).start())
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return stack.enter_context(Client(cluster.router_address)), port


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=1536)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", nargs="+", default=["shipped", "catch-up", "no draft"])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target = make_tiny_model(tmp / "target", layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536,
                                 vocab=args.vocab, seed=1, max_position_embeddings=8192)
        draft = make_tiny_model(tmp / "draft", layers=4, hidden=256, heads=4, kv_heads=2, vocab=args.vocab, seed=2,
                                max_position_embeddings=8192)
        (tmp / "patch").mkdir()
        (tmp / "patch" / "sitecustomize.py").write_text(PATCH)
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                "min_acceptance_rate": 0, "min_speedup": 0}
        print(f"config: target 30 layers x 3 KV heads x 64 (fp32), draft 4 layers x 2 KV heads x 64, vocab "
              f"{args.vocab}, prompt {args.prompt_tokens} tokens, {args.max_tokens} greedy tokens, repeats "
              f"{args.repeats}, spec {spec | {'model': 'draft'}}, torch {torch.__version__}, {os.cpu_count()} CPUs",
              flush=True)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        g = torch.Generator().manual_seed(args.seed)

        def fresh_prompt() -> list[int]:  # random tokens: no prefix-cache hit anywhere
            return torch.randint(10, args.vocab, (args.prompt_tokens,), generator=g).tolist()

        results = {arm: {"ttft": [], "t16": [], "last": []} for arm in args.arms}
        with contextlib.ExitStack() as stack:
            arms = {arm: start_arm(stack, arm, target, spec, args, tmp / "patch") for arm in args.arms}
            for client, _ in arms.values():
                one_request(client, fresh_prompt(), params)  # warm-up
            for repeat in range(args.repeats):  # arms interleaved, in a rotating order: the machine's load drifts
                order = args.arms[repeat % len(args.arms):] + args.arms[: repeat % len(args.arms)]
                for arm in order:
                    marks = one_request(arms[arm][0], fresh_prompt(), params)
                    for key, value in zip(("ttft", "t16", "last"), marks):
                        results[arm][key].append(value)
                    print(f"repeat {repeat} {arm}: ttft {marks[0]:.3f} s, 16th token {marks[1]:.3f} s, token "
                          f"{args.max_tokens} {marks[2]:.3f} s", flush=True)
            for arm, (_, port) in arms.items():
                results[arm]["catch_up"] = [catch_up_tokens(port)]
    print("\n| arm | TTFT s (min / median / max) | 16th token s | last token s | decode draft catch-up tokens |")
    print("|---|---|---|---|---:|")
    for arm, t in results.items():
        cells = [f"{min(v):.3f} / {statistics.median(v):.3f} / {max(v):.3f}" for v in (t["ttft"], t["t16"],
                                                                                       t["last"])]
        print(f"| {arm} | {' | '.join(cells)} | {int(t['catch_up'][0])} |")


if __name__ == "__main__":
    main()
