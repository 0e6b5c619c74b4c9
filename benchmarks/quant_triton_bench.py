"""The Triton quantized linears (engine/kernels/quant_linear_triton.py) against the memory roofline and
against a dense fp16 / bf16 matmul, in one run (issue 18, part 4).

At few rows a weight-only linear is bound by reading its weight once: its floor is (bytes of the packed
weight + scales (+ mins) + x + y) / (device memory bandwidth). The bandwidth is measured in the same run
as a device-to-device copy of a buffer far larger than L2 ((read + write bytes) / time). Each timed call
follows a write over a 256 MiB buffer, which evicts the weight from L2 (so no call reads it from cache).
The peer is torch's dense matmul (`F.linear`, cuBLAS) on the dequantized weight in the activation dtype:
the figure that matters at decode row counts is its time over ours (int8 reads ~half its bytes, int4
~0.28x), and at prefill row counts how close we stay to it (compute-bound: TFLOP/s shown).

Shapes: the default model's projections (SmolLM2-135M: hidden 576, MLP 1536, vocab 49152; fused q/k/v
and gate/up as the engine holds them) and Llama-3-8B's (hidden 4096, MLP 14336, 8 KV heads).

    python benchmarks/quant_triton_bench.py [--dtype float16] [--rows 1 8 32 512] [--model both] [--repeats 50]
    python benchmarks/quant_triton_bench.py --sweep    # the tile sizes: GEMV and GEMM blocks on Llama-3-8B's shapes

Without CUDA (or triton) it prints why and exits 0: it measures GPU kernels only. Not part of CI.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.bandwidth import Spread

FLUSH_BYTES = 256 << 20  # > L2 on every current GPU (H100/H200: 50 MiB)
# (name, out_features, in_features)
SHAPES = {
    "smollm2-135m": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
                     ("lm_head", 49152, 576)],
    "llama3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
}
KINDS = ("int8", "q8_0", "int4")


def time_cuda(fn: Callable[[], object], flush: torch.Tensor, repeats: int) -> Spread:
    """Seconds of fn() on the GPU (CUDA events) over `repeats` calls, each after an L2-evicting write;
    one untimed call first (compiles the kernel)."""
    fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return Spread.of([start.elapsed_time(end) / 1e3 for start, end in events])


def copy_bandwidth(num_bytes: int, flush: torch.Tensor, repeats: int) -> Spread:
    """Bytes/s of a device-to-device copy of `num_bytes` (read + write: 2 * num_bytes moved)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), flush, repeats)
    return Spread(2 * num_bytes / seconds.max, 2 * num_bytes / seconds.median, 2 * num_bytes / seconds.min)


