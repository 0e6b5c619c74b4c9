"""What a checkpoint must hold for a model, tensor by tensor: one list per architecture family.

A `TensorSpec` says where a checkpoint tensor goes (a parameter of engine/model.py's plain model, at a
row offset when several checkpoint tensors are fused into one parameter), what shape the config implies,
and how tensor parallelism cuts it (`Split`). The loader (engine/weights.py) and the tensor-parallel
plan (engine/tensor_parallel.py) both read these specs; nothing else enumerates tensors.

Fused parameters of the Llama family, rows from top to bottom:

    qkv_proj      [ q: H*d | k: KV*d | v: KV*d ]        (bias too, when the config has one)
    gate_up_proj  [ gate: I | up: I ]
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from engine.config import ModelConfig


class Split(Enum):
    """How tensor parallelism cuts a tensor: whole on every rank, or a rank's range of rows (output
    features) or columns (input features) counted in query heads, kv heads, MLP units or vocabulary."""

    REPLICATED = "replicated"
    QUERY_HEAD_ROWS = "query_head_rows"  # q_proj
    KV_HEAD_ROWS = "kv_head_rows"  # k_proj, v_proj
    INTERMEDIATE_ROWS = "intermediate_rows"  # gate_proj, up_proj
    VOCAB_ROWS = "vocab_rows"  # embed_tokens, lm_head
    QUERY_HEAD_COLUMNS = "query_head_columns"  # o_proj (row-parallel: partial sums)
    INTERMEDIATE_COLUMNS = "intermediate_columns"  # down_proj (row-parallel: partial sums)

    @property
    def dim(self) -> int | None:
        """The dimension cut (0 rows, 1 columns); None for a replicated tensor."""
        if self is Split.REPLICATED:
            return None
        return 1 if self in (Split.QUERY_HEAD_COLUMNS, Split.INTERMEDIATE_COLUMNS) else 0


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its name, the parameter it lands in (rows [row_offset, row_offset +
    shape[0]) of it), the shape the config implies (whole, before any sharding) and its `Split`."""

    checkpoint_name: str
    param_name: str
    shape: tuple[int, ...]
    split: Split
    row_offset: int = 0


@dataclass(frozen=True)
class TensorSpecs:
    """Every tensor a checkpoint must hold for one config, in fused-row order within each parameter, and
    the names it may hold besides, which loading skips (e.g. lm_head.weight with tied embeddings)."""

    specs: tuple[TensorSpec, ...]
    skipped: re.Pattern

    def is_skipped(self, name: str) -> bool:
        return self.skipped.fullmatch(name) is not None


# Buffers older exports saved, which the model recomputes.
_ROTARY_BUFFERS = r".*rotary_emb\.inv_freq"


def tensor_specs(config: ModelConfig) -> TensorSpecs:
    """The specs for `config`'s architecture (every supported one is a Llama-family decoder today)."""
    return llama_specs(config)


def llama_specs(config: ModelConfig) -> TensorSpecs:
    """Llama, Mistral and Qwen2 checkpoints in Hugging Face names: optional q/k/v, o and MLP biases,
    optionally tied embeddings (then the checkpoint may still hold an lm_head.weight, which is skipped)."""
    c = config
    hidden, d, inter = c.hidden_size, c.head_dim, c.intermediate_size
    q_rows, kv_rows = c.num_heads * d, c.num_kv_heads * d
    specs: list[TensorSpec] = []

    def add(checkpoint: str, param: str, shape: tuple[int, ...], split: Split, row_offset: int = 0) -> None:
        specs.append(TensorSpec(checkpoint, param, shape, split, row_offset))

    add("model.embed_tokens.weight", "embed_tokens.weight", (c.vocab_size, hidden), Split.VOCAB_ROWS)
    add("model.norm.weight", "norm.weight", (hidden,), Split.REPLICATED)
    if not c.tie_word_embeddings:
        add("lm_head.weight", "lm_head.weight", (c.vocab_size, hidden), Split.VOCAB_ROWS)
    for i in range(c.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        for kind in ["weight"] + (["bias"] if c.qkv_bias else []):
            cols = (hidden,) if kind == "weight" else ()
            qkv = f"{ours}.self_attn.qkv_proj.{kind}"
            add(f"{hf}.self_attn.q_proj.{kind}", qkv, (q_rows, *cols), Split.QUERY_HEAD_ROWS, 0)
            add(f"{hf}.self_attn.k_proj.{kind}", qkv, (kv_rows, *cols), Split.KV_HEAD_ROWS, q_rows)
            add(f"{hf}.self_attn.v_proj.{kind}", qkv, (kv_rows, *cols), Split.KV_HEAD_ROWS, q_rows + kv_rows)
        add(f"{hf}.self_attn.o_proj.weight", f"{ours}.self_attn.o_proj.weight", (hidden, q_rows),
            Split.QUERY_HEAD_COLUMNS)
        if c.o_bias:  # added once, after the all-reduce: whole on every rank
            add(f"{hf}.self_attn.o_proj.bias", f"{ours}.self_attn.o_proj.bias", (hidden,), Split.REPLICATED)
        for kind in ["weight"] + (["bias"] if c.mlp_bias else []):
            cols = (hidden,) if kind == "weight" else ()
            gate_up = f"{ours}.mlp.gate_up_proj.{kind}"
            add(f"{hf}.mlp.gate_proj.{kind}", gate_up, (inter, *cols), Split.INTERMEDIATE_ROWS, 0)
            add(f"{hf}.mlp.up_proj.{kind}", gate_up, (inter, *cols), Split.INTERMEDIATE_ROWS, inter)
        add(f"{hf}.mlp.down_proj.weight", f"{ours}.mlp.down_proj.weight", (hidden, inter),
            Split.INTERMEDIATE_COLUMNS)
        if c.mlp_bias:
            add(f"{hf}.mlp.down_proj.bias", f"{ours}.mlp.down_proj.bias", (hidden,), Split.REPLICATED)
        add(f"{hf}.input_layernorm.weight", f"{ours}.input_layernorm.weight", (hidden,), Split.REPLICATED)
        add(f"{hf}.post_attention_layernorm.weight", f"{ours}.post_attention_layernorm.weight", (hidden,),
            Split.REPLICATED)
    skipped = _ROTARY_BUFFERS + (r"|lm_head\.weight" if c.tie_word_embeddings else "")
    return TensorSpecs(tuple(specs), re.compile(skipped))
