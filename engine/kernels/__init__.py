"""Kernels of the model's hot path: a Triton kernel and its torch twin for each, and a dispatcher.

The dispatchers (the names without a suffix) run the Triton launcher (`*_triton`) on CUDA tensors when
triton is importable and the torch twin (`*_torch`) otherwise, so the CPU path is always the twin. Each
twin is the code the model ran before the kernel existed, and is the kernel's test reference
(tests/test_kernels.py, under TRITON_INTERPRET=1 on CPU).
"""

from engine.kernels.decode_attention import decode_attention, decode_attention_torch, decode_attention_triton
from engine.kernels.prefix_attention import prefix_attention, prefix_attention_torch, prefix_attention_triton
from engine.kernels.rmsnorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_torch,
    fused_add_rms_norm_triton,
    rms_norm,
    rms_norm_torch,
    rms_norm_triton,
)
from engine.kernels.rotary import apply_rotary, apply_rotary_torch, apply_rotary_triton
from engine.kernels.triton_jit import triton_available, use_triton

__all__ = [
    "apply_rotary",
    "apply_rotary_torch",
    "apply_rotary_triton",
    "decode_attention",
    "decode_attention_torch",
    "decode_attention_triton",
    "fused_add_rms_norm",
    "fused_add_rms_norm_torch",
    "fused_add_rms_norm_triton",
    "prefix_attention",
    "prefix_attention_torch",
    "prefix_attention_triton",
    "rms_norm",
    "rms_norm_torch",
    "rms_norm_triton",
    "triton_available",
    "use_triton",
]