def make_weight(kind: str, out: int, in_features: int, g: torch.Generator):
    from engine.quant_format import QuantizedWeight, quantize_int4, quantize_int8

    dense = torch.randn(out, in_features, generator=g, device="cuda") * 0.02
    if kind == "int8":
        return quantize_int8(dense)
    if kind == "int4":
        return quantize_int4(dense)
    # Q8_0: int8 in groups of 32, fp16 scales, as a GGUF file holds it
    groups = dense.view(out, in_features // 32, 32)
    scales = (groups.abs().amax(dim=2) / 127).half().float()
    q = (groups / scales.clamp(min=1e-12).unsqueeze(2)).round().clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q.view(out, in_features), scales, None, 32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    parser.add_argument("--model", default="both", choices=("both", *SHAPES))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true", help="time the kernels' tile sizes instead (see sweep())")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        print("quant_triton_bench: needs CUDA and triton (GPU kernels only); skipped")
        return 0

    from engine.kernels.quant_linear_triton import quantized_linear_triton
    from engine.quant_format import dequantize, quantized_linear_reference

    dtype = getattr(torch, args.dtype)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    props = torch.cuda.get_device_properties(0)
    copy_bps = copy_bandwidth(1 << 30, flush, args.repeats)
    print(f"device {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
          f"triton {importlib.import_module('triton').__version__}, dtype {args.dtype}, rows {args.rows}, "
          f"repeats {args.repeats}, seed {args.seed}")
    print(f"copy bandwidth (1 GiB d2d, read + write) GB/s: min {copy_bps.min / 1e9:.0f} median "
          f"{copy_bps.median / 1e9:.0f} max {copy_bps.max / 1e9:.0f}; the roofline below uses the max")
    print("us: min / median / max over repeats; GB/s and 'of roof' from the median; 'vs dense' = dense median / "
          "ours (>1: we are faster)")
    print(f"{'model':>13} {'proj':>8} {'kind':>5} {'rows':>5} {'MiB':>7} {'us min/med/max':>22} {'GB/s':>6} "
          f"{'of roof':>8} {'TFLOP/s':>8} {'dense us':>9} {'vs dense':>9} {'max rel err':>11}")  # fmt: skip
    if args.sweep:
        sweep(getattr(torch, args.dtype), flush, copy_bps.max, args.repeats, args.seed)
        return 0
    models = list(SHAPES) if args.model == "both" else [args.model]
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    for model in models:
        for name, out, in_features in SHAPES[model]:
            for kind in KINDS:
                w = make_weight(kind, out, in_features, g)
                dense_w = dequantize(w).to(dtype)
                for rows in args.rows:
                    x = torch.randn(rows, in_features, generator=g, device="cuda").to(dtype)
                    ref = quantized_linear_reference(x, w)
                    y = quantized_linear_triton(x, w)
                    err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    num_bytes = w.nbytes + (x.numel() + rows * out) * x.element_size()
                    ours = time_cuda(lambda x=x, w=w: quantized_linear_triton(x, w), flush, args.repeats)
                    dense = time_cuda(lambda x=x, d=dense_w: F.linear(x, d), flush, args.repeats)
                    print(f"{model:>13} {name:>8} {kind:>5} {rows:>5} {num_bytes / 2**20:>7.2f} "
                          f"{ours.min * 1e6:>6.1f} /{ours.median * 1e6:>6.1f} /{ours.max * 1e6:>6.1f} "
                          f"{num_bytes / ours.median / 1e9:>6.0f} {num_bytes / ours.median / copy_bps.max:>8.1%} "
                          f"{2 * rows * out * in_features / ours.median / 1e12:>8.1f} {dense.median * 1e6:>9.1f} "
                          f"{dense.median / ours.median:>8.2f}x {err:>11.1e}")  # fmt: skip
                del w, dense_w
    return 0


# (rows, module constant -> values): the GEMV's tile at decode row counts, the GEMM's at small batches
SWEEP = [((1, 4), {"GEMV_BLOCK_N": (16, 32, 64, 128), "GEMV_BLOCK_K": (128, 256)}),
         ((8, 32), {"GEMM_BLOCK_N": (32, 64, 128), "GEMM_BLOCK_K": (64, 128)})]


def sweep(dtype: torch.dtype, flush: torch.Tensor, roof_bps: float, repeats: int, seed: int) -> None:
    """Median time and fraction of the roofline of each tile size (set on the module, as the launchers read
    it per call) for Llama-3-8B's gate_up and down projections, each kind."""
    import itertools

    from engine.kernels import quant_linear_triton as qlt

    g = torch.Generator(device="cuda").manual_seed(seed)
    print(f"{'proj':>8} {'kind':>5} {'rows':>5} {'tile':>28} {'us med':>8} {'of roof':>8}")
    for name, out, in_features in SHAPES["llama3-8b"][2:]:
        for kind in KINDS:
            w = make_weight(kind, out, in_features, g)
            for row_counts, knobs in SWEEP:
                saved = {k: getattr(qlt, k) for k in knobs}
                for rows in row_counts:
                    x = torch.randn(rows, in_features, generator=g, device="cuda").to(dtype)
                    num_bytes = w.nbytes + (x.numel() + rows * out) * x.element_size()
                    for values in itertools.product(*knobs.values()):
                        for knob, value in zip(knobs, values):
                            setattr(qlt, knob, value)
                        t = time_cuda(lambda x=x, w=w: qlt.quantized_linear_triton(x, w), flush, repeats)
                        tile = " ".join(f"{k.split('_', 1)[1]}={v}" for k, v in zip(knobs, values))
                        print(f"{name:>8} {kind:>5} {rows:>5} {tile:>28} {t.median * 1e6:>8.1f} "
                              f"{num_bytes / t.median / roof_bps:>8.1%}", flush=True)
                for knob, value in saved.items():
                    setattr(qlt, knob, value)
            del w


if __name__ == "__main__":
    sys.exit(main())
