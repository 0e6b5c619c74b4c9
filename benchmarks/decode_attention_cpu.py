"""CPU paged decode attention (csrc/cpu_kernels.c) against the memory bandwidth and its torch twin, in one run.

A decode step's attention reads every cached K and V token of the batch once per layer, and at chat contexts that is
most of what a step reads (SmolLM2-135M, fp32 KV: 23 KB a token over its 30 layers, so a batch of 8 at 800 tokens
reads 150 MB of KV a step against ~112 MB of weights kept quantized). Each layer's cache was last read a whole step
ago, so it comes from DRAM: here each timed call walks all `--layers` layers' caches (SmolLM2's shape, block tables
shuffled) in turn, as a step does. Figures per call (one layer): microseconds, and GB/s of K + V; the ceiling is
a 1 GiB `torch.sum` (benchmarks/bandwidth.py) sampled between repeats, the twin (what other devices run: gather +
matmul) is timed on the same inputs, and each call's output is checked against it. Repeats alternate the three.

    .venv/bin/python benchmarks/decode_attention_cpu.py [--batch 1 8] [--context 256 1024] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bandwidth import measure_read_bandwidth  # noqa: E402

from engine.kernels import cpu_native  # noqa: E402
from engine.kernels.decode_attention import context_lens_from_mask, decode_attention_torch  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M


def make_case(batch: int, context: int, layers: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    width = -(-context // BLOCK)
    num_blocks = batch * width + 4
    caches = [(torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=g).to(dtype),
               torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=g).to(dtype)) for _ in range(layers)]
    block_ids = torch.randperm(num_blocks, generator=g)[: batch * width]
    past_end = torch.arange(width * BLOCK) >= context
    mask = torch.zeros(batch, width * BLOCK).masked_fill_(past_end, float("-inf"))
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    return q, caches, block_ids, mask


def time_layers(fn, caches) -> float:
    """Seconds a layer: one call on each layer's cache in turn."""
    start = time.perf_counter()
    for k, v in caches:
        fn(k, v)
    return (time.perf_counter() - start) / len(caches)


def measure_cell(batch: int, context: int, layers: int, dtype: torch.dtype, repeats: int) -> tuple[str, float]:
    """One table row, and the fastest read-bandwidth sample taken while measuring it."""
    q, caches, block_ids, mask = make_case(batch, context, layers, dtype)
    lens, scale = context_lens_from_mask(mask), HEAD_DIM**-0.5
    kv_bytes = 2 * batch * KV_HEADS * context * HEAD_DIM * q.element_size()

    def native(k, v):
        return cpu_native.decode_attention_native(q, k, v, block_ids, lens, scale)

    def twin(k, v):
        return decode_attention_torch(q, k, v, block_ids, mask, scale)

    k0, v0 = caches[0]
    err = float((native(k0, v0).float() - twin(k0, v0).float()).abs().max())
    c_times, t_times, bandwidth = [], [], []
    for _ in range(repeats):
        c_times.append(time_layers(native, caches))
        t_times.append(time_layers(twin, caches))
        bandwidth.append(measure_read_bandwidth(1 << 30, repeats=3).median)
    c_us, t_us = sorted(t * 1e6 for t in c_times), sorted(t * 1e6 for t in t_times)
    c_gbs = sorted(kv_bytes / t / 1e9 for t in c_times)
    ratio = statistics.median(t / c for t, c in zip(t_times, c_times, strict=True))
    of_bandwidth = statistics.median(c_gbs) * 1e9 / max(bandwidth)
    spread = lambda v, f: " / ".join(f"{x:{f}}" for x in (v[0], statistics.median(v), v[-1]))  # noqa: E731
    row = (f"| {batch} | {context} | {kv_bytes / 1e6:.2f} | {spread(c_us, '.0f')} | {spread(c_gbs, '.1f')} | "
           f"{of_bandwidth:.2f} | {spread(t_us, '.0f')} | {ratio:.2f} |  (max |C - twin| {err:.1e})")
    return row, max(bandwidth)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if cpu_native.native_library() is None:
        sys.exit("the C kernels did not build here: nothing to measure")
    dtype = getattr(torch, args.dtype)
    print(f"threads {torch.get_num_threads()}, {args.dtype} KV, {args.layers} layers a call round; "
          "us a layer and GB/s of K + V, min / median / max over repeats")
    print("| batch | context | KV MB a layer | C kernel us | C GB/s | of read bandwidth | twin us | twin / C |")
    print("|---:|---:|---:|---|---|---:|---|---:|")
    fastest = 0.0
    for batch in args.batch:
        for context in args.context:
            row, fastest_here = measure_cell(batch, context, args.layers, dtype, args.repeats)
            fastest = max(fastest, fastest_here)
            print(row)
    print(f"read bandwidth (1 GiB sum, fastest sample): {fastest / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
