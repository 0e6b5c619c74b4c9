"""CUDA kernels against the device's memory bandwidth, and against their torch twins, in one run (issue 5).

Paged decode attention is bandwidth-bound: a step must read every cached K and V token of the batch once
(plus q, and write the output). Its achieved bandwidth is those bytes over the kernel's time; the ceiling
is a device-to-device copy of a buffer far larger than L2, measured in the same run ((read + write bytes)
/ time), so the figure that matters is the fraction. Block tables are shuffled (scattered blocks) and each
timed call follows a write over a 256 MiB buffer, which evicts the inputs from L2 and keeps the GPU busy
while the call is launched, so neither cache hits nor launch overhead flatter the figure. The torch twin
(what the CPU runs: gather + matmul) is timed on the same inputs, and each kernel's output is checked
against it.

Also, on the same footing: prefill attention over a cached prefix (Triton vs the twin's gather + masked
SDPA, and vs SDPA's flash path for a chunk with no prefix), fused add + RMSNorm and RoPE (bandwidth
fractions, Triton vs twin).

    python benchmarks/kernels_bench.py [--dtype bfloat16] [--batch 1 8 64] [--context 1024 4096 16384]

Without CUDA (or triton) it prints why and exits 0: it measures GPU kernels only.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

GiB = 1 << 30
FLUSH_BYTES = 256 << 20  # > L2 on every current GPU (H100/H200: 50 MiB)


def time_cuda(fn: Callable[[], object], flush: torch.Tensor, repeats: int) -> float:
    """Median seconds of fn() on the GPU (CUDA events), each call after an L2-evicting write; one untimed call first."""
    fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def copy_bandwidth(num_bytes: int, flush: torch.Tensor, repeats: int) -> float:
    """Bytes/s of a device-to-device copy of `num_bytes` (it reads and writes them: 2 * num_bytes moved)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), flush, repeats)
    return 2 * num_bytes / seconds


@dataclass
class PagedInputs:
    q: torch.Tensor  # [B, heads, head_dim]
    k_cache: torch.Tensor  # [kv_heads, num_blocks, block_size, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, width] int64, shuffled blocks, padded with block 0
    context_lens: torch.Tensor  # [B] int32
    mask: torch.Tensor  # [B, width * block_size] additive, as the model runner builds it

    def kv_bytes(self) -> int:
        """K and V bytes the batch's contexts occupy: what any decode attention must read."""
        kv_heads, _, _, head_dim = self.k_cache.shape
        return 2 * int(self.context_lens.sum()) * kv_heads * head_dim * self.k_cache.element_size()


def make_paged_inputs(
    lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, g: torch.Generator
) -> PagedInputs:
    blocks = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(blocks)
    shape = (kv_heads, num_blocks, block_size, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    v_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(int(g.initial_seed())))
    width = max(blocks)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    taken = 0
    for seq, n in enumerate(blocks):
        tables[seq, :n] = order[taken : taken + n]
        taken += n
    context_lens = torch.tensor(lens, dtype=torch.int32)
    past_end = torch.arange(width * block_size) >= context_lens.unsqueeze(1)
    mask = torch.zeros(past_end.shape).masked_fill_(past_end, float("-inf"))
    q = torch.randn(len(lens), heads, head_dim, device="cuda", dtype=dtype, generator=g)
    return PagedInputs(q, k_cache, v_cache, tables.cuda(), context_lens.cuda(), mask.cuda())


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def bench_decode(args, flush: torch.Tensor, copy_bps: float, dtype: torch.dtype) -> None:
    from engine.kernels import decode_attention_torch, decode_attention_triton

    print("\npaged decode attention (one query token per sequence; bytes = K + V of every context token + q + out)")
    print(f"{'batch':>5} {'context':>8} {'lengths':>8} {'MiB read':>9} {'triton us':>10} {'GB/s':>7} "
          f"{'of copy':>8} {'twin us':>9} {'twin GB/s':>9} {'speedup':>8} {'max err':>8}")  # fmt: skip
    for batch in args.batch:
        for context in args.context:
            for lengths in ("equal", "uniform"):
                g = torch.Generator(device="cuda").manual_seed(args.seed)
                if lengths == "equal":
                    lens = [context] * batch
                else:  # uniform in [1, context], the longest at `context` so the padded width matches
                    rng = torch.Generator().manual_seed(args.seed)
                    lens = torch.randint(1, context + 1, (batch,), generator=rng).tolist()
                    lens[0] = context
                x = make_paged_inputs(lens, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype, g)
                scale = args.head_dim**-0.5
                flat = x.block_tables.flatten()

                def triton_call(x=x, scale=scale):
                    return decode_attention_triton(x.q, x.k_cache, x.v_cache, x.block_tables, x.context_lens, scale)

                def twin_call(x=x, scale=scale, flat=flat):
                    return decode_attention_torch(x.q, x.k_cache, x.v_cache, flat, x.mask, scale)

                err = max_error(triton_call(), twin_call())
                num_bytes = x.kv_bytes() + 2 * x.q.numel() * x.q.element_size()
                t_triton = time_cuda(triton_call, flush, args.repeats)
                t_twin = time_cuda(twin_call, flush, args.repeats)
                print(f"{batch:>5} {context:>8} {lengths:>8} {num_bytes / 2**20:>9.1f} {t_triton * 1e6:>10.1f} "
                      f"{num_bytes / t_triton / 1e9:>7.0f} {num_bytes / t_triton / copy_bps:>8.1%} "
                      f"{t_twin * 1e6:>9.1f} {num_bytes / t_twin / 1e9:>9.0f} {t_twin / t_triton:>7.1f}x "
                      f"{err:>8.1e}")  # fmt: skip
                del x


