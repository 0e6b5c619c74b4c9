"""TTFT of the disaggregated cluster, broken into its parts, next to the offline engine's TTFT.

    python benchmarks/ttft_cluster.py [--model small] [--lens 128,512,2048] [--repeats 5] [--transport tcp]

One local cluster (redis, router, 1 prefill, 1 decode: separate processes on this machine) and one offline
`LLM` in this process, same checkpoint, same prompts (fresh random tokens per repeat, so no prefix hits).
Requests go one at a time. For each prompt length it prints min/median/max over repeats of:
  offline TTFT (arrival -> first token, in-process), cluster TTFT as the client sees it, and the router's
  breakdown: reserve (decode admission), queue and prefill (prefill worker), transfer (KV still in flight
  after the last forward pass), first decode step (first -> second token), plus the cluster/offline ratio.
The machine is shared and small (2 cores): both sides compete for the same cores, which the cluster pays
for in context switches; read ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_throughput import ensure_checkpoint  # noqa: E402

from deploy.local_cluster import ClusterConfig, LocalCluster  # noqa: E402
from duet.client import Client, stream_to_record  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

PARTS = ("reserve_s", "queue_s", "prefill_s", "transfer_s", "first_decode_s")


def fmt(values: list[float]) -> str:
    return f"{1000 * min(values):.1f} / {1000 * statistics.median(values):.1f} / {1000 * max(values):.1f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--lens", default="128,512,2048")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--transport", choices=["tcp", "torch"], default="tcp")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    lens = [int(x) for x in args.lens.split(",")]
    model_dir = ensure_checkpoint(args.model)
    engine_args = ["--num-kv-blocks", "1024", "--max-num-batched-tokens", "2048", "--threads", str(args.threads)]
    print(f"# ttft_cluster model={args.model} ({model_dir.name}) lens={lens} repeats={args.repeats} "
          f"transport={args.transport} threads={args.threads} seed={args.seed}", flush=True)

    torch.set_num_threads(args.threads)
    llm = LLM(model_dir, num_kv_blocks=1024, max_num_batched_tokens=2048)
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    llm.generate([prompt(32)], params, use_tqdm=False)  # warm-up
    offline = {n: [llm.generate([prompt(n)], params, use_tqdm=False)[0].ttft_s for _ in range(args.repeats)]
               for n in lens}
    del llm

    config = ClusterConfig(model_dir=str(model_dir), worker_args=engine_args + ["--kv-transport", args.transport])
    cluster_rows: dict[int, dict[str, list[float]]] = {}
    with LocalCluster(config).start() as cluster, Client(cluster.router_address) as client:
        stream_to_record(client.generate(prompt(32), params, timeout_s=120))  # warm-up: connections, handshake
        for n in lens:
            row: dict[str, list[float]] = {"client_ttft_s": [], "ttft_s": [], **{k: [] for k in PARTS}}
            for _ in range(args.repeats):
                rec = stream_to_record(client.generate(prompt(n), params, timeout_s=300))
                row["client_ttft_s"].append(rec["ttft_s"])
                for key in ("ttft_s", *PARTS):
                    row[key].append(rec["timing"][key])
            cluster_rows[n] = row

    lines = [
        f"### TTFT: disaggregated cluster vs offline engine ({dt.date.today()}, {platform.machine()} "
        f"{torch.get_num_threads()} threads, model {model_dir.name}, transport {args.transport})",
        "",
        f"Command: `python benchmarks/ttft_cluster.py --model {args.model} --lens {args.lens} "
        f"--repeats {args.repeats} --transport {args.transport}`. Milliseconds, min / median / max over "
        f"{args.repeats} requests, one at a time, max_tokens 8, no prefix hits.",
        "",
        "| prompt tokens | offline TTFT | cluster TTFT (client) | router TTFT | reserve | prefill queue | prefill "
        "| KV transfer after prefill | first decode step | cluster / offline (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in lens:
        row = cluster_rows[n]
        ratio = statistics.median(row["client_ttft_s"]) / statistics.median(offline[n])
        lines.append(f"| {n} | {fmt(offline[n])} | {fmt(row['client_ttft_s'])} | {fmt(row['ttft_s'])} | "
                     + " | ".join(fmt(row[k]) for k in PARTS) + f" | {ratio:.2f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    t0 = time.monotonic()
    main()
    print(f"\n(took {time.monotonic() - t0:.0f}s)")
