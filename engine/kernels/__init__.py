"""Kernels of the model's hot path: a Triton kernel, a C kernel for CPU, and their torch twin for each,
and a dispatcher.

The dispatchers (the names without a suffix) run the Triton launcher (`*_triton`) on CUDA tensors when
triton is importable, the C kernel (`*_native`, engine/kernels/cpu_native.py) on CPU tensors when it
could be built, and the torch twin (`*_torch`) otherwise. Each twin is the code the model ran before the
kernels existed, and is their test reference (tests/test_kernels.py, Triton under TRITON_INTERPRET=1 on
CPU; tests/test_cpu_kernels.py).
"""

from engine.kernels.activation import silu_and_mul, silu_and_mul_torch
from engine.kernels.cpu_native import native_library, use_native
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
    "native_library",
    "prefix_attention",
    "prefix_attention_torch",
    "prefix_attention_triton",
    "rms_norm",
    "rms_norm_torch",
    "rms_norm_triton",
    "silu_and_mul",
    "silu_and_mul_torch",
    "triton_available",
    "use_native",
    "use_triton",
]
