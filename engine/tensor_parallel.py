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
forward is the only place a collective appears. Each rank reads only its slices of the checkpoint
(safetensors slices, no full tensor in memory).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.model import LlamaForCausalLM
from engine.weights import _IGNORED, checkpoint_files


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
                 (rank * v_per, (rank + 1) * v_per))


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


def _shard_specs(full: ModelConfig, shard: Shard, model: LlamaForCausalLM) -> dict[str, tuple]:
    """Checkpoint name -> (destination tensor, source dim, source [start, end)); dim None means whole."""
    params = dict(model.named_parameters())
    d = full.head_dim
    q0, q1 = (s * d for s in shard.q_heads)
    k0, k1 = (s * d for s in shard.kv_heads)
    i0, i1 = shard.intermediate
    v0, v1 = shard.vocab
    lq, lkv, li = q1 - q0, k1 - k0, i1 - i0
    specs: dict[str, tuple] = {}

    Range = tuple[int, int]

    def add(hf: str, ours: str, dim: int | None, src: Range | None = None, rows: Range | None = None) -> None:
        dest = params[ours].data
        if rows is not None:
            dest = dest[rows[0] : rows[1]]
        specs[hf] = (dest, dim, src)

    add("model.embed_tokens.weight", "embed_tokens.weight", 0, (v0, v1))
    add("model.norm.weight", "norm.weight", None)
    if not full.tie_word_embeddings:
        add("lm_head.weight", "lm_head.weight", 0, (v0, v1))
    for i in range(full.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        for kind in ["weight"] + (["bias"] if full.qkv_bias else []):
            add(f"{hf}.self_attn.q_proj.{kind}", f"{ours}.self_attn.qkv_proj.{kind}", 0, (q0, q1), (0, lq))
            add(f"{hf}.self_attn.k_proj.{kind}", f"{ours}.self_attn.qkv_proj.{kind}", 0, (k0, k1), (lq, lq + lkv))
            add(f"{hf}.self_attn.v_proj.{kind}", f"{ours}.self_attn.qkv_proj.{kind}", 0, (k0, k1),
                (lq + lkv, lq + 2 * lkv))
        add(f"{hf}.self_attn.o_proj.weight", f"{ours}.self_attn.o_proj.weight", 1, (q0, q1))
        if full.o_bias:
            add(f"{hf}.self_attn.o_proj.bias", f"{ours}.self_attn.o_proj.bias", None)
        for kind in ["weight"] + (["bias"] if full.mlp_bias else []):
            add(f"{hf}.mlp.gate_proj.{kind}", f"{ours}.mlp.gate_up_proj.{kind}", 0, (i0, i1), (0, li))
            add(f"{hf}.mlp.up_proj.{kind}", f"{ours}.mlp.gate_up_proj.{kind}", 0, (i0, i1), (li, 2 * li))
        add(f"{hf}.mlp.down_proj.weight", f"{ours}.mlp.down_proj.weight", 1, (i0, i1))
        if full.mlp_bias:
            add(f"{hf}.mlp.down_proj.bias", f"{ours}.mlp.down_proj.bias", None)
        add(f"{hf}.input_layernorm.weight", f"{ours}.input_layernorm.weight", None)
        add(f"{hf}.post_attention_layernorm.weight", f"{ours}.post_attention_layernorm.weight", None)
    return specs


def load_shard(model: LlamaForCausalLM, model_dir: str | Path, full: ModelConfig, shard: Shard) -> None:
    """Copy this rank's slice of every checkpoint tensor into place (reading only that slice)."""
    specs = _shard_specs(full, shard, model)
    loaded: set[str] = set()
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if _IGNORED.match(name) or (full.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                if name not in specs:
                    raise ModelLoadError(f"unexpected tensor {name} in {path.name}: the config has no place for it")
                dest, dim, src = specs[name]
                piece = f.get_slice(name)
                if dim is None:
                    tensor = piece[:]
                elif dim == 0:
                    tensor = piece[src[0] : src[1]]
                else:
                    tensor = piece[:, src[0] : src[1]]
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ModelLoadError(f"tensor {name} in {path.name} has shape {tuple(piece.get_shape())}, which "
                                         f"does not fit rank {shard.rank}/{shard.size}'s {tuple(dest.shape)} slice")
                dest.copy_(tensor)
                loaded.add(name)
    missing = sorted(set(specs) - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint {model_dir} is missing tensors: {', '.join(missing[:5])}")


def build_tp_model(full: ModelConfig, model_dir: str | Path, dtype: torch.dtype, max_positions: int,
                   tp: TPGroup, device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """This rank's model on `device`: the plain model from its local config, parallelized, loaded from its
    shard."""
    shard = plan_shard(full, tp.rank, tp.size)
    with torch.device("meta"):
        model = LlamaForCausalLM(local_config(full, shard), max_positions)
        parallelize(model, full, shard, tp)
        model = model.to(dtype)
    model.to_empty(device=device)
    model.rotary.to(device)  # a plain attribute, not a buffer: built on CPU in the constructor
    with torch.no_grad():
        load_shard(model, model_dir, full, shard)
    return model.eval().requires_grad_(False)
