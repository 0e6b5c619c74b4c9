"""GGUF's Q8_0 / Q4_0 / Q4_1 blocks repacked into duet's quantized layout (engine/quant_format.py), exactly.

A GGUF row of `in` weights is in / 32 blocks laid end to end (little-endian, no padding):

    Q8_0  34 bytes:  [ d: fp16 | q: 32 x int8 ]                      value_j = d * q_j
    Q4_0  18 bytes:  [ d: fp16 | qs: 16 bytes ]                      value_j = d * (nibble_j - 8)
    Q4_1  20 bytes:  [ d: fp16 | m: fp16 | qs: 16 bytes ]            value_j = d * nibble_j + m
                     byte j of qs = [ nibble_{j+16} | nibble_j ]     (the order quant_format's int4 uses)

Repacking moves bytes and widens fp16 to fp32 (exact); no value is re-rounded:

    Q8_0 -> int8, group 32, scales = d
    Q4_1 -> int4, scales = d, mins = m
    Q4_0 -> int4, scales = d, mins = -8d   (d * q - 8d == d * (q - 8) exactly: both are fp16 d times a small int)

so `dequantize` of the result equals the `gguf` package's own dequantization bit for bit (tests/test_quantization.py).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.quant_format import INT4_GROUP, Q8_0_GROUP, QuantizedWeight

# type name -> bytes of one 32-weight block
KEPT_BLOCK_BYTES = {"Q8_0": 2 + Q8_0_GROUP, "Q4_0": 2 + INT4_GROUP // 2, "Q4_1": 4 + INT4_GROUP // 2}


def repack_gguf_blocks(raw: np.ndarray, type_name: str, in_features: int) -> QuantizedWeight:
    """`raw`: a GGUF tensor's bytes (uint8, [out, in / 32 * block bytes], rows in the file's order) of type
    `type_name` (one of KEPT_BLOCK_BYTES) -> the same numbers as a QuantizedWeight [out, in].
    Raises ValueError for another type or a size that does not match."""
    if type_name not in KEPT_BLOCK_BYTES:
        raise ValueError(f"GGUF type {type_name} is not repacked: only {', '.join(KEPT_BLOCK_BYTES)} are")
    block_bytes = KEPT_BLOCK_BYTES[type_name]
    groups = in_features // 32
    if in_features % 32 or raw.dtype != np.uint8 or raw.size != raw.shape[0] * groups * block_bytes:
        raise ValueError(f"{type_name} tensor of {raw.shape} {raw.dtype} does not hold rows of {in_features} "
                         f"weights ({groups} blocks of {block_bytes} bytes each)")
    out = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(out, groups, block_bytes)
    d = _fp16_to_fp32(blocks[:, :, 0:2])
    if type_name == "Q8_0":
        q = torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8)).reshape(out, in_features)
        return QuantizedWeight("int8", q, d, None, Q8_0_GROUP)
    if type_name == "Q4_1":
        mins, qs = _fp16_to_fp32(blocks[:, :, 2:4]), blocks[:, :, 4:]
    else:
        mins, qs = d * -8.0, blocks[:, :, 2:]
    qweight = torch.from_numpy(qs.copy()).reshape(out, in_features // 2)
    return QuantizedWeight("int4", qweight, d, mins, INT4_GROUP)


def _fp16_to_fp32(two_bytes: np.ndarray) -> torch.Tensor:
    """[out, groups, 2] little-endian fp16 bytes -> fp32 [out, groups] (exact)."""
    halves = np.ascontiguousarray(two_bytes).view("<f2")[..., 0]
    return torch.from_numpy(halves.astype(np.float32))
