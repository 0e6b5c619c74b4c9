"""Tensor parallelism as a transformation of the plain model, and loading only this rank's shard.

Rank r of N holds (H query heads, KV kv heads, I intermediate, V vocabulary):

    qkv_proj    output rows of its H/N query heads and of its kv heads: KV/N of them, or, when N > KV,
                the one kv head its query heads share (replicated on N/KV ranks)
    o_proj      the input columns of its query heads   ─▶ partial sums: ONE all-reduce
    gate_up     output rows [r*I/N, (r+1)*I/N) of gate and of up
    down_proj   the matching input columns             ─▶ partial sums: ONE all-reduce
    embedding   vocabulary rows [r*V/N, (r+1)*V/N): other ids look up zeros, then an all-reduce
    lm_head     the same vocabulary rows (tied: the same tensor): local logits, all-gathered
    norms       whole (replicated)

The model code is unchanged: a rank builds the plain model from a *local* config (its head counts and
intermediate size), then `parallelize` swaps in the row-parallel and vocabulary-parallel layers, whose
forward is the only place a collective appears. What a rank loads is a slice of each tensor spec
(`Shard.slice_of`, from the spec's `Split`); engine/weights.py's one loader reads only that slice
(engine/weights.build_model(..., tp=...) builds a rank's model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.model import LlamaForCausalLM
from engine.tensor_source import TensorSlice
from engine.tensor_specs import Split, TensorSpec


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    group: object = None  # torch.distributed ProcessGroup (None: the default group)


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds of a model."""

    rank: int
    size: int
    q_heads: tuple[int, int]  # [start, end) of query heads
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    head_dim: int

    def slice_of(self, spec: TensorSpec) -> TensorSlice | None:
        """This rank's part of the checkpoint tensor `spec` names; None: all of it (replicated)."""
        if spec.split is Split.REPLICATED:
            return None
        if spec.split in (Split.QUERY_HEAD_ROWS, Split.QUERY_HEAD_COLUMNS):
            start, end = (h * self.head_dim for h in self.q_heads)
        elif spec.split is Split.KV_HEAD_ROWS:
            start, end = (h * self.head_dim for h in self.kv_heads)
        elif spec.split in (Split.INTERMEDIATE_ROWS, Split.INTERMEDIATE_COLUMNS):
            start, end = self.intermediate
        else:
            assert spec.split is Split.VOCAB_ROWS, spec.split
            start, end = self.vocab
        return TensorSlice(spec.split.dim, start, end)


def plan_shard(config: ModelConfig, rank: int, size: int) -> Shard:
    """Which heads, MLP rows and vocabulary rows a rank holds; raises ValueError if `size` does not divide."""
    h, kv, inter, vocab = config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size
    for name, value in (("num_attention_heads", h), ("intermediate_size", inter), ("vocab_size", vocab)):
        if value % size:
            raise ValueError(f"tp={size} is invalid for this model: {name}={value} is not a multiple of it")
    if kv >= size and kv % size:
        raise ValueError(f"tp={size} is invalid for this model: num_key_value_heads={kv} is not a multiple of it")
    if kv < size and size % kv:
        raise ValueError(f"tp={size} is invalid for this model: it must be a multiple of num_key_value_heads={kv} "
                         "when larger (kv heads are then replicated)")
    q_per = h // size
    if kv >= size:
        kv_per = kv // size
        kv_range = (rank * kv_per, (rank + 1) * kv_per)
    else:
        head = rank // (size // kv)  # the kv head this rank's query heads attend with
        kv_range = (head, head + 1)
    i_per, v_per = inter // size, vocab // size
    return Shard(rank, size, (rank * q_per, (rank + 1) * q_per), kv_range, (rank * i_per, (rank + 1) * i_per),
                 (rank * v_per, (rank + 1) * v_per), config.head_dim)


def local_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The config a rank's model is built from: its own head counts and MLP width (vocab stays whole)."""
    return dataclasses.replace(
        config,
        num_heads=shard.q_heads[1] - shard.q_heads[0],
        num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0],
        intermediate_size=shard.intermediate[1] - shard.intermediate[0],
    )


class RowParallelLinear(nn.Linear):
    """x[..., local in] @ W[:, local in].T summed over ranks; the bias is added once, after the sum.

    `local_gemm`, when set (engine/linear_fast.py's `fast_linears` does on CPU), computes the local product
    instead of `F.linear` on the weight; the all-reduce and the bias stay here.
    """

    def __init__(self, in_local: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__(in_local, out_features, bias)
        self.tp = tp
        self.local_gemm: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight) if self.local_gemm is None else self.local_gemm(x)
        dist.all_reduce(y, group=self.tp.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding table; ids outside look up zeros; the ranks' results are summed."""

    def __init__(self, start: int, end: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.start, self.end, self.tp = start, end, tp
        self.weight = nn.Parameter(torch.empty(end - start, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        out = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.tp.group)
        return out


def parallelize(model: LlamaForCausalLM, full: ModelConfig, shard: Shard, tp: TPGroup) -> LlamaForCausalLM:
    """Swap in the row-parallel and vocabulary-parallel layers (call on a model built from `local_config`)."""
    cfg = model.config
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp)
        mlp.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp)
    model.embed_tokens = VocabParallelEmbedding(*shard.vocab, cfg.hidden_size, tp)
    if model.lm_head is not None:
        model.lm_head = nn.Linear(cfg.hidden_size, shard.vocab[1] - shard.vocab[0], bias=False)

    def gather_vocab(local_logits: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(local_logits) for _ in range(tp.size)]
        dist.all_gather(parts, local_logits.contiguous(), group=tp.group)
        return torch.cat(parts, dim=-1)

    model.gather_vocab = gather_vocab
    return model
