"""Few-row GEMMs of a dense model's weights: duet's C GEMV tiles (csrc/gemv.c) against oneDNN's packed GEMM (what
FastLinear gives more rows to), and what the fused decode layer gains by taking more rows than a plain call would.

    .venv/bin/python benchmarks/gemv_rows.py                                  # kernels, bf16, rows 1..32
    .venv/bin/python benchmarks/gemv_rows.py --dtype float32 --rows 1,2,4,6,8
    .venv/bin/python benchmarks/gemv_rows.py --decode-batches 12,16,32        # + decode at those batch sizes

Kernels: every linear of SmolLM2-135M's shapes (30 layers of qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536, each layer its own random weights so nothing stays in cache, then the 49152x576 lm_head) at `rows` rows
of x, timed as one pass over all of them: C (`gemv_*_native`) and oneDNN (`packed_linear` on `pack_weight`),
alternating pass by pass; ms per pass min / median / max, the weight read rate of the median, and C's speed over
oneDNN's per repeat. `--decode-batches`: the default model decoding `--decode-tokens` greedy tokens for that many
prompts at once, with the fused dense layer's row cap at engine/linear_fast.py's GEMV_ROWS (steps of more rows run
the plain forward, oneDNN) and at engine/fused_decode.py's DENSE_ROWS, one fresh process per cell, alternating.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)
LAYERS = 30

DECODE_CHILD = r"""
import sys, time
import engine.fused_decode as fd
fd.DENSE_ROWS = int(sys.argv[3])  # the row cap the fused layer binds with (read when it is built, on the first step)
from engine.default_model import default_model_path
from engine.llm import LLM
from engine.sampling_params import SamplingParams
llm = LLM(str(default_model_path()), dtype=sys.argv[1], quantization="none")
batch, tokens = int(sys.argv[2]), int(sys.argv[4])
prompts = [f"Tell me a story about the number {i}." for i in range(batch)]
llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
started = time.perf_counter()
outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), use_tqdm=False)
print(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started))
"""


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def kernels(dtype: torch.dtype, rows_list: list[int], repeats: int) -> None:
    from engine.kernels import cpu_native
    from engine.linear_fast import pack_weight, packed_linear

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen).to(dtype) for _ in range(LAYERS) for shape in SHAPES.values()]
    weights.append(torch.randn(LM_HEAD, generator=gen).to(dtype))
    packed = [pack_weight(w) for w in weights]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    gemv = cpu_native.gemv_bf16_native if dtype == torch.bfloat16 else cpu_native.gemv_f32_native

    def one_pass(fn, ws, rows: int) -> float:
        xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {w.shape[1] for w in weights}}
        started = time.perf_counter()
        for w, original in zip(ws, weights):
            fn(xs[original.shape[1]], w, None)
        return time.perf_counter() - started

    print("| rows | C ms | oneDNN ms | C GB/s (median) | C / oneDNN speed |\n|---:|---|---|---:|---|")
    for rows in rows_list:
        c_s, d_s = [], []
        for _ in range(repeats):
            c_s.append(one_pass(gemv, weights, rows))
            d_s.append(one_pass(packed_linear, packed, rows))
        ratios = [d / c for c, d in zip(c_s, d_s)]
        print(f"| {rows} | {spread([s * 1e3 for s in c_s])} | {spread([s * 1e3 for s in d_s])} | "
              f"{weight_bytes / statistics.median(c_s) / 1e9:.1f} | {spread(ratios)} |", flush=True)


def decode(dtype: str, batches: list[int], tokens: int, repeats: int) -> None:
    from engine.fused_decode import DENSE_ROWS
    from engine.linear_fast import GEMV_ROWS

    caps = (GEMV_ROWS, DENSE_ROWS)
    print(f"\n| batch | fused cap {caps[0]} tok/s | fused cap {caps[1]} tok/s | speed-up (min / median / max) |\n"
          "|---:|---|---|---|")
    for batch in batches:
        cells: dict[int, list[float]] = {cap: [] for cap in caps}
        for _ in range(repeats):
            for cap in caps:
                out = subprocess.run([sys.executable, "-c", DECODE_CHILD, dtype, str(batch), str(cap), str(tokens)],
                                     capture_output=True, text=True, check=True)
                cells[cap].append(float(out.stdout.strip().splitlines()[-1]))
        ratios = [b / a for a, b in zip(cells[caps[0]], cells[caps[1]])]
        print(f"| {batch} | {spread(cells[caps[0]], '{:.1f}')} | {spread(cells[caps[1]], '{:.1f}')} | "
              f"{spread(ratios)} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--rows", default="1,2,3,4,6,8,12,16,24,32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode-batches", default="", help="comma-separated batch sizes (default: none)")
    p.add_argument("--decode-tokens", type=int, default=96)
    p.add_argument("--decode-repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"config: {vars(args)}")
    kernels(getattr(torch, args.dtype), [int(r) for r in args.rows.split(",")], args.repeats)
    if args.decode_batches:
        decode(args.dtype, [int(b) for b in args.decode_batches.split(",")], args.decode_tokens, args.decode_repeats)


if __name__ == "__main__":
    main()
