"""Model configuration (`ModelConfig`, from config.json) and the torch side of engine settings (dtypes,
devices). `EngineConfig` lives in engine/engine_config.py, which imports no torch; it is re-exported here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.engine_config import DEVICES, DTYPE_ALIASES, EngineConfig, canonical_dtype
from engine.errors import ModelLoadError

__all__ = ["DEVICES", "DTYPE_ALIASES", "DTYPES", "EngineConfig", "ModelConfig", "parse_dtype", "resolve_device"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# model_type -> architecture, for a config.json without `architectures` (transformers' AutoModelForCausalLM
# picks the class by model_type the same way)
ARCHITECTURE_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """The engine's device for `EngineConfig.device`: "auto" is CUDA when torch sees a GPU, else CPU."""
    if name not in DEVICES:
        raise ValueError(f"device={name!r} is invalid: must be one of {', '.join(DEVICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' is invalid here: torch sees no CUDA device (use cpu or auto)")
    return torch.device(name)


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype a dtype name or alias (fp32, bf16, ...) means; ValueError naming the allowed ones."""
    return DTYPES[canonical_dtype(name)]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)  # rope_type + its parameters; {} is plain RoPE
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    dtype: str = "float32"  # the checkpoint's

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_path(cls, model_path: str | Path) -> ModelConfig:
        """The config of a model path: a GGUF file's metadata (engine/gguf_file.py) or a checkpoint
        directory's config.json."""
        from engine.gguf_file import is_gguf_path, open_gguf

        if is_gguf_path(model_path):
            return cls.from_dict(open_gguf(model_path).hf_config())
        return cls.from_dir(model_path)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path} not found: a model directory needs a Hugging Face config.json")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, hf: dict) -> ModelConfig:
        archs = hf.get("architectures") or []
        if archs:
            arch = archs[0]
            if arch not in SUPPORTED_ARCHITECTURES:
                allowed = ", ".join(SUPPORTED_ARCHITECTURES)
                raise ModelLoadError(f"architectures={archs!r} in config.json is not supported: allowed are {allowed}")
        else:
            model_type = hf.get("model_type")
            if model_type not in ARCHITECTURE_OF_MODEL_TYPE:
                allowed = ", ".join(ARCHITECTURE_OF_MODEL_TYPE)
                raise ModelLoadError(f"config.json has no architectures and model_type={model_type!r} is not "
                                     f"supported: allowed are {allowed}")
            arch = ARCHITECTURE_OF_MODEL_TYPE[model_type]
        try:
            hidden = int(hf["hidden_size"])
            num_heads = int(hf["num_attention_heads"])
            rope_theta, rope_scaling = _rope(hf)
            is_qwen2 = arch == "Qwen2ForCausalLM"
            sliding = hf.get("sliding_window") if (not is_qwen2 or hf.get("use_sliding_window")) else None
            dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
            return cls(
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=True if is_qwen2 else bool(hf.get("attention_bias", False)),
                o_bias=False if is_qwen2 else bool(hf.get("attention_bias", False)),
                mlp_bias=bool(hf.get("mlp_bias", False)),
                sliding_window=int(sliding) if sliding else None,
                dtype=dtype if dtype in DTYPES else "float32",
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks the field {e.args[0]!r}") from None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads={self.num_heads} must be a multiple of num_key_value_heads={self.num_kv_heads}"
            )


def _rope(hf: dict) -> tuple[float, dict]:
    """rope_theta and scaling from either config form: `rope_parameters` (transformers 5) or
    top-level `rope_theta` with an optional `rope_scaling` dict (older checkpoints)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", scaling.pop("rope_theta", 10000.0))))
    merged = {**scaling, **params}
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"rope_type={rope_type!r} is not supported: allowed are {', '.join(SUPPORTED_ROPE_TYPES)}")
    return theta, ({} if rope_type == "default" else {"rope_type": rope_type, **merged})
