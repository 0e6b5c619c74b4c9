"""Quantized weights in duet's layout, and their torch twins: the reference every kernel is tested against.

Weight-only quantization of a linear's weight W [out, in]: activations stay fp32 / bf16, accumulation is fp32.
Two kinds, each a `QuantizedWeight`:

    int8  qweight int8  [out, in]          value = scales[o, g] * q                  q in [-127, 127]
          scales  fp32  [out, in // group_size]                                      (-128: GGUF Q8_0 may hold it)
          group_size = in (one scale per output channel: round-to-nearest of a dense weight) or 32 (GGUF Q8_0)

    int4  qweight uint8 [out, in // 2]     value = scales[o, g] * q + mins[o, g]     q in [0, 15]
          scales  fp32  [out, in // 32]
          mins    fp32  [out, in // 32]
          group_size = 32; within a group (32 inputs, 16 bytes), byte j holds input j in its low nibble and
          input j + 16 in its high nibble:

              group g of row o:  qweight[o, 16g : 16g + 16]
              byte j:  [ q(32g + j + 16) : 4 bits | q(32g + j) : 4 bits ]     j = 0..15

          GGUF's own Q4 block order, so a kernel unpacks a group with one AND and one shift. GGUF Q4_1 (d * q + m)
          is scales = d, mins = m; Q4_0 (d * (q - 8)) is scales = d, mins = -8d (exact: fp16 d times a power of 2).

Exactness: GGUF scales are fp16, exact in fp32, so a GGUF tensor repacked here holds the very numbers the file
does (`dequantize` equals gguf's own dequantization bit for bit). Round-to-nearest of a dense weight:
int8 symmetric per output channel (scale = max|w| / 127); int4 asymmetric per group of 32 (scale =
(max - min) / 15, min = the group's minimum), so q = round((w - min) / scale).

Rows are independent (every group lies within one row), so concatenating the rows of two QuantizedWeights of
one kind and group size (fused q/k/v, gate/up) and slicing rows (tensor parallelism's column split) are exact;
a split along the input must fall on a group boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP = 32
Q8_0_GROUP = 32


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear's weight [out_features, in_features], quantized (see the module docstring for the layout)."""

    kind: str  # "int8" | "int4"
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None  # int4 only
    group_size: int

    def __post_init__(self) -> None:
        out, width = self.qweight.shape
        in_features = width * 2 if self.kind == "int4" else width
        assert self.kind in ("int8", "int4"), self.kind
        assert in_features % self.group_size == 0, (in_features, self.group_size)
        assert self.scales.dtype == torch.float32 and self.scales.shape == (out, in_features // self.group_size)
        if self.kind == "int8":
            assert self.qweight.dtype == torch.int8 and self.mins is None
        else:
            assert self.qweight.dtype == torch.uint8 and self.group_size == INT4_GROUP
            assert self.mins is not None and self.mins.shape == self.scales.shape and self.mins.dtype == torch.float32

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.kind == "int4" else 1)

    @property
    def nbytes(self) -> int:
        """Bytes a GEMV reads: the quantized values and their scales (and mins)."""
        tensors = [self.qweight, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def rows(self, start: int, end: int) -> QuantizedWeight:
        """Output rows [start, end) (a view)."""
        return QuantizedWeight(self.kind, self.qweight[start:end], self.scales[start:end],
                               None if self.mins is None else self.mins[start:end], self.group_size)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(self.kind, self.qweight.to(device), self.scales.to(device),
                               None if self.mins is None else self.mins.to(device), self.group_size)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The rows of `parts` one after the other (a fused projection); all of one kind and group size."""
    first = parts[0]
    if any(p.kind != first.kind or p.group_size != first.group_size or p.in_features != first.in_features
           for p in parts):
        raise ValueError(f"cannot fuse {[(p.kind, p.group_size, p.in_features) for p in parts]}: the parts "
                         "must share kind, group size and input width")
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])
    return QuantizedWeight(first.kind, torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                           mins, first.group_size)


# -- int4 packing ----------------------------------------------------------------------------------------------


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in // 2] from 4-bit values q [out, in] (0..15): the layout drawn in the module docstring."""
    out, in_features = q.shape
    groups = q.to(torch.uint8).reshape(out, in_features // INT4_GROUP, 2, INT4_GROUP // 2)
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(out, in_features // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit values [out, in] (uint8, 0..15) of `pack_int4`'s layout."""
    out, half = packed.shape
    groups = packed.reshape(out, half * 2 // INT4_GROUP, INT4_GROUP // 2)
    return torch.stack([groups & 0x0F, groups >> 4], dim=2).reshape(out, half * 2)


# -- round-to-nearest of a dense weight --------------------------------------------------------------------------


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 per output channel: scale = max|w| / 127 (a zero row gets scale 0 and q 0)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.where(scales > 0, w / torch.where(scales > 0, scales, 1.0), 0.0).round_().clamp_(-127, 127)
    return QuantizedWeight("int8", q.to(torch.int8), scales, None, w.shape[1])


def quantize_int4(weight: torch.Tensor) -> QuantizedWeight:
    """Asymmetric int4 per group of 32 inputs: q = round((w - min) / scale), scale = (max - min) / 15."""
    w = weight.detach().float()
    out, in_features = w.shape
    if in_features % INT4_GROUP:
        raise ValueError(f"in_features={in_features} is invalid for int4: must be a multiple of {INT4_GROUP}")
    groups = w.reshape(out, in_features // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scales = (high - low) / 15.0
    safe = torch.where(scales > 0, scales, 1.0).unsqueeze(2)
    q = ((groups - low.unsqueeze(2)) / safe).round_().clamp_(0, 15).reshape(out, in_features)
    return QuantizedWeight("int4", pack_int4(q), scales, low, INT4_GROUP)


# -- the torch twins -----------------------------------------------------------------------------------------------


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """fp32 [out, in]: every weight's value, computed as the module docstring defines it."""
    out, in_features = w.out_features, w.in_features
    if w.kind == "int8":
        q = w.qweight.float().reshape(out, -1, w.group_size)
        return (q * w.scales.unsqueeze(2)).reshape(out, in_features)
    q = unpack_int4(w.qweight).float().reshape(out, -1, INT4_GROUP)
    return (q * w.scales.unsqueeze(2) + w.mins.unsqueeze(2)).reshape(out, in_features)


def quantized_linear_reference(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None
                               ) -> torch.Tensor:
    """x [..., in] (fp32/bf16/fp16) times the dequantized weight, accumulated in fp32, in x's dtype: the twin of
    every quantized GEMV / GEMM kernel (CPU C and Triton)."""
    y = torch.nn.functional.linear(x.float(), dequantize(w).to(x.device),
                                   None if bias is None else bias.float())
    return y.to(x.dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] (in a multiple of 32) -> (qx int8 [rows, in], dx float32 [rows, in / 32]): each block of 32
    inputs as dx * qx with dx = max|x| / 127 and qx = round(x * (127 / max|x|)) to nearest even (0 for an all-zero
    block). The twin, bit for bit, of the C kernels' int8-activation path (csrc/quant_kernels.c)."""
    rows, in_features = x.shape
    blocks = x.float().reshape(rows, in_features // INT4_GROUP, INT4_GROUP)
    amax = blocks.abs().amax(dim=-1)
    # a true division, as C's 127.0f / amax (torch's `127.0 / tensor` multiplies by a reciprocal: 1 ulp apart)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    qx = torch.round(blocks * inverse.unsqueeze(-1)).to(torch.int8).reshape(rows, in_features)
    return qx, amax / 127.0


def quantized_linear_int8_activations_reference(x: torch.Tensor, w: QuantizedWeight,
                                                bias: torch.Tensor | None = None) -> torch.Tensor:
    """`quantized_linear_reference` of x rounded as `quantize_activations` rounds it: the twin of the C kernels'
    int8-activation path (which sums the same products as integers per block, so only in another order)."""
    flat = x.reshape(-1, w.in_features)
    qx, dx = quantize_activations(flat)
    rounded = (qx.float().reshape(flat.shape[0], -1, INT4_GROUP) * dx.unsqueeze(-1)).reshape(flat.shape)
    return quantized_linear_reference(rounded, w, bias).to(x.dtype).reshape(*x.shape[:-1], w.out_features)
