"""The Triton quantized linears (engine/kernels/quant_linear_triton.py) against the memory roofline and
against a dense fp16 / bf16 matmul, in one run (issue 18, part 4).

At few rows a weight-only linear is bound by reading its weight once: its floor is (bytes of the packed
weight + scales (+ mins) + x + y) / (device memory bandwidth). The bandwidth is measured in the same run
as a device-to-device copy of a buffer far larger than L2 ((read + write bytes) / time). The calls are
timed from a CUDA graph over copies of the weight that together exceed L2 (see `time_cuda`): no call reads
its weight from cache, and no host launch cost is counted (decode steps replay graphs too).
The peer is torch's dense matmul (`F.linear`, cuBLAS) on the dequantized weight in the activation dtype:
the figure that matters at decode row counts is its time over ours (int8 reads ~half its bytes, int4
~0.28x), and at prefill row counts how close we stay to it (compute-bound: TFLOP/s shown).

Shapes: the default model's projections (SmolLM2-135M: hidden 576, MLP 1536, vocab 49152; fused q/k/v
and gate/up as the engine holds them) and Llama-3-8B's (hidden 4096, MLP 14336, 8 KV heads).

    python benchmarks/quant_triton_bench.py [--dtype float16] [--rows 1 8 32 512] [--model both] [--repeats 50]
    python benchmarks/quant_triton_bench.py --sweep [--best BEST.json]  # the launch settings, on Llama-3-8B's shapes

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

ROTATION_BYTES = 256 << 20  # > L2 on every current GPU (H100: 50 MiB, H200: 60 MiB)
MAX_COPIES = 256
# (name, out_features, in_features)
SHAPES = {
    "smollm2-135m": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
                     ("lm_head", 49152, 576)],
    "llama3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
}
KINDS = ("int8", "q8_0", "int4")


def time_cuda(calls: list[Callable[[], object]], repeats: int) -> Spread:
    """Seconds per call over `calls`, each reading its own copy of the weight (together past L2, so no call
    finds its weight cached), captured in one CUDA graph so that only the GPU's time counts (a Triton launch
    costs tens of microseconds of Python, more than a decode-size kernel runs); each replay runs every call
    once, and `repeats` replays are timed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles the kernels, outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    del graph
    return Spread.of([start.elapsed_time(end) / 1e3 / len(calls) for start, end in events])


def copies_of(t: torch.Tensor | None, count: int) -> list[torch.Tensor | None]:
    return [None if t is None else t.clone() for _ in range(count)]


