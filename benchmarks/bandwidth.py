"""The memory-bandwidth ceiling of batch-1 decode: how fast could any engine go on this machine?

At batch 1 every decode step reads all the weights once (lm_head included; of the embedding only one row)
plus the KV cache so far, and does ~2 FLOPs per weight, far below the cores' FLOP rate. So
`read bandwidth / bytes per step` bounds decode tokens/s, and an engine's share of that bound says how much
is left to win. The bandwidth is measured in the same run, because this machine is shared and noisy; the
report takes the fastest sample (other processes only ever slow a sample down).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from engine.config import ModelConfig


@dataclass(frozen=True)
class Spread:
    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(min(values), statistics.median(values), max(values))


def measure_read_bandwidth(num_bytes: int, repeats: int = 11) -> Spread:
    """Bytes/s of `torch.sum` over a float32 tensor of `num_bytes` (one untimed pass first).

    Sized well past the last-level cache this is DRAM bandwidth; sized like a small model's weights it is
    the cache bandwidth that model actually sees.
    """
    # distinct values on every page: a VM host may merge identical pages (KSM), and a tensor of ones read as one
    # cached page once measured 60 GB/s on a 31 GB/s machine (benchmarks/RESULTS.md, 2026-11-28)
    x = torch.rand(num_bytes // 4, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    x.sum()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        rates.append(x.numel() * 4 / (time.perf_counter() - t0))
    return Spread.of(rates)


def weight_bytes_per_decode_step(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Every weight a decode step reads: the layers, the final norm and the lm_head (the embedding
    matrix itself when tied); an untied embedding contributes one row per token, ignored here."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if cfg.qkv_bias else 0)
    mlp = 3 * h * cfg.intermediate_size
    per_layer = attn + mlp + 2 * h  # + the two RMSNorm weights
    return (cfg.num_layers * per_layer + h + cfg.vocab_size * h) * dtype_bytes


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def decode_step_bytes(cfg: ModelConfig, dtype_bytes: int, context_tokens: int) -> int:
    """Bytes one batch-1 decode step must read at `context_tokens` of context."""
    return weight_bytes_per_decode_step(cfg, dtype_bytes) + context_tokens * kv_bytes_per_token(cfg, dtype_bytes)
