"""`F.linear` vs the same GEMM on prepacked weights (what vLLM's CPU backend and inductor's freezing do).

    .venv/bin/python benchmarks/linear_prepack.py                # qwen05b's gate_up and lm_head shapes
    .venv/bin/python benchmarks/linear_prepack.py --shapes 896x4864 --batches 1,2,4,8,16

fp32 uses MKL's packed GEMM (`torch.ops.mkl._mkl_reorder_linear_weight` + `_mkl_linear`), bf16 oneDNN's
(`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`). The two calls are timed alternately and
the fastest of `--repeats` is kept: on a shared machine other processes only ever slow a call down.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F


def fastest_ms_pair(fa, fb, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Fastest wall time of fa(x) and of fb(x), in ms, the two called alternately."""
    fa(x), fb(x)
    best_a = best_b = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fa(x)
        t1 = time.perf_counter()
        fb(x)
        t2 = time.perf_counter()
        best_a, best_b = min(best_a, t1 - t0), min(best_b, t2 - t1)
    return best_a * 1e3, best_b * 1e3


def packed_linear(w: torch.Tensor, batch: int):
    """A callable x -> x @ w.T on weights packed for `batch` rows (the fast path; F.linear is the reference)."""
    if w.dtype == torch.float32:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, batch)
        return lambda x: torch.ops.mkl._mkl_linear(x, packed, w, None, batch)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, batch)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="9728x896,151936x896", help="comma-separated NxK (out x in features)")
    p.add_argument("--batches", default="1,8,64", help="rows M of the activation")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"linear_prepack config {vars(args)} torch={torch.__version__}", flush=True)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            w = torch.randn(n, k).to(dtype)
            for batch in (int(b) for b in args.batches.split(",")):
                x = torch.randn(batch, k).to(dtype)
                ref, fast = functools.partial(F.linear, weight=w), packed_linear(w, batch)
                err = (fast(x).float() - ref(x).float()).abs().max().item()
                ref_ms, fast_ms = fastest_ms_pair(ref, fast, x, args.repeats)
                print(f"{str(dtype).removeprefix('torch.'):>8} {n}x{k} M={batch:<3} F.linear {ref_ms:8.2f} ms  "
                      f"packed {fast_ms:8.2f} ms  speedup {ref_ms / fast_ms:4.2f}  max|diff| {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
