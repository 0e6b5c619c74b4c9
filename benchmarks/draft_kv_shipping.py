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
heads of 64) and, with `--draft random`, a draft of another KV shape (4 layers, 2 KV heads of 64) that is rarely
accepted; the speculative config's back-offs are off so that every arm keeps drafting: what differs is where the
draft's prompt KV comes from. With `--draft accepted` the target's layers 4..29 have zero output projections (each
adds nothing to the residual stream: the target computes all 30 layers but its logits are its first 4 layers'), and
the draft is those first 4 layers with the same embeddings, norm and head: a draft of another shape (4 layers
against 30) that is accepted.

`--background N` keeps N other streams decoding on each arm's decode worker while the measured request runs (short
prompts, started before it, cancelled after it): the gaps between their messages during the measured request, and
their tokens per second over it, are what a draft's prompt catch-up costs everyone else. On one small host the
prefill worker's work takes the decode worker's cores too, whichever arm: `--pin` gives each pool its own core
(prefill workers on CPU 0, decode workers on CPU 1, one torch thread each; router and client unpinned), as separate
machines would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
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


def accepted_pair(tmp: Path, vocab: int) -> tuple[Path, Path]:
    """(target, draft) for `--draft accepted` (see the module docstring)."""
    from safetensors.torch import load_file, save_file

    target = make_tiny_model(tmp / "target", layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536,
                             vocab=vocab, seed=1, max_position_embeddings=8192)
    tensors = load_file(target / "model.safetensors")
    draft_tensors = {}
    for name, tensor in tensors.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if layer is not None and layer >= 4 and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensor)
        if layer is None or layer < 4:
            draft_tensors[name] = tensor
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    draft = tmp / "draft"
    shutil.copytree(target, draft)
    save_file(draft_tensors, draft / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    return target, draft


class Background:
    """N streams decoding on a cluster while a measured request runs: for a window [start, stop], the gaps between
    consecutive messages of any stream (`gaps_s`) and each stream's tokens per second (`tokens_per_s`; a message
    may carry several tokens when guesses are accepted, so gaps alone would favour speculation)."""

    def __init__(self, client: Client, prompts: list[list[int]], params: SamplingParams):
        self.arrivals: list[list[tuple[float, int]]] = [[] for _ in prompts]  # (time, tokens in the message)
        self.streams = [client.generate(prompt, params, timeout_s=600) for prompt in prompts]
        self.threads = [threading.Thread(target=self._drain, args=(i,), daemon=True) for i in range(len(prompts))]
        for thread in self.threads:
            thread.start()

    def _drain(self, i: int) -> None:
        with contextlib.suppress(Exception):  # cancelled at the end
            for message in self.streams[i]:
                if message.token_ids:
                    self.arrivals[i].append((time.perf_counter(), len(message.token_ids)))

    def wait_decoding(self, timeout_s: float = 120.0) -> None:
        deadline = time.perf_counter() + timeout_s
        while not all(len(a) >= 2 for a in self.arrivals):
            if time.perf_counter() > deadline:
                raise TimeoutError("background streams did not start decoding")
            time.sleep(0.01)

    def stop(self) -> None:
        for stream in self.streams:
            stream.cancel()
        for thread in self.threads:
            thread.join(timeout=30)

    def gaps_s(self, start: float, stop: float) -> list[float]:
        return [b - a for arrivals in self.arrivals for (a, _), (b, _) in zip(arrivals, arrivals[1:])
                if start <= a and b <= stop]

    def tokens_per_s(self, start: float, stop: float) -> list[float]:
        return [sum(n for t, n in arrivals if start < t <= stop) / (stop - start) for arrivals in self.arrivals]


def start_arm(stack: contextlib.ExitStack, name: str, target: Path, spec: dict, args, patch_dir: Path
              ) -> tuple[Client, int]:
    """A running cluster for arm `name` (closed with `stack`), its client and its decode worker's metrics port."""
    port = pick_free_port()
    spec_args = ["--speculative-config", json.dumps(spec)]
    max_model_len = str(args.prompt_tokens + args.max_tokens + 64)
    threads = ["--threads", "1"] if args.pin else []
    config = ClusterConfig(model_dir=str(target), worker_args=["--max-model-len", max_model_len,
                                                               "--num-kv-blocks", "512", *threads],
                           prefill_args=spec_args if name == "shipped" else [],
                           decode_args=[*(spec_args if name != "no draft" else []), "--metrics-port", str(port)],
                           router_args=["--max-model-len", max_model_len])
    saved = os.environ.get("PYTHONPATH")
    if name == "catch-up":  # the worker processes take the patch at startup
        os.environ["PYTHONPATH"] = os.pathsep.join([str(patch_dir), *filter(None, [saved])])
    try:
        cluster = stack.enter_context(LocalCluster(config).start())
        for component in cluster.components if args.pin else []:
            cpu = {"prefill": "0", "decode": "1"}.get(component.name.split("-")[0])
            if cpu is not None:  # every thread of the process; threads started later inherit it
                subprocess.run(["taskset", "-a", "-cp", cpu, str(component.pid)], check=True, capture_output=True)
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
    p.add_argument("--draft", choices=("random", "accepted"), default="random")
    p.add_argument("--background", type=int, default=0, help="other streams decoding during each measured request")
    p.add_argument("--pin", action="store_true", help="prefill workers on CPU 0, decode workers on CPU 1")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.draft == "accepted":
            target, draft = accepted_pair(tmp, args.vocab)
        else:
            target = make_tiny_model(tmp / "target", layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536,
                                     vocab=args.vocab, seed=1, max_position_embeddings=8192)
            draft = make_tiny_model(tmp / "draft", layers=4, hidden=256, heads=4, kv_heads=2, vocab=args.vocab,
                                    seed=2, max_position_embeddings=8192)
        (tmp / "patch").mkdir()
        (tmp / "patch" / "sitecustomize.py").write_text(PATCH)
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                "min_acceptance_rate": 0, "min_speedup": 0}
        draft_shape = "4 layers x 3 KV heads x 64, accepted" if args.draft == "accepted" else "4 layers x 2 KV heads"
        print(f"config: target 30 layers x 3 KV heads x 64 (fp32), draft {draft_shape}, vocab {args.vocab}, "
              f"background streams {args.background}, pinned {args.pin}, prompt {args.prompt_tokens} tokens, "
              f"{args.max_tokens} greedy tokens, repeats {args.repeats}, spec {spec | {'model': 'draft'}}, "
              f"torch {torch.__version__}, {os.cpu_count()} CPUs",
              flush=True)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        g = torch.Generator().manual_seed(args.seed)

        def fresh_prompt(tokens: int = args.prompt_tokens) -> list[int]:  # random tokens: no prefix-cache hit
            return torch.randint(10, args.vocab, (tokens,), generator=g).tolist()

        background_params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
        results = {arm: {"ttft": [], "t16": [], "last": [], "gaps": [], "rates": []} for arm in args.arms}
        with contextlib.ExitStack() as stack:
            arms = {arm: start_arm(stack, arm, target, spec, args, tmp / "patch") for arm in args.arms}
            for client, _ in arms.values():
                one_request(client, fresh_prompt(), params)  # warm-up
            for repeat in range(args.repeats):  # arms interleaved, in a rotating order: the machine's load drifts
                order = args.arms[repeat % len(args.arms):] + args.arms[: repeat % len(args.arms)]
                for arm in order:
                    background = Background(arms[arm][0], [fresh_prompt(64) for _ in range(args.background)],
                                            background_params)
                    background.wait_decoding()
                    start = time.perf_counter()
                    marks = one_request(arms[arm][0], fresh_prompt(), params)
                    background.stop()
                    gaps = background.gaps_s(start, start + marks[2])
                    results[arm]["gaps"].extend(gaps)
                    results[arm]["rates"].extend(background.tokens_per_s(start, start + marks[2]))
                    for key, value in zip(("ttft", "t16", "last"), marks):
                        results[arm][key].append(value)
                    gap_text = f", background gaps max {max(gaps) * 1e3:.0f} ms" if gaps else ""
                    print(f"repeat {repeat} {arm}: ttft {marks[0]:.3f} s, 16th token {marks[1]:.3f} s, token "
                          f"{args.max_tokens} {marks[2]:.3f} s{gap_text}", flush=True)
            for arm, (_, port) in arms.items():
                results[arm]["catch_up"] = [catch_up_tokens(port)]
    print("\n| arm | TTFT s (min / median / max) | 16th token s | last token s | decode draft catch-up tokens | "
          "background gaps ms (p50 / p90 / max) | background tok/s per stream (min / median / max) |")
    print("|---|---|---|---|---:|---|---|")
    for arm, t in results.items():
        cells = [f"{min(v):.3f} / {statistics.median(v):.3f} / {max(v):.3f}" for v in (t["ttft"], t["t16"],
                                                                                       t["last"])]
        gaps = sorted(t["gaps"])
        gap_cell = (f"{gaps[len(gaps) // 2] * 1e3:.0f} / {gaps[int(len(gaps) * 0.9)] * 1e3:.0f} / {gaps[-1] * 1e3:.0f}"
                    if gaps else "-")
        rates = t["rates"]
        rate_cell = f"{min(rates):.1f} / {statistics.median(rates):.1f} / {max(rates):.1f}" if rates else "-"
        print(f"| {arm} | {' | '.join(cells)} | {int(t['catch_up'][0])} | {gap_cell} | {rate_cell} |")


if __name__ == "__main__":
    main()