def bench_prefix(args, flush: torch.Tensor, dtype: torch.dtype) -> None:
    from engine.kernels import prefix_attention_torch, prefix_attention_triton

    print("\nprefill attention over a cached prefix (one chunk; TFLOP/s counts only visible query-key pairs)")
    print(f"{'chunk':>6} {'cached':>7} {'triton us':>10} {'TFLOP/s':>8} {'twin us':>9} {'speedup':>8} "
          f"{'flash us':>9} {'max err':>8}")  # fmt: skip
    for chunk in args.chunk:
        for cached in args.cached:
            g = torch.Generator(device="cuda").manual_seed(args.seed)
            num_ctx = cached + chunk
            x = make_paged_inputs([num_ctx], args.heads, args.kv_heads, args.head_dim, args.block_size, dtype, g)
            q = torch.randn(chunk, args.heads, args.head_dim, device="cuda", dtype=dtype, generator=g)
            table, scale = x.block_tables[0], args.head_dim**-0.5

            def triton_call(q=q, x=x, table=table, num_ctx=num_ctx, scale=scale):
                return prefix_attention_triton(q, x.k_cache, x.v_cache, table, num_ctx, scale)

            def twin_call(q=q, x=x, table=table, num_ctx=num_ctx, scale=scale):
                return prefix_attention_torch(q, x.k_cache, x.v_cache, table, num_ctx, scale)

            err = max_error(triton_call(), twin_call())
            visible_pairs = chunk * cached + chunk * (chunk + 1) // 2
            flops = 4 * args.heads * args.head_dim * visible_pairs
            t_triton = time_cuda(triton_call, flush, args.repeats)
            t_twin = time_cuda(twin_call, flush, args.repeats)
            flash = "-"
            if cached == 0:  # what engine/attention.py runs for a chunk with no prefix: SDPA, is_causal (flash)
                k = x.k_cache.index_select(1, table).view(args.kv_heads, -1, args.head_dim)[:, :num_ctx]
                v = x.v_cache.index_select(1, table).view(args.kv_heads, -1, args.head_dim)[:, :num_ctx]
                qt = q.transpose(0, 1)

                def flash_call(qt=qt, k=k, v=v, scale=scale):
                    return F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, enable_gqa=True)

                flash = f"{time_cuda(flash_call, flush, args.repeats) * 1e6:.1f}"
            print(f"{chunk:>6} {cached:>7} {t_triton * 1e6:>10.1f} {flops / t_triton / 1e12:>8.1f} "
                  f"{t_twin * 1e6:>9.1f} {t_twin / t_triton:>7.1f}x {flash:>9} {err:>8.1e}")  # fmt: skip
            del x, q


