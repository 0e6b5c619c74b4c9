"""The C quantized linears (engine/kernels/csrc/quant_kernels.c) against the memory roofline and dense fp32, in one run.

A GEMV reads its weight once: `QuantizedWeight.nbytes` (q values, scales, mins) plus the activations. Its
achieved bandwidth is those bytes over the call's time (wrapper included: that is what the model pays), and the
ceiling is the DRAM read bandwidth measured in the same run (benchmarks/bandwidth.py, a 1 GiB sum). Each timed
call reads a different copy of the weight, rotating through copies that together exceed 3x the last-level cache,
so the weight comes from DRAM as in a decode step over the whole model, not from cache. The peer is fp32
`F.linear` on the dense weight (same rotation); for many rows, also the dequantize-then-GEMM path
(`dequantized_linear_native`), whose crossover with the kernel the dispatcher uses, and the same library built
with -DPANELS_OFF (the per-output-row loops at every row count), whose crossover with the dequantized panels
(csrc/quant_panels.c) sets PANEL_MIN_ROWS.

Shapes: SmolLM2-135M (hidden 576, intermediate 1536, fused qkv 576 -> 960, fused gate_up 576 -> 3072, down
1536 -> 576, lm_head 576 -> 49152). min / median / max over repeats, each repeat the mean of one rotation.

    PYTHONPATH=$PWD python benchmarks/quant_kernels_bench.py [--rows 1 8 32] [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.bandwidth import Spread, measure_read_bandwidth
from engine.kernels import cpu_native
from engine.quant_format import QuantizedWeight, quantize_int4, quantize_int8

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
ROTATION_BYTES = 96 << 20  # > 3x a 32 MiB L3
CROSSOVER_ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 512)


def copies_for(num_bytes: int) -> int:
    return max(1, -(-ROTATION_BYTES // num_bytes))


def time_rotation(fn: Callable[[torch.Tensor, object], object], x: torch.Tensor, weights: list, repeats: int
                  ) -> Spread:
    """Seconds per fn(x, weight), min / median / max over `repeats` passes, each the mean over a rotation through
    `weights` (at least 8 calls)."""
    copies = len(weights)
    calls = max(copies, 8)
    fn(x, weights[0])
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(x, weights[i % copies])
        samples.append((time.perf_counter() - t0) / calls)
    return Spread.of(samples)


def quantized(kind: str, dense: torch.Tensor) -> QuantizedWeight:
    return quantize_int8(dense) if kind == "int8" else quantize_int4(dense)


def fmt(s: Spread, scale: float = 1.0, digits: int = 2) -> str:
    return " / ".join(f"{v * scale:.{digits}f}" for v in (s.min, s.median, s.max))


def roofline_table(rows_list: list[int], repeats: int, bandwidth: float) -> None:
    print("\n| shape | kind | rows | weight MB | kernel us | GB/s | of roofline | fp32 F.linear us | fp32 / kernel |")
    print("|---|---|---:|---:|---|---|---|---|---|")
    for name, (out, inp) in SHAPES.items():
        dense = torch.randn(out, inp, generator=torch.Generator().manual_seed(0)) * 0.05
        dense_copies = [dense.clone() for _ in range(copies_for(dense.numel() * 4))]
        for kind in ("int8", "int4"):
            base = quantized(kind, dense)
            weights = [QuantizedWeight(base.kind, base.qweight.clone(), base.scales.clone(),
                                       None if base.mins is None else base.mins.clone(), base.group_size)
                       for _ in range(copies_for(base.nbytes))]
            for rows in rows_list:
                x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(1))
                kernel = time_rotation(cpu_native.quantized_linear_native, x, weights, repeats)
                dense_t = time_rotation(F.linear, x, dense_copies, repeats)
                moved = base.nbytes + x.numel() * 4
                rates = Spread(moved / kernel.max, moved / kernel.median, moved / kernel.min)
                ratio = Spread(dense_t.min / kernel.max, dense_t.median / kernel.median, dense_t.max / kernel.min)
                print(f"| {name} {out}x{inp} | {kind} | {rows} | {base.nbytes / 1e6:.2f} | {fmt(kernel, 1e6, 1)} | "
                      f"{fmt(rates, 1e-9, 1)} | {fmt(rates, 1 / bandwidth)} | {fmt(dense_t, 1e6, 1)} | {fmt(ratio)} |")


def crossover_table(repeats: int) -> None:
    """Kernel vs dequantize-then-GEMM and vs the per-output-row loops (a -DPANELS_OFF build) by row count, on
    gate_up, down and lm_head (weights rotated as above)."""
    native = cpu_native.native_library()
    compiler = cpu_native._compiler()
    panels_off = cpu_native.load(cpu_native._build(compiler, [*cpu_native.FLAGS, "-DPANELS_OFF"]))

    def row_loops(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        cpu_native._library = panels_off
        try:
            return cpu_native.quantized_linear_native(x, w)
        finally:
            cpu_native._library = native

    print("\n| shape | kind | rows | kernel us | row loops us | dequantize + GEMM us | kernel / row loops | "
          "kernel / dequantize+GEMM |")
    print("|---|---|---:|---|---|---|---:|---:|")
    for name in ("gate_up", "down", "lm_head"):
        out, inp = SHAPES[name]
        dense = torch.randn(out, inp, generator=torch.Generator().manual_seed(0)) * 0.05
        for kind in ("int8", "int4"):
            base = quantized(kind, dense)
            weights = [QuantizedWeight(base.kind, base.qweight.clone(), base.scales.clone(),
                                       None if base.mins is None else base.mins.clone(), base.group_size)
                       for _ in range(copies_for(base.nbytes))]
            for rows in CROSSOVER_ROWS:
                x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(1))
                kernel = time_rotation(cpu_native.quantized_linear_native, x, weights, repeats)
                loops = time_rotation(row_loops, x, weights, repeats)
                gemm = time_rotation(cpu_native.dequantized_linear_native, x, weights, repeats)
                print(f"| {name} | {kind} | {rows} | {fmt(kernel, 1e6, 1)} | {fmt(loops, 1e6, 1)} | "
                      f"{fmt(gemm, 1e6, 1)} | {kernel.median / loops.median:.2f} | {kernel.median / gemm.median:.2f} |",
                      flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-crossover", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib = cpu_native.native_library()
    if lib is None:
        raise SystemExit("the C kernels could not be built here: nothing to measure")
    print(f"config: rows={args.rows} repeats={args.repeats} threads={args.threads} "
          f"vector_bits={lib.duet_quant_vector_bits()} rotation>={ROTATION_BYTES >> 20} MiB")
    bandwidth = measure_read_bandwidth(1 << 30)
    print(f"DRAM read bandwidth GB/s (1 GiB sum): {fmt(bandwidth, 1e-9, 1)}; roofline uses the max")
    roofline_table(args.rows, args.repeats, bandwidth.max)
    if not args.no_crossover:
        crossover_table(args.repeats)


if __name__ == "__main__":
    main()
