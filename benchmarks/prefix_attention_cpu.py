"""Prefill attention over a cached prefix on CPU: engine/kernels/prefix_attention.py's twin (SDPA given a batch dim,
so CPU dispatch takes its flash kernel, mask allowed) against the same SDPA call on 3-D inputs (what the twin did
before 2026-11-28: CPU's unfused math fallback), on the same gathered K/V, interleaved.

    .venv/bin/python benchmarks/prefix_attention_cpu.py [--repeats 5]

Shapes of the default model (9 query heads, 3 KV heads, head_dim 64): a chunk of `q` queries after `ctx - q` cached
tokens, e.g. a chat's new question (30) over a ~300-token shared system prompt. Prints min / median / max us a
layer of each and their ratio per repeat; checks the outputs agree.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine.kernels.prefix_attention import prefix_attention_torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = ((30, 330), (256, 512), (512, 2048))  # (queries, context tokens)


def math_path(q, k_cache, v_cache, table, num_ctx, scale):
    """The twin with 3-D SDPA inputs (SDPA's math fallback on CPU): the reference being replaced."""
    num_q = q.shape[0]
    k = k_cache.index_select(1, table).view(KV_HEADS, -1, HEAD_DIM)[:, :num_ctx]
    v = v_cache.index_select(1, table).view(KV_HEADS, -1, HEAD_DIM)[:, :num_ctx]
    mask = torch.arange(num_ctx).unsqueeze(0) <= torch.arange(num_ctx - num_q, num_ctx).unsqueeze(1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=True).transpose(0, 1)


def time_us(fn, args: tuple, calls: int = 10) -> float:
    start_s = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return 1e6 * (time.perf_counter() - start_s) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(f"config: {vars(args)} threads={torch.get_num_threads()} shapes (queries, context)={SHAPES}")
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for num_q, num_ctx in SHAPES:
            num_blocks = -(-num_ctx // BLOCK)
            k_cache = torch.randn(KV_HEADS, num_blocks + 8, BLOCK, HEAD_DIM, dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            table = torch.randperm(num_blocks + 8)[:num_blocks]
            q = torch.randn(num_q, HEADS, HEAD_DIM, dtype=dtype)
            args_ = (q, k_cache, v_cache, table, num_ctx, HEAD_DIM ** -0.5)
            error = (prefix_attention_torch(*args_).float() - math_path(*args_).float()).abs().max().item()
            assert error < (2e-2 if dtype == torch.bfloat16 else 1e-4), error
            twin, old = [], []
            for _ in range(args.repeats):
                twin.append(time_us(prefix_attention_torch, args_))
                old.append(time_us(math_path, args_))
            ratios = [o / t for o, t in zip(old, twin)]
            print(f"{str(dtype)[6:]:8s} q={num_q:4d} ctx={num_ctx:5d}: twin {statistics.median(twin):8.0f} us, "
                  f"3-D math path {statistics.median(old):8.0f} us; math / twin min/median/max "
                  f"{min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f}")


if __name__ == "__main__":
    main()