def bench_elementwise(args, flush: torch.Tensor, copy_bps: float, dtype: torch.dtype) -> None:
    from engine.kernels import (
        apply_rotary_torch,
        apply_rotary_triton,
        fused_add_rms_norm_torch,
        fused_add_rms_norm_triton,
    )
    from engine.rope import RotaryEmbedding

    g = torch.Generator(device="cuda").manual_seed(args.seed)
    rope = RotaryEmbedding(args.head_dim, 8192, 500000.0, {}).to("cuda")
    print("\nfused add + RMSNorm and RoPE (bytes = every tensor read and written once)")
    print(f"{'kernel':>14} {'tokens':>7} {'triton us':>10} {'of copy':>8} {'twin us':>9} {'speedup':>8} {'max err':>8}")
    for tokens in args.tokens:
        x, residual = (torch.randn(tokens, args.hidden, device="cuda", dtype=dtype, generator=g) for _ in range(2))
        weight = torch.randn(args.hidden, device="cuda", dtype=dtype, generator=g)
        heads = args.heads + args.kv_heads
        qkv = torch.randn(tokens, (heads + args.kv_heads) * args.head_dim, device="cuda", dtype=dtype, generator=g)
        qk = qkv[:, : heads * args.head_dim].view(tokens, heads, args.head_dim)  # the model's strided view
        positions = torch.randint(0, 8192, (tokens,), device="cuda", generator=g)
        cos, sin = rope.cos_sin(positions, dtype)
        cases = [
            ("add+rmsnorm", 4 * x.numel() * x.element_size(),  # x, residual in; out, residual out
             partial(fused_add_rms_norm_triton, x, residual, weight, 1e-5),
             partial(fused_add_rms_norm_torch, x, residual, weight, 1e-5)),
            ("rope q+k", (2 * qk.numel() + 2 * cos.numel()) * qk.element_size(),
             partial(apply_rotary_triton, qk, cos, sin), partial(apply_rotary_torch, qk, cos, sin)),
        ]  # fmt: skip
        for name, num_bytes, triton_call, twin_call in cases:
            a, b = triton_call(), twin_call()
            err = max(max_error(u, v) for u, v in zip(a, b)) if isinstance(a, tuple) else max_error(a, b)
            t_triton = time_cuda(triton_call, flush, args.repeats)
            t_twin = time_cuda(twin_call, flush, args.repeats)
            print(f"{name:>14} {tokens:>7} {t_triton * 1e6:>10.1f} {num_bytes / t_triton / copy_bps:>8.1%} "
                  f"{t_twin * 1e6:>9.1f} {t_twin / t_triton:>7.1f}x {err:>8.1e}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--chunk", type=int, nargs="+", default=[512, 2048], help="prefill chunk sizes")
    parser.add_argument("--cached", type=int, nargs="+", default=[0, 2048, 8192], help="prefix tokens cached")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096], help="rows for RMSNorm / RoPE")
    parser.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy that sets the ceiling")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=["decode", "prefix", "elementwise"], help="run one section")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print("kernels_bench: skipped, no CUDA device (torch.cuda.is_available() is False); "
              "it measures GPU kernels only. On CPU the engine runs the torch twins.")  # fmt: skip
        return 0
    if importlib.util.find_spec("triton") is None:
        print("kernels_bench: skipped, triton is not installed (pip install triton==3.9.0)")
        return 0
    import triton

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / GiB:.0f} GiB; "
          f"torch {torch.__version__}, triton {triton.__version__}")  # fmt: skip
    print(f"config: dtype {args.dtype}, heads {args.heads}, kv_heads {args.kv_heads}, head_dim {args.head_dim}, "
          f"block_size {args.block_size}, hidden {args.hidden}, batches {args.batch}, contexts {args.context}, "
          f"chunks {args.chunk}, cached {args.cached}, tokens {args.tokens}, repeats {args.repeats} (median), "
          f"seed {args.seed}")  # fmt: skip
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    copy_bps = copy_bandwidth(int(args.copy_gib * GiB), flush, args.repeats)
    print(f"device-to-device copy of {args.copy_gib:g} GiB: {copy_bps / 1e9:.0f} GB/s (read + write), the ceiling")
    if args.only in (None, "decode"):
        bench_decode(args, flush, copy_bps, dtype)
    if args.only in (None, "prefix"):
        bench_prefix(args, flush, dtype)
    if args.only in (None, "elementwise"):
        bench_elementwise(args, flush, copy_bps, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
