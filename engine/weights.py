"""Load Hugging Face safetensors checkpoints (one file or shards with an index) into the model.

Every tensor the config implies must be present with its exact shape, and every tensor present must
be one the model has: a mismatch is a `ModelLoadError` naming the tensor, so a wrong checkpoint never
loads as silent garbage. q/k/v and gate/up land in slices of the fused parameters.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.model import LlamaForCausalLM

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"shards listed in {index} are missing: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def _targets(model: LlamaForCausalLM) -> dict[str, tuple[torch.Tensor, int]]:
    """Checkpoint name -> (destination tensor view, row offset) for every tensor the model needs."""
    cfg = model.config
    params = dict(model.named_parameters())
    targets: dict[str, tuple[torch.Tensor, int]] = {}

    def add(hf_name: str, param_name: str, start: int = 0, rows: int | None = None) -> None:
        param = params[param_name].data
        rows = param.shape[0] - start if rows is None else rows
        targets[hf_name] = (param[start : start + rows], start)

    add("model.embed_tokens.weight", "embed_tokens.weight")
    add("model.norm.weight", "norm.weight")
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", "lm_head.weight")
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        kinds = ["weight"] + (["bias"] if cfg.qkv_bias else [])
        for kind in kinds:
            add(f"{hf}.self_attn.q_proj.{kind}", f"{ours}.self_attn.qkv_proj.{kind}", 0, q)
            add(f"{hf}.self_attn.k_proj.{kind}", f"{ours}.self_attn.qkv_proj.{kind}", q, kv)
            add(f"{hf}.self_attn.v_proj.{kind}", f"{ours}.self_attn.qkv_proj.{kind}", q + kv, kv)
        for kind in ["weight"] + (["bias"] if cfg.o_bias else []):
            add(f"{hf}.self_attn.o_proj.{kind}", f"{ours}.self_attn.o_proj.{kind}")
        for kind in ["weight"] + (["bias"] if cfg.mlp_bias else []):
            add(f"{hf}.mlp.gate_proj.{kind}", f"{ours}.mlp.gate_up_proj.{kind}", 0, inter)
            add(f"{hf}.mlp.up_proj.{kind}", f"{ours}.mlp.gate_up_proj.{kind}", inter, inter)
            add(f"{hf}.mlp.down_proj.{kind}", f"{ours}.mlp.down_proj.{kind}")
        add(f"{hf}.input_layernorm.weight", f"{ours}.input_layernorm.weight")
        add(f"{hf}.post_attention_layernorm.weight", f"{ours}.post_attention_layernorm.weight")
    return targets


def load_weights(model: LlamaForCausalLM, model_dir: str | Path) -> None:
    """Copy every checkpoint tensor into its place, converting to the model's dtype."""
    model_dir = Path(model_dir)
    targets = _targets(model)
    loaded: set[str] = set()
    tied = model.config.tie_word_embeddings
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if _IGNORED.match(name) or (tied and name == "lm_head.weight"):
                    continue
                if name not in targets:
                    raise ModelLoadError(f"unexpected tensor {name} in {path.name}: the config has no place for it")
                dest, _ = targets[name]
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ModelLoadError(
                        f"tensor {name} in {path.name} has shape {tuple(tensor.shape)}, "
                        f"but config.json implies {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                loaded.add(name)
    missing = sorted(set(targets) - loaded, key=_natural_key)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(f"checkpoint {model_dir} is missing tensors: {', '.join(missing[:5])}{more}")


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def build_model(config: ModelConfig, model_dir: str | Path, dtype: torch.dtype, max_positions: int,
                device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """Make the model on `device` without initializing weights (they are all loaded), then load them."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions).to(dtype)
    model.to_empty(device=device)
    model.rotary.to(device)  # a plain attribute, not a buffer: built on CPU in the constructor
    with torch.no_grad():
        load_weights(model, model_dir)
    return model.eval().requires_grad_(False)
