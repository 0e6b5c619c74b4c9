"""Decode step time at tensor parallelism N against TP=1, on this machine's CPU cores (issue 5's CPU benchmark).

    .venv/bin/python benchmarks/tp_step.py                          # small and qwen05b, fp32, batch 1 and 8
    .venv/bin/python benchmarks/tp_step.py --models qwen05b --batches 1,16 --tp 2 --repeats 5

Same cores for both: TP=1 runs one process with `--threads` torch threads; TP=N runs N rank processes with
threads/N each (ranks are processes joined by gloo, engine/tp_runner.py). A decode step's time is measured
as (wall time of `generate` with 1 + D new tokens - wall time with 1 new token) / D, so prefill and request
setup cancel out. Each configuration builds its engine once, warms up, then alternates the two calls
`--repeats` times; min / median / max of the per-repeat step times are reported, and the ratio of medians
(TP=1 / TP=N: > 1 means TP=N steps faster). Both engines stay loaded and the calls alternate, so noise from
other processes hits both alike.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_prompts import make_prompts  # noqa: E402
from offline_throughput import ensure_checkpoint  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def step_ms(llm: LLM, batch: int, prompt_len: int, decode_steps: int, seed: int, repeat: int) -> float:
    """One measurement of the decode step time, with fresh prompts (no prefix-cache hits)."""
    vocab = llm.engine.model_config.vocab_size
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    many = SamplingParams(max_tokens=1 + decode_steps, ignore_eos=True, temperature=0)
    t0 = time.perf_counter()
    llm.generate(make_prompts(seed, batch, 2 * repeat, prompt_len, vocab), one, use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate(make_prompts(seed, batch, 2 * repeat + 1, prompt_len, vocab), many, use_tqdm=False)
    t2 = time.perf_counter()
    return 1000 * ((t2 - t1) - (t1 - t0)) / decode_steps


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="small,qwen05b", help="names from offline_throughput.MODEL_SPECS")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads % args.tp:
        p.error(f"--threads={args.threads} must be a multiple of --tp={args.tp} (each rank gets threads/tp)")
    batches = [int(b) for b in args.batches.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    print(f"tp_step config {vars(args)} commit={commit} machine={platform.processor() or platform.machine()} "
          f"cores={os.cpu_count()} date={time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    rows = []
    for name in args.models.split(","):
        model_dir = ensure_checkpoint(name)
        llms = {tp: LLM(model_dir, dtype=args.dtype, tp_size=tp, num_threads=args.threads // tp,
                        max_num_seqs=max(batches), max_model_len=args.prompt_len + args.decode_steps + 8)
                for tp in (1, args.tp)}
        try:
            for batch in batches:
                times: dict[int, list[float]] = {tp: [] for tp in llms}
                for llm in llms.values():  # warm-up
                    step_ms(llm, batch, args.prompt_len, args.decode_steps, args.seed, -1)
                for r in range(args.repeats):  # alternate, so machine noise hits both alike
                    for tp, llm in llms.items():
                        times[tp].append(step_ms(llm, batch, args.prompt_len, args.decode_steps, args.seed, r))
                one, many = times[1], times[args.tp]
                print(f"tp_step model={name} batch={batch} tp1_step_ms={fmt(one)} tp{args.tp}_step_ms={fmt(many)}",
                      flush=True)
                rows.append(f"| {name} / {args.dtype} | {batch} | {fmt(one)} | {fmt(many)} | "
                            f"{statistics.median(one) / statistics.median(many):.2f} |")
        finally:
            for llm in llms.values():
                llm.close()
    print(f"\n| model / dtype | batch | TP=1 step ms, median (min-max) | TP={args.tp} step ms | TP=1 / TP={args.tp} |")
    print("|---|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
