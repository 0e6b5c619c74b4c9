"""Triton when it is installed, and which kernels run where.

Every kernel module here holds a Triton kernel, its launcher (`*_triton`), its torch twin (`*_torch`)
and a dispatcher that picks the Triton launcher for CUDA tensors when triton imports, the twin otherwise
(so the CPU path is the twin, always). Kernel modules use `from __future__ import annotations`, so
`BLOCK: tl.constexpr` stays a string (triton reads it as such) and they import without triton.

Triton reads TRITON_INTERPRET=1 (run kernels on CPU tensors in its interpreter) when it is imported, so
the variable must be set before the first import of this module in a process.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the torch twins run
    triton = None
    tl = None


def triton_available() -> bool:
    return triton is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether the dispatchers run the Triton kernel for `x`: a CUDA tensor, and triton importable."""
    return x.is_cuda and triton is not None


class _Missing:
    """What `jit` gives when triton is not installed: importable, and says so if launched."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __getitem__(self, grid):
        raise RuntimeError(f"{self.fn.__name__}: triton is not installed; call the *_torch twin instead")


def jit(fn: Callable):
    """`triton.jit`, or a stand-in that raises at launch when triton is missing."""
    return triton.jit(fn) if triton is not None else _Missing(fn)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 dots in full precision (tl.dot would use TF32 on Ampere+, ~1e-3 off the twin); fp16/bf16 ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pipeline_stages(dtype: torch.dtype, stages: int) -> int:
    """Software-pipeline depth of an attention loop: `stages` for 2-byte dtypes; 1 for fp32, whose
    [64, 128] K and V tiles (32 KiB each) would overflow shared memory (164 KiB on A100) at depth 3."""
    return 1 if dtype == torch.float32 else stages
