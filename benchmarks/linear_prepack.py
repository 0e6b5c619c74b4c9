"""`F.linear` vs the same GEMM on prepacked weights (what vLLM's CPU backend and inductor's freezing do).

    .venv/bin/python benchmarks/linear_prepack.py                # qwen05b's GEMM shapes, as engine/linear_fast.py
    .venv/bin/python benchmarks/linear_prepack.py --shapes 896x4864 --batches 1,2,4,8,16 --hints 1,8,64

Columns, fastest of `--repeats` calls made in turn (on a shared machine other processes only ever slow a
call down):
- `F.linear`: the plain reference.
- `onednn hH`: oneDNN packed for batch hint H (`torch.ops.mkldnn._reorder_linear_weight` +
  `_linear_pointwise`), the path engine/linear_fast.py takes (one packed copy serves every row count).
- `mkl`: fp32 only, MKL's packed GEMM (`_mkl_reorder_linear_weight` + `_mkl_linear`); torch runs it only at
  exactly the row count it was packed for, so it cannot serve a varying batch.
- `fp32 math` (bf16 only): engine/linear_fast.py's path for bf16 weights on CPUs without bf16 arithmetic,
  an fp32 packed copy with the input and output cast.
Weights smaller than the last-level cache are re-read from it, not DRAM, so large-shape rows are the ones
that carry over to a whole model.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def fastest_ms(fns: dict, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Fastest wall time of each fn(x), in ms, the calls made in turn."""
    for fn in fns.values():
        fn(x)
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(x)
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: s * 1e3 for name, s in best.items()}


def candidates(w: torch.Tensor, batch: int, hints: list[int]) -> dict:
    """name -> callable x -> x @ w.T; the first is the reference."""
    fns = {"F.linear": lambda x: F.linear(x, w)}
    for hint in hints:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, hint)
        fns[f"onednn h{hint}"] = lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
    if w.dtype == torch.float32:
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, batch)
        fns["mkl"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl, w, None, batch)
    else:
        p32 = torch.ops.mkldnn._reorder_linear_weight(w.float(), hints[0])
        fns["fp32 math"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            x.float(), p32, None, "none", [], "").to(x.dtype)
    return fns


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1152x896,896x896,9728x896,896x4864,151936x896",
                   help="comma-separated NxK (out x in features); default: qwen05b's qkv, o, gate_up, down, lm_head")
    p.add_argument("--batches", default="1,8,64", help="rows M of the activation")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--hints", default="8", help="oneDNN batch-size hints to pack for")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"linear_prepack config {vars(args)} torch={torch.__version__}", flush=True)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    hints = [int(h) for h in args.hints.split(",")]
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            w = (torch.randn(n, k) * 0.05).to(dtype)
            for batch in (int(b) for b in args.batches.split(",")):
                x = torch.randn(batch, k).to(dtype)
                fns = candidates(w, batch, hints)
                ref = fns["F.linear"](x).float()
                errs = {name: (fn(x).float() - ref).abs().max().item() for name, fn in fns.items()}
                repeats = max(2, args.repeats // 4) if n * k > 50e6 else args.repeats
                ms = fastest_ms(fns, x, repeats)
                cells = "  ".join(f"{name} {t:7.2f} ms (x{ms['F.linear'] / t:4.2f}, diff {errs[name]:.1g})"
                                  for name, t in ms.items() if name != "F.linear")
                print(f"{str(dtype).removeprefix('torch.'):>8} {n}x{k} M={batch:<3} F.linear {ms['F.linear']:7.2f} ms  "
                      f"{cells}", flush=True)


if __name__ == "__main__":
    main()
