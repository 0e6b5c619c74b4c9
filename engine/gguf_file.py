"""A GGUF checkpoint file (llama.cpp's format): its metadata as a Hugging Face config, and its tensors.

A GGUF file is a whole checkpoint in one file: weights (often block-quantized), the model's settings
and the tokenizer, all under llama.cpp's names. `GGUFFile` opens one and answers in the terms the rest
of the engine uses: `hf_config()` is the config.json a Hugging Face checkpoint of the same model would
have (so `ModelConfig.from_dict` validates both formats alike), `GGUFSource` (engine/gguf_source.py)
serves its tensors under Hugging Face names, and `Tokenizer.from_gguf` (engine/tokenizer.py) builds the
tokenizer from its metadata.

Supported: general.architecture llama (Llama, SmolLM2, Mistral) and qwen2; every tensor type the `gguf`
package can dequantize.
"""

from __future__ import annotations

from functools import cache, lru_cache
from pathlib import Path

import numpy as np

from engine.errors import ModelLoadError

# general.architecture -> the Hugging Face architecture whose tensors and config it holds
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def is_gguf_path(path: str | Path) -> bool:
    """Whether a model path names a GGUF file rather than a Hugging Face checkpoint directory: any existing
    file (a checkpoint is a directory, so a file can only be meant as GGUF), or a missing path named .gguf."""
    path = Path(path)
    return path.is_file() or (path.suffix.lower() == ".gguf" and not path.is_dir())


def open_gguf(path: str | Path) -> GGUFFile:
    """The opened `GGUFFile` at `path`, shared by every caller in this process while the file is unchanged.

    Why shared: loading asks for the config, the tokenizer's special ids and the tensors separately, and
    `gguf.GGUFReader` parses every metadata array (a 49k-token vocabulary and its merges) when it opens a
    file, which takes seconds; once is enough. Raises ModelLoadError as `GGUFFile` does (never cached)."""
    path = Path(path)
    if not path.is_file():
        return GGUFFile(path)  # raises "not found"
    stat = path.stat()
    return _open_unchanged(path.resolve(), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=2)
def _open_unchanged(path: Path, size_bytes: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)  # size and mtime are part of the key: a rewritten file is opened afresh


@cache
def supported_tensor_types() -> tuple[str, ...]:
    """Names of the GGML tensor types the installed `gguf` package dequantizes (found by asking it to
    dequantize one zero block of each: its own routines are the only block decoders used)."""
    import gguf

    names = []
    for qtype, (_, type_bytes) in gguf.GGML_QUANT_SIZES.items():
        try:
            gguf.quants.dequantize(np.zeros((1, type_bytes), np.uint8), qtype)
        except NotImplementedError:
            continue
        names.append(qtype.name)
    return tuple(names)


@cache
def _plain_array_reader() -> type:
    import gguf  # imported on first use, as everywhere in this module

    class PlainArrayReader(gguf.GGUFReader):
        """`gguf.GGUFReader` over a plain ndarray view of its memory map. Why: opening a file makes ~1M views of
        `data` (every string of the vocabulary and merges), and each view of an `np.memmap` runs memmap's Python
        `__getitem__` and `__array_finalize__`: 4.4 s for SmolLM2 on a 2-core guest, 1.0 s over the plain view
        of the same mapping (which keeps the map alive as its base)."""

        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, mapped: np.ndarray) -> None:  # the reader's constructor assigns its np.memmap here
            self._plain_data = mapped.view(np.ndarray)

    return PlainArrayReader


