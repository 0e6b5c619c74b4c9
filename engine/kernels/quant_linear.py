"""`quantized_linear(x, w, bias)`: y = x @ dequantize(w).T + bias for a `QuantizedWeight`, by the fastest backend
this machine has. Every backend equals the twin, `quantized_linear_reference` (engine/quant_format.py), up to
fp32 summation order.

Backends, picked per call by device and row count (`quantized_linear_backend`):

    torch, few rows   `grouped_linear_torch`: per-group dot products on the raw q values, scaled afterwards
    torch, many rows  `dequantized_linear_torch`: the twin itself (dequantize the weight, one GEMM)
    C (CPU)           engine/kernels/cpu_native.py: `quantized_linear_native` (dequantizes in registers, or in
                      panels that stay in cache) up to NATIVE_MAX_ROWS[kind] rows, `dequantized_linear_native`
                      (one dequantize pass + GEMM) above
    Triton (CUDA)     engine/kernels/quant_linear_triton.py's `quantized_linear_triton` (GEMV or tiled GEMM)

No dequantized copy of a weight outlives a call: holding one would give back the memory quantization saves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.kernels import cpu_native
from engine.kernels.triton_jit import use_triton
from engine.quant_format import INT4_GROUP, QuantizedWeight, quantized_linear_reference

QuantizedLinearFn = Callable[[torch.Tensor, QuantizedWeight, torch.Tensor | None], torch.Tensor]

# Up to this many rows the grouped path wins: it never scales a whole weight, only rows x out x groups partial
# sums (1 row of SmolLM2's gate_up, 3072 x 576 int4: ~1.9 ms grouped vs ~16 ms dequantizing, 1 thread); past it
# those partial sums outgrow the weight and one dequantize + GEMM is cheaper.
GROUPED_MAX_ROWS = 8

# The C kernels (one-row passes, per-output-row loops, dequantized panels past a few rows) beat dequantizing the
# whole weight for torch's GEMM up to these row counts (benchmarks/quant_kernels_bench.py's crossover table,
# RESULTS.md, AVX-512: int8 gate_up / down even at 64 rows, int4 at 128; the 28 MB lm_head wins up to 512).
NATIVE_MAX_ROWS = {"int8": 64, "int4": 128}


def quantized_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] (fp32 / bf16 / fp16) times `w`'s weight, plus `bias`; fp32 accumulation, in x's dtype."""
    return quantized_linear_backend(x, w)(x, w, bias)


def quantized_linear_backend(x: torch.Tensor, w: QuantizedWeight) -> QuantizedLinearFn:
    """The function `quantized_linear` calls for this input (named, so tests and benchmarks can see the pick)."""
    if use_triton(x):  # CUDA: Triton kernels (engine/kernels/quant_linear_triton.py), GEMV or tiled GEMM by rows
        from engine.kernels.quant_linear_triton import quantized_linear_triton

        return quantized_linear_triton
    rows = x.numel() // max(x.shape[-1], 1)
    if cpu_native.quantized_native_applies(x, w):  # CPU with the C kernels built
        if rows <= NATIVE_MAX_ROWS[w.kind]:
            return cpu_native.quantized_linear_native
        return cpu_native.dequantized_linear_native
    if rows <= GROUPED_MAX_ROWS:
        return grouped_linear_torch
    return dequantized_linear_torch


class PreparedQuantizedLinear:
    """`quantized_linear(x, w, bias)` for one weight, with what can be settled once settled: on a CPU with the C
    kernels built, the weight bound to its kernel (`cpu_native.NativeQuantizedLinear`), so a few-row call costs the
    kernel and little else; other calls go through `quantized_linear_backend`. What QuantizedLinear holds.
    `int8_activations` (CPU kernel only, every row count there): x rounded to int8 per 32 inputs first."""

    def __init__(self, w: QuantizedWeight, bias: torch.Tensor | None = None, int8_activations: bool = False):
        self.weight, self.bias = w, bias
        self._pointers = _pointers((w.qweight, w.scales, w.mins, bias))
        probe = torch.empty(0, dtype=torch.float32, device=w.qweight.device)
        native = cpu_native.quantized_native_applies(probe, w)
        if int8_activations and not native:
            raise ValueError(f"int8 activations need the C kernels on a CPU weight: {w.kind} on {w.qweight.device}, "
                             f"kernels built: {cpu_native.native_library() is not None}")
        # int8 activations: the C kernel at any row count (there is no dequantize-and-GEMM twin of that rounding)
        self.native_max_rows = 1 << 62 if int8_activations else NATIVE_MAX_ROWS[w.kind]
        self.native = cpu_native.NativeQuantizedLinear(w, bias, int8_activations) if native else None

    def bound_to(self, tensors: tuple[torch.Tensor | None, ...]) -> bool:
        """Whether these (qweight, scales, mins, bias) are still the storage this was prepared over."""
        return _pointers(tensors) == self._pointers

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        native = self.native
        if native is not None and x.dtype in cpu_native.DTYPES and x.numel() <= self.native_max_rows * x.shape[-1]:
            return native(x)
        return quantized_linear_backend(x, self.weight)(x, self.weight, self.bias)


def _pointers(tensors: tuple[torch.Tensor | None, ...]) -> tuple[int, ...]:
    return tuple(0 if t is None else t.data_ptr() for t in tensors)


def dequantized_linear_torch(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The twin: the weight dequantized to fp32 for this call only, one GEMM."""
    return quantized_linear_reference(x, w, bias)


def grouped_linear_torch(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fast path for few rows: y[r, o] = sum_g scales[o, g] * (x[r, g] . q[o, g]) (+ mins[o, g] * sum x[r, g]).
    Same math as the twin with the scale applied per group sum instead of per weight, which saves two passes
    over the whole weight (differs from the twin by fp32 rounding only)."""
    out, in_features = w.out_features, w.in_features
    groups = in_features // w.group_size
    xg = x.reshape(-1, groups, w.group_size).float()
    if w.kind == "int8":
        q = w.qweight.reshape(out, groups, w.group_size).float()
    else:  # byte j of a group: input j low nibble, input j + 16 high nibble
        packed = w.qweight.reshape(out, groups, 1, INT4_GROUP // 2)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=2).float().reshape(out, groups, INT4_GROUP)
    partial = torch.einsum("rgk,ogk->rog", xg, q)  # [rows, out, groups]
    y = (partial * w.scales).sum(dim=-1)
    if w.mins is not None:
        y = y + F.linear(xg.sum(dim=-1), w.mins)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], out)
