"""Where a disaggregated cluster should get a draft model's prompt KV (issue 19 part 4): computed again on the decode
worker (a draft prefill there, what engine/drafter.py does) or computed on the prefill worker and shipped with the
target's (SGLang's choice). Same run: the draft's prefill of P prompt tokens, timed in this process, against the
KV transfer of the same bytes between two processes over duet's TCP transport (benchmarks/kvtransfer_bench.py with
the draft's KV shape), alternated repeat by repeat.

    .venv/bin/python benchmarks/draft_placement.py [--tokens 256 1024 4096] [--repeats 3]

The draft is --draft (a checkpoint directory or .gguf), by default the default model's GGUF held as --quantization
(auto: its Q4_1 weights kept), the activations fp32:
the self-draft of benchmarks/speculative_bench.py --method draft_model.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def prefill_seconds(runner, num_tokens: int, vocab: int, block_size: int) -> float:
    from engine.sampling_params import SamplingParams
    from engine.scheduler import ScheduledChunk

    g = torch.Generator().manual_seed(num_tokens)
    tokens = torch.randint(4, vocab, (num_tokens,), generator=g).tolist()
    blocks = list(range(-(-num_tokens // block_size)))
    chunk = ScheduledChunk("p", tokens, 0, blocks, False, SamplingParams(max_tokens=1), (), ())
    start = time.perf_counter()
    runner.execute([chunk])
    return time.perf_counter() - start


def transfer_seconds(config, tokens: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of a TCP KV transfer of each prompt length, from kvtransfer_bench.py's table."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kvtransfer_bench.py"), "--tokens", *map(str, tokens),
           "--repeats", str(repeats), "--layers", str(config.num_layers), "--kv-heads", str(config.num_kv_heads),
           "--head-dim", str(config.head_dim), "--dtype", "float32"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800).stdout
    medians = {}
    for line in out.splitlines():
        m = re.match(r"\| tcp \| (\d+) \| \d+ \| [\d.]+ / ([\d.]+) / [\d.]+ \|", line)
        if m:
            medians[int(m.group(1))] = float(m.group(2))
    return medians


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--draft", type=Path, default=None, help="the draft checkpoint (default: the default model's GGUF)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    from engine.config import ModelConfig
    from engine.default_model import default_model_path
    from engine.linear_fast import linear_fast_paths
    from engine.model_runner import ModelRunner, allocate_kv_caches, kv_bytes_per_block
    from engine.sampler import Sampler
    from engine.weights import build_model

    torch.set_num_threads(args.threads)
    path = args.draft or default_model_path()
    config = ModelConfig.from_path(path)
    block_size = 16
    num_blocks = -(-max(args.tokens) // block_size)
    model = build_model(config, path, torch.float32, max_positions=max(args.tokens), quantization=args.quantization)
    linear_fast_paths(model, True)
    runner = ModelRunner(model, allocate_kv_caches(model, num_blocks, block_size, torch.float32), block_size,
                         Sampler(0))
    bytes_per_token = kv_bytes_per_block(model, block_size, torch.float32) // block_size
    print(f"config: draft={path.name} quantization={args.quantization} fp32 KV {bytes_per_token} bytes/token "
          f"({config.num_layers} layers x {config.num_kv_heads} KV heads x {config.head_dim}), tokens={args.tokens} "
          f"repeats={args.repeats} threads={args.threads}", flush=True)
    prefill_seconds(runner, 64, config.vocab_size, block_size)  # warm-up
    prefill: dict[int, list[float]] = {t: [] for t in args.tokens}
    transfer: dict[int, list[float]] = {t: [] for t in args.tokens}
    for repeat in range(args.repeats):
        for t in args.tokens:
            prefill[t].append(prefill_seconds(runner, t, config.vocab_size, block_size))
        for t, seconds in transfer_seconds(config, args.tokens, 3).items():
            transfer[t].append(seconds)
        print(f"repeat {repeat}: prefill {[round(prefill[t][-1], 3) for t in args.tokens]} s, "
              f"transfer {[round(transfer[t][-1], 3) for t in args.tokens]} s", flush=True)
    print("\n| prompt tokens | draft KV MiB | draft prefill s (min / median / max) | TCP transfer s "
          "(min / median / max) | prefill / transfer |")
    print("|---:|---:|---|---|---:|")
    for t in args.tokens:
        a, b = prefill[t], transfer[t]
        print(f"| {t} | {t * bytes_per_token / 2**20:.1f} | {min(a):.3f} / {statistics.median(a):.3f} / {max(a):.3f} | "
              f"{min(b):.3f} / {statistics.median(b):.3f} / {max(b):.3f} | "
              f"{statistics.median(a) / statistics.median(b):.1f}x |")


if __name__ == "__main__":
    main()