class GGUFFile:
    """One GGUF file, opened (memory-mapped) and checked: readable, a supported architecture, tensors of
    supported types. Raises ModelLoadError naming the file, the field and what is supported. Read-only
    once built (`open_gguf` shares one per file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path} not found: a model path is a Hugging Face checkpoint directory "
                                 "or a .gguf file")
        try:
            self.reader = _plain_array_reader()(self.path)
        except Exception as e:  # the reader fails with ValueError, IndexError, ... on bad or truncated files
            raise ModelLoadError(f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e}): "
                                 "truncated, or not GGUF at all") from None
        self.architecture = self.string("general.architecture")
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ModelLoadError(f"{self.path}: general.architecture={self.architecture!r} is not supported: "
                                 f"allowed are {', '.join(GGUF_ARCHITECTURES)}")
        allowed = supported_tensor_types()
        for tensor in self.reader.tensors:
            if tensor.tensor_type.name not in allowed:
                raise ModelLoadError(f"{self.path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which "
                                     f"cannot be dequantized: supported types are {', '.join(allowed)}")

    def has(self, key: str) -> bool:
        return self.reader.get_field(key) is not None

    def value(self, key: str) -> object:
        """A metadata field's value (a number, a string, or a list); ModelLoadError if the file lacks it."""
        field = self.reader.get_field(key)
        if field is None:
            raise ModelLoadError(f"{self.path} lacks the metadata field {key}")
        return field.contents()

    def string(self, key: str) -> str:
        value = self.value(key)
        if not isinstance(value, str):
            raise ModelLoadError(f"{self.path}: metadata field {key}={value!r} must be a string")
        return value

    def number(self, key: str) -> float:
        value = self.value(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelLoadError(f"{self.path}: metadata field {key}={value!r} must be a number")
        return value

    def tensor_shape(self, gguf_name: str) -> tuple[int, ...] | None:
        """A tensor's shape in PyTorch order (GGUF lists dimensions innermost first); None if absent."""
        for tensor in self.reader.tensors:
            if tensor.name == gguf_name:
                return tuple(int(n) for n in reversed(tensor.shape.tolist()))
        return None

    def hf_config(self) -> dict:
        """The Hugging Face config.json this file's metadata amounts to: sizes from `{arch}.*`, the vocabulary
        from the embedding's rows, tied embeddings when there is no `output.weight`, RoPE scaling if given.
        The weights are dequantized to float32, so that is the checkpoint's dtype."""
        arch = self.architecture
        embedding = self.tensor_shape("token_embd.weight")
        if embedding is None:
            raise ModelLoadError(f"{self.path} has no token_embd.weight tensor")
        hidden = int(self.number(f"{arch}.embedding_length"))
        num_heads = int(self.number(f"{arch}.attention.head_count"))
        config = {
            "architectures": [GGUF_ARCHITECTURES[arch]],
            "vocab_size": embedding[0],
            "hidden_size": hidden,
            "intermediate_size": int(self.number(f"{arch}.feed_forward_length")),
            "num_hidden_layers": int(self.number(f"{arch}.block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(self.number(f"{arch}.attention.head_count_kv"))
            if self.has(f"{arch}.attention.head_count_kv") else num_heads,
            "head_dim": int(self.number(f"{arch}.attention.key_length"))
            if self.has(f"{arch}.attention.key_length") else hidden // num_heads,
            "rms_norm_eps": float(self.number(f"{arch}.attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": int(self.number(f"{arch}.context_length")),
            "rope_theta": float(self.number(f"{arch}.rope.freq_base")) if self.has(f"{arch}.rope.freq_base")
            else 10000.0,
            "tie_word_embeddings": self.tensor_shape("output.weight") is None,
            "dtype": "float32",
        }
        scaling = self._rope_scaling()
        if scaling:
            config["rope_scaling"] = scaling
        return config

    def _rope_scaling(self) -> dict:
        """`{arch}.rope.scaling.*` as a Hugging Face rope_scaling dict ({} when absent or "none"); a type
        the engine does not implement is passed on, and `ModelConfig` refuses it by name."""
        key = f"{self.architecture}.rope.scaling"
        if not self.has(f"{key}.type"):
            return {}
        rope_type = self.string(f"{key}.type")
        if rope_type == "none":
            return {}
        scaling: dict = {"rope_type": rope_type}
        if self.has(f"{key}.factor"):
            scaling["factor"] = float(self.number(f"{key}.factor"))
        if self.has(f"{key}.original_context_length"):
            scaling["original_max_position_embeddings"] = int(self.number(f"{key}.original_context_length"))
        return scaling
