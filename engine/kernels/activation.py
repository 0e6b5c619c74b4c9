"""SwiGLU's activation over the fused gate/up projection: silu(gate) * up.

    gate_up [T, 2 * intermediate] = [gate | up]  ->  silu(gate) * up  [T, intermediate]

The twin is the model's two ops (silu, then the product, each rounded to the dtype); on CPU the C kernel
does both in one pass over gate_up (engine/kernels/cpu_native.py). CUDA runs the twin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.cpu_native import silu_and_mul_native, use_native


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 * intermediate]; C on CPU (2-D input), the twin otherwise."""
    if gate_up.dim() == 2 and use_native(gate_up):
        return silu_and_mul_native(gate_up)
    return silu_and_mul_torch(gate_up)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
