"""Where one CPU decode step's time goes: the GEMMs vs the small ops (C kernels) vs the glue between them.

    .venv/bin/python benchmarks/decode_step_cpu.py --batch 32 --context 64
    .venv/bin/python benchmarks/decode_step_cpu.py --model small --batch 1 --dtype bfloat16
    .venv/bin/python benchmarks/decode_step_cpu.py --model smollm2 --batch 1 --quantization auto

One decode step = the model forward of `--batch` single-token sequences, each with `--context` cached tokens,
plus the lm_head (`compute_logits`); no scheduler, no sampling. Every linear (FastLinear, engine/linear_fast.py,
or a plain nn.Linear where none applies), every C kernel wrapper (engine/kernels/cpu_native.py, `*_native`)
and the torch KV write (`write_kv`: with the C kernels the KV store rides in `rotary_store_kv_native`) are
wrapped with a timer for the life of this process (engine/ is not modified); the table
gives ms per step, averaged over `--steps` after `--warmup`. "forward" and "logits" contain the GEMMs they
call; whatever the named rows do not cover is Python and torch glue. A profile, not a comparison: the peer
comparison is offline_throughput.py, whose RESULTS section cites this split.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import ensure_checkpoint  # noqa: E402
from profile_duet import timer  # noqa: E402

from engine.config import ModelConfig, parse_dtype  # noqa: E402
from engine.cpu_allocator import reuse_freed_memory  # noqa: E402
from engine.linear_fast import FastLinear, fast_linears  # noqa: E402
from engine.model_runner import ModelRunner, allocate_kv_caches  # noqa: E402
from engine.quantized_linear import QuantizedLinear  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import ScheduledChunk  # noqa: E402
from engine.weights import build_model  # noqa: E402

TIMES: dict[str, float] = defaultdict(float)


def timed(name: str, fn):
    return timer(TIMES, name, fn)


def instrument() -> None:
    """Time the linears, the C kernel wrappers (rebound in every engine module that imported them) and write_kv."""
    import engine.attention
    import engine.kernels.cpu_native as native

    FastLinear.forward = timed("GEMMs (FastLinear)", FastLinear.forward)
    QuantizedLinear.forward = timed("GEMMs (QuantizedLinear)", QuantizedLinear.forward)
    torch.nn.Linear.forward = timed("GEMMs (plain nn.Linear)", torch.nn.Linear.forward)  # below the pack size
    wrapped = {name: timed(name, getattr(native, name)) for name in dir(native)
               if name.endswith("_native") and name != "use_native" and callable(getattr(native, name))}
    for module in [m for name, m in list(sys.modules.items()) if name.startswith("engine.") and m is not None]:
        for name, fn in wrapped.items():
            if hasattr(module, name):
                setattr(module, name, fn)
    engine.attention.write_kv = timed("write_kv", engine.attention.write_kv)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen05b", help="a model name from offline_throughput.MODEL_SPECS")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=64, help="cached tokens per sequence")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantization", default="none", choices=("none", "auto", "int8", "int4"))
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    reuse_freed_memory()  # as the engine's runtime does
    model_dir = ensure_checkpoint(args.model)
    dtype = parse_dtype(args.dtype)
    config = ModelConfig.from_path(model_dir)
    model = build_model(config, model_dir, dtype, args.context + 64, quantization=args.quantization)
    fast_linears(model)
    instrument()
    bs = args.block_size
    per_seq = -(-(args.context + 1) // bs)
    kv = allocate_kv_caches(model, num_blocks=args.batch * per_seq + 1, block_size=bs, dtype=dtype)
    runner = ModelRunner(model, kv, bs, sampler=None)
    chunks = [ScheduledChunk(f"r{i}", [5], args.context, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), True,
                             SamplingParams(), [], []) for i in range(args.batch)]
    forward, logits = timed("forward", model.__call__), timed("logits (lm_head)", model.compute_logits)
    with torch.no_grad():
        input_ids, positions, meta = runner.prepare_inputs(chunks)
        for _ in range(args.warmup):
            logits(forward(input_ids, positions, kv, meta))
        TIMES.clear()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            logits(forward(input_ids, positions, kv, meta))
        step_s = (time.perf_counter() - t0) / args.steps
    print(f"model={args.model} dtype={args.dtype} batch={args.batch} context={args.context} "
          f"quantization={args.quantization} threads={args.threads}: {step_s * 1e3:.1f} ms per step")
    for name, total in sorted(TIMES.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {total / args.steps * 1e3:8.2f} ms")
    named = sum(v for k, v in TIMES.items() if k not in ("forward", "logits (lm_head)")) / args.steps
    print(f"  {'glue (step - named rows)':28s} {(step_s - named) * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
