"""`GGUFSource`: a GGUF file's tensors as a `TensorSource`, under Hugging Face names and shapes.

llama.cpp names tensors `token_embd`, `blk.N.attn_q`, ... and lists dimensions innermost first; this
source presents them as `model.embed_tokens.weight`, `model.layers.N.self_attn.q_proj.weight`, ... in
PyTorch order, so the one loader (engine/weights.py) checks and loads them against the same specs
(engine/tensor_specs.py) as a safetensors checkpoint.

`read` dequantizes quantized tensors to float32 by the `gguf` package's own routines; `read_quantized` hands
a Q4_0 / Q4_1 / Q8_0 tensor over as it is stored, repacked into duet's layout (engine/gguf_blocks.py), for
quantization="auto" (engine/quantization.py).

llama.cpp's converter reorders the rows of a llama model's Q and K projections (its RoPE kernel pairs adjacent
dimensions; Hugging Face's pairs the two halves of each head); reading undoes that, as transformers' GGUF
loader does. qwen2 files are converted without the reordering.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from engine.errors import ModelLoadError
from engine.gguf_blocks import KEPT_BLOCK_BYTES, repack_gguf_blocks
from engine.gguf_file import GGUFFile, open_gguf
from engine.quant_format import QuantizedWeight
from engine.tensor_source import TensorSlice

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {  # blk.N.<key> -> model.layers.N.<value>
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_PERMUTED_ARCHITECTURES = ("llama",)  # whose converter reorders Q/K rows


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor name; a name with no counterpart is returned as is (the
    loader then refuses it as a tensor the config has no place for)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, key, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[key]}.{kind}"
    return gguf_name


def unpermute_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order for `num_heads` heads: within each head its converter interleaved the
    rows of the two rotary halves (row 2i from the first half, 2i+1 from the second); this puts each half
    back together. Works on weights (rows x columns) and biases (rows)."""
    rows = tensor.shape[0]
    half = rows // num_heads // 2
    return tensor.reshape(num_heads, half, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


class GGUFSource:
    """A GGUF file's tensors (see the module docstring). `read` returns float32 for quantized and F32
    tensors and float16 for F16 ones; a slice is cut after dequantizing the whole tensor (quantization
    blocks run along rows, so a column range cannot be decoded alone)."""

    def __init__(self, file: GGUFFile):
        self.origin = str(file.path)
        self._file = file
        self._tensors = {}
        for tensor in file.reader.tensors:
            if tensor.name == "rope_freqs.weight":  # llama 3's frequency factors
                raise ModelLoadError(f"{file.path}: tensor rope_freqs.weight (llama3 RoPE frequency factors) is "
                                     "not supported: only plain and linear-scaled RoPE GGUF files load")
            self._tensors[hf_name(tensor.name)] = tensor
        num_heads = int(file.number(f"{file.architecture}.attention.head_count"))
        kv_key = f"{file.architecture}.attention.head_count_kv"
        num_kv_heads = int(file.number(kv_key)) if file.has(kv_key) else num_heads
        permuted = file.architecture in _PERMUTED_ARCHITECTURES
        self._permuted_heads = {".self_attn.q_proj.": num_heads, ".self_attn.k_proj.": num_kv_heads} if permuted \
            else {}

    @classmethod
    def from_path(cls, path: str) -> GGUFSource:
        return cls(open_gguf(path))

    def names(self) -> list[str]:
        return list(self._tensors)  # the file's order

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))

    def location(self, name: str) -> str:
        return f"{self._file.path.name} ({self._tensors[name].name})"

    def read(self, name: str, part: TensorSlice | None = None) -> torch.Tensor:
        import gguf

        tensor = self._tensors[name]
        if tensor.tensor_type == gguf.GGMLQuantizationType.F16:
            values = np.array(tensor.data, dtype=np.float16)
        else:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if not values.flags.writeable:  # an F32 tensor is a view of the read-only memory map: copy it out
            values = values.copy()
        out = torch.from_numpy(np.ascontiguousarray(values)).reshape(self.shape(name))
        for marker, heads in self._permuted_heads.items():
            if marker in name:
                out = unpermute_rows(out, heads)
        if part is None:
            return out.contiguous()
        return out.narrow(part.dim, part.start, part.end - part.start).contiguous()

    def stored_type(self, name: str) -> str:
        """The GGML type the file stores the tensor in ("Q4_1", "Q8_0", "F32", "Q6_K", ...)."""
        return self._tensors[name].tensor_type.name

    def read_quantized(self, name: str) -> QuantizedWeight | None:
        """The whole 2-D tensor as stored, repacked (engine/gguf_blocks.py), in Hugging Face row order; None when
        its type is not one duet keeps (KEPT_BLOCK_BYTES): `read` dequantizes those. Rows are independent, so
        llama's Q/K row order is undone by permuting qweight, scales and mins rows alike."""
        type_name = self.stored_type(name)
        shape = self.shape(name)
        if type_name not in KEPT_BLOCK_BYTES or len(shape) != 2:
            return None
        w = repack_gguf_blocks(np.asarray(self._tensors[name].data), type_name, shape[1])
        for marker, heads in self._permuted_heads.items():
            if marker in name:
                w = QuantizedWeight(w.kind, unpermute_rows(w.qweight, heads).contiguous(),
                                    unpermute_rows(w.scales, heads).contiguous(),
                                    None if w.mins is None else unpermute_rows(w.mins, heads).contiguous(),
                                    w.group_size)
        return w

    def close(self) -> None:
        self._tensors = {}  # the reader (and its memory map) is open_gguf's to keep or drop

    def __enter__(self) -> GGUFSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
