"""One decode step of a ~1B-parameter Llama on CUDA, eager and replayed from CUDA graphs, against the
weights-read roofline, in one run (issue 5).

A decode step at small batch is bound by reading the weights once: its floor is (bytes of every weight
the step reads) / (device memory bandwidth). The bandwidth is measured in the same run, as a
device-to-device copy of a buffer far larger than L2 ((read + write bytes) / time), so the figure that
matters is the fraction roofline / step. The step is the engine's whole `ModelRunner.execute` for B
single-token decodes (host input prep, forward, logits, greedy sampling, the host sync of the tokens),
each sequence with `--context` cached tokens; the eager runner and a runner with a `GraphReplayer`
share one model and KV cache.

The model is made locally with random weights by engine.tiny_model.make_tiny_model (16 layers, hidden
2048, MLP 8192, 32 heads, 8 KV heads, vocab 32000: 1.1B parameters), once per --model-dir.

    python benchmarks/decode_step_cuda.py [--dtype bfloat16] [--batch 1 64] [--context 512] [--repeats 50]
                                          [--quantization none int8 int4]

Each --quantization value is its own runtime over the same checkpoint (int8 / int4: round-to-nearest on load,
decoded by the Triton weight-only kernels), against its own roofline (its own bytes of weights). With
`--tiles BEST.json` (what `quant_triton_bench.py --sweep --best` writes), each quantized runtime is timed again
with those launch settings of engine/kernels/quant_linear_triton.py, in the same run.

Without CUDA it prints why and exits 0: it measures GPU steps only. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

GiB = 1 << 30
MODEL = dict(arch="llama", layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=32000)


def copy_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes/s of a device-to-device copy (it reads and writes `num_bytes`: 2 * num_bytes moved), median."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * num_bytes / statistics.median(times)


def weight_bytes_read(model) -> int:
    """Bytes of the weights one decode step reads: every weight as held (quantized ones packed, with their scales)
    but the input embedding table, of which a step reads B rows only (a tied table is read whole, as the output
    projection)."""
    from engine.quantization import weight_bytes_by_kind

    total = sum(weight_bytes_by_kind(model).values())
    if model.lm_head is not None:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def decode_chunks(batch: int, context: int, block_size: int, vocab: int, seed: int):
    """B single-token decodes at position context - 1, each over its own run of blocks."""
    from engine.sampling_params import SamplingParams
    from engine.scheduler import ScheduledChunk

    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    chunks = []
    for i in range(batch):
        token = int(torch.randint(4, vocab, (1,), generator=g))
        block_ids = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        chunks.append(ScheduledChunk(f"s{i}", [token], context - 1, block_ids, True, greedy, [token], []))
    return chunks


def time_steps(runner, chunks, warmup: int, repeats: int) -> list[float]:
    """Seconds of each `runner.execute(chunks)` (it ends with the sampled tokens on the host)."""
    for _ in range(warmup):
        runner.execute(chunks)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(chunks)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--copy-gib", type=float, default=2.0, help="size of the bandwidth-measuring copy")
    p.add_argument("--model-dir", type=Path, default=None, help="where the random model is made (reused if there)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "int8", "int4"])
    p.add_argument("--tiles", type=Path, default=None, help="JSON of quant_linear_triton settings to time as well")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_step_cuda: no CUDA device here; this benchmark times GPU decode steps only (skipped)")
        return 0

    from engine.tiny_model import make_tiny_model

    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"duet-decode-bench-1b-{args.dtype}"
    if not (model_dir / "config.json").is_file():
        print(f"making the random model in {model_dir} ...", flush=True)
        make_tiny_model(model_dir, **MODEL, max_position_embeddings=4096, dtype=args.dtype, initializer_range=0.02,
                        seed=args.seed)
    bandwidth = copy_bandwidth(int(args.copy_gib * GiB), repeats=20)
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name} ({props.total_memory / GiB:.0f} GiB), torch {torch.__version__}")
    print(f"copy bandwidth (same run): {bandwidth / 1e9:.0f} GB/s")
    print(f"context {args.context} tokens/sequence, block size {args.block_size}, repeats {args.repeats} "
          f"(+{args.warmup} warm-up), seed {args.seed}\n")
    print("| quantization | batch | runner | min ms | median ms | max ms | roofline / median | graphs speedup |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    notes = []
    tiles = json.loads(args.tiles.read_text()) if args.tiles else None
    for quantization in args.quantization:
        notes.append(time_quantization(model_dir, args, quantization, bandwidth))
        if tiles and quantization != "none":
            from engine.kernels import quant_linear_triton as qlt

            saved = {k: getattr(qlt, k) for k in tiles}
            for k, v in tiles.items():
                setattr(qlt, k, v)
            try:
                label = f"{quantization} {tiles}"
                notes.append(time_quantization(model_dir, args, quantization, bandwidth, label=label))
            finally:
                for k, v in saved.items():
                    setattr(qlt, k, v)
    print()
    print("\n".join(notes))
    return 0


def time_quantization(model_dir: Path, args, quantization: str, bandwidth: float, label: str | None = None) -> str:
    """Prints one table row per (batch, runner) for the runtime under `quantization`; returns its summary line."""
    label = label or quantization
    from engine.config import EngineConfig
    from engine.cuda_graphs import make_graph_replayer
    from engine.model_runner import ModelRunner
    from engine.runtime import build_runtime
    from engine.sampler import Sampler

    max_batch = max(args.batch)
    blocks_needed = max_batch * -(-args.context // args.block_size)
    config = EngineConfig(dtype=args.dtype, device="cuda", cuda_graphs=False, block_size=args.block_size,
                          num_kv_blocks=blocks_needed, max_num_seqs=max_batch, quantization=quantization,
                          max_model_len=max(args.context + 1, 2048), cuda_graph_batch_sizes=tuple(sorted(args.batch)))
    rt = build_runtime(model_dir, config)
    eager = rt.runner
    assert eager.graph_replayer is None
    replayer = make_graph_replayer(rt.model, rt.kv_caches, config, rt.max_model_len, scratch_block=rt.num_kv_blocks)
    graphs = ModelRunner(rt.model, rt.kv_caches, config.block_size, Sampler(config.seed), graph_replayer=replayer)
    capture_start = time.perf_counter()
    replayer.capture()
    capture_s = time.perf_counter() - capture_start
    weights = weight_bytes_read(rt.model)
    roofline_s = weights / bandwidth
    for batch in args.batch:
        chunks = decode_chunks(batch, args.context, args.block_size, rt.model_config.vocab_size, args.seed)
        assert replayer.bucket_for_step(chunks) == batch
        medians = {}
        for name, runner in (("eager", eager), ("cuda graphs", graphs)):
            times = time_steps(runner, chunks, args.warmup, args.repeats)
            medians[name] = statistics.median(times)
            speedup = f"{medians['eager'] / medians[name]:.2f}x" if name == "cuda graphs" else ""
            print(f"| {label} | {batch} | {name} | {min(times) * 1e3:.3f} | {medians[name] * 1e3:.3f} | "
                  f"{max(times) * 1e3:.3f} | {roofline_s / medians[name]:.0%} | {speedup} |", flush=True)
        same = eager.execute(chunks) == graphs.execute(chunks)
        print(f"| {label} |  | (same greedy tokens: {'yes' if same else 'NO'}) | | | | | |")
    summary = (f"{label}: weights read per step {weights / GiB:.3f} GiB -> roofline {roofline_s * 1e3:.3f} ms; "
               f"graphs for batch {list(replayer.batch_sizes)} captured in {capture_s:.1f} s")
    del rt, eager, graphs, replayer
    torch.cuda.empty_cache()
    return summary


if __name__ == "__main__":
    sys.exit(main())