def rotation(w, dense: torch.Tensor | None = None):
    """(copies of the quantized weight, copies of the dense one): enough that one pass reads ROTATION_BYTES."""
    from engine.quant_format import QuantizedWeight

    count = max(2, min(MAX_COPIES, -(-ROTATION_BYTES // w.nbytes)))
    ws = [QuantizedWeight(w.kind, q, s, m, w.group_size)
          for q, s, m in zip(copies_of(w.qweight, count), copies_of(w.scales, count), copies_of(w.mins, count))]
    if dense is None:
        return ws, []
    dense_count = max(2, min(MAX_COPIES, -(-ROTATION_BYTES // (dense.numel() * dense.element_size()))))
    return ws, copies_of(dense, dense_count)


def copy_bandwidth(num_bytes: int, repeats: int) -> Spread:
    """Bytes/s of a device-to-device copy of `num_bytes` (read + write: 2 * num_bytes moved), timed eagerly with
    events (a copy captured in a graph becomes a copy-engine memcpy node, ~35 % slower than the SMs' copy kernel);
    at this size the launch cost is noise."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    dst.copy_(src)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        dst.copy_(src)
        end.record()
    torch.cuda.synchronize()
    seconds = Spread.of([start.elapsed_time(end) / 1e3 for start, end in events])
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
    parser.add_argument("--groups", nargs="+", default=list(SWEEP), choices=list(SWEEP), help="with --sweep")
    parser.add_argument("--best", default=None, help="with --sweep: write the best setting of each knob (JSON) here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        print("quant_triton_bench: needs CUDA and triton (GPU kernels only); skipped")
        return 0

    from engine.kernels.quant_linear_triton import quantized_linear_triton
    from engine.quant_format import dequantize, quantized_linear_reference

    dtype = getattr(torch, args.dtype)
    props = torch.cuda.get_device_properties(0)
    copy_bps = copy_bandwidth(1 << 30, args.repeats)
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
        sweep(getattr(torch, args.dtype), copy_bps.max, args.repeats, args.seed, args.best, args.groups)
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
                    ws, dense_ws = rotation(w, dense_w)
                    ours = time_cuda([lambda x=x, w=w: quantized_linear_triton(x, w) for w in ws], args.repeats)
                    dense = time_cuda([lambda x=x, d=d: F.linear(x, d) for d in dense_ws], args.repeats)
                    del ws, dense_ws
                    print(f"{model:>13} {name:>8} {kind:>5} {rows:>5} {num_bytes / 2**20:>7.2f} "
                          f"{ours.min * 1e6:>6.1f} /{ours.median * 1e6:>6.1f} /{ours.max * 1e6:>6.1f} "
                          f"{num_bytes / ours.median / 1e9:>6.0f} {num_bytes / ours.median / copy_bps.max:>8.1%} "
                          f"{2 * rows * out * in_features / ours.median / 1e12:>8.1f} {dense.median * 1e6:>9.1f} "
                          f"{dense.median / ours.median:>8.2f}x {err:>11.1e}")  # fmt: skip
                del w, dense_w
    return 0


# name -> (rows, module constant -> values): the GEMV's launch at decode row counts, the GEMM's at small batches,
# up to how many rows the GEMV runs (GEMV_MAX_ROWS 16: it does; 1: the GEMM does), and where prefill switches to
# dequantize + cuBLAS (*DEQUANT_MIN_ROWS 1: always; 1 << 30: never)
NEVER = 1 << 30
SWEEP = {
    "gemv": ((1,), {"GEMV_BLOCK_N": (16, 32, 64), "GEMV_BLOCK_K": (256, 512), "GEMV_NUM_WARPS": (4, 8),
                    "GEMV_NUM_STAGES": (1, 3), "GEMV_PROGRAMS_PER_SM": (2, 8)}),
    "gemm": ((8, 32), {"GEMM_BLOCK_N": (64, 128), "GEMM_BLOCK_K": (64, 128), "GEMM_NUM_WARPS": (4, 8),
                       "GEMM_PROGRAMS_PER_SM": (1, 2, 4)}),
    "gemv_rows": ((2, 4, 8, 16), {"GEMV_MAX_ROWS": (16, 1)}),
    "dequant": ((32, 64, 128, 256, 512), {"DEQUANT_MIN_ROWS": (1, NEVER), "PER_CHANNEL_DEQUANT_MIN_ROWS": (1, NEVER)}),
}
# groups whose settings are paired, not crossed (both thresholds on or both off)
PAIRED = {"dequant"}
SWEEP_PROJECTIONS = ("o", "gate_up", "down")


def sweep(dtype: torch.dtype, roof_bps: float, repeats: int, seed: int, best_path: str | None,
          groups: list[str]) -> None:
    """Median time of each setting of each knob group in `groups` (set on the module, as the launchers read it
    per call) for Llama-3-8B's SWEEP_PROJECTIONS, each kind; then, per tile group, every setting's geometric mean
    over all cells of (its time / the cell's best time), best first: the setting to keep is the one at the top;
    for the two switches (gemv_rows, dequant), the row count from which on (up to which) one side wins. With
    `best_path`, those choices are written there as JSON (benchmarks/decode_step_cuda.py --tiles reads it)."""
    import itertools
    import json

    from engine.kernels import quant_linear_triton as qlt

    g = torch.Generator(device="cuda").manual_seed(seed)
    print(f"{'proj':>8} {'kind':>5} {'rows':>5} {'setting':>60} {'us med':>8} {'of roof':>8}")
    times: dict[str, dict[tuple, dict[tuple, float]]] = {name: {} for name in groups}
    for name, out, in_features in SHAPES["llama3-8b"]:
        if name not in SWEEP_PROJECTIONS:
            continue
        for kind in KINDS:
            w = make_weight(kind, out, in_features, g)
            ws, _ = rotation(w)
            for group in groups:
                row_counts, knobs = SWEEP[group]
                settings = list(zip(*knobs.values())) if group in PAIRED else list(itertools.product(*knobs.values()))
                saved = {k: getattr(qlt, k) for k in knobs}
                for rows in row_counts:
                    x = torch.randn(rows, in_features, generator=g, device="cuda").to(dtype)
                    num_bytes = w.nbytes + (x.numel() + rows * out) * x.element_size()
                    cell = times[group].setdefault((name, kind, rows), {})
                    for values in settings:
                        for knob, value in zip(knobs, values):
                            setattr(qlt, knob, value)
                        t = time_cuda([lambda x=x, w=w: qlt.quantized_linear_triton(x, w) for w in ws], repeats)
                        cell[values] = t.median
                        setting = " ".join(f"{k}={v}" for k, v in zip(knobs, values))
                        print(f"{name:>8} {kind:>5} {rows:>5} {setting:>60} {t.median * 1e6:>8.1f} "
                              f"{num_bytes / t.median / roof_bps:>8.1%}", flush=True)
                for knob, value in saved.items():
                    setattr(qlt, knob, value)
            del w, ws
    best = {}
    for group in groups:
        if group == "gemv_rows":  # the GEMV up to the most rows at which it wins at every row count up to there
            best["GEMV_MAX_ROWS"] = switch_rows(times[group], KINDS, (16,), (1,), upward=True) or 1
        elif group == "dequant":  # per-channel int8 and the grouped kinds each switch where they win from on
            on, off = (1, 1), (NEVER, NEVER)
            best["PER_CHANNEL_DEQUANT_MIN_ROWS"] = switch_rows(times[group], ("int8",), on, off) or NEVER
            best["DEQUANT_MIN_ROWS"] = switch_rows(times[group], ("q8_0", "int4"), on, off) or NEVER
        else:
            best.update(best_setting(group, times[group], qlt))
    print(f"\nbest: {json.dumps(best)}")
    if best_path:
        with open(best_path, "w") as f:
            json.dump(best, f)


def best_setting(group: str, cells: dict[tuple, dict[tuple, float]], qlt) -> dict:
    """Prints the group's settings ranked by geometric mean of time / the cell's best; returns the top one."""
    import math

    knobs = SWEEP[group][1]
    settings = list(next(iter(cells.values())))
    score = {v: math.exp(sum(math.log(c[v] / min(c.values())) for c in cells.values()) / len(cells)) for v in settings}
    default = tuple(getattr(qlt, k) for k in knobs)
    print(f"\n{' '.join(knobs)}: geometric mean of time / best over {len(cells)} cells (default {default})")
    for v in sorted(settings, key=score.get)[:8]:
        print(f"  {v}: {score[v]:.3f}")
    if default in score:
        print(f"  default {default}: {score[default]:.3f}")
    return dict(zip(knobs, min(settings, key=score.get)))


def switch_rows(cells: dict[tuple, dict[tuple, float]], kinds: tuple[str, ...], on: tuple, off: tuple,
                upward: bool = False) -> int | None:
    """The row count where setting `on` starts to win (geometric mean over the kinds' cells at that row count)
    and keeps winning from there to the largest row count, or with `upward`, the largest row count up to which
    it wins at every smaller one; None if it never does. Prints the ratio per row count."""
    import math

    row_counts = sorted({rows for (_, _, rows) in cells})
    ratio = {}
    for rows in row_counts:
        logs = [math.log(c[on] / c[off]) for (_, kind, r), c in cells.items() if r == rows and kind in kinds]
        ratio[rows] = math.exp(sum(logs) / len(logs))
    print(f"\n{'/'.join(kinds)}: time {on} / time {off} by rows: "
          + ", ".join(f"{rows}: {ratio[rows]:.2f}" for rows in row_counts))
    switch = None
    for rows in (row_counts if upward else reversed(row_counts)):
        if ratio[rows] >= 1:
            break
        switch = rows
    return switch


if __name__ == "__main__":
    sys.exit(main())
