"""Rotary position embedding on q and k heads in one kernel (neox / Hugging Face rotate-half layout).

    out = x·cos + rotate_half(x)·sin,   rotate_half(x) = [-x[half:], x[:half]]

per token, for every head of x [T, heads, head_dim] (the model passes its q and k heads side by side, a
strided view of the qkv projection, so one launch rotates both). The twin is `engine.rope.apply_rotary`
itself, so the CPU path is the model's code by construction. The Triton kernel computes in fp32 and rounds
once; the twin rounds each fp16/bf16 product, so they differ by about an ulp there.
"""

from __future__ import annotations

import torch

from engine.kernels.cpu_native import rotary_native, use_native
from engine.kernels.triton_jit import cdiv, jit, next_power_of_2, tl, use_triton
from engine.rope import apply_rotary as apply_rotary_torch

__all__ = ["apply_rotary", "apply_rotary_torch", "apply_rotary_triton"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by cos/sin ([T, 1, head_dim] or [T, head_dim]) -> a new tensor."""
    if use_triton(x):
        return apply_rotary_triton(x, cos, sin)
    if cos.dtype == sin.dtype == x.dtype and use_native(x):
        return rotary_native(x, cos, sin)
    return apply_rotary_torch(x, cos, sin)


@jit
def _rotary_kernel(
    X,
    Cos,
    Sin,
    Out,
    num_heads,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF_PAD)
    d_mask = d < HALF
    mask = (heads < num_heads)[:, None] & d_mask[None, :]
    cos1 = tl.load(Cos + token * stride_ct + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(Cos + token * stride_ct + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(Sin + token * stride_st + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(Sin + token * stride_st + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    x_row = X + token * stride_xt + heads[:, None] * stride_xh + d[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    out_row = Out + token * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_row, (x1 * cos1 - x2 * sin1).to(Out.dtype.element_ty), mask=mask)
    tl.store(out_row + HALF, (x2 * cos2 + x1 * sin2).to(Out.dtype.element_ty), mask=mask)


def _rows(table: torch.Tensor, num_tokens: int, head_dim: int) -> torch.Tensor:
    """cos or sin as [T, head_dim] with unit stride on the last dim."""
    table = table.reshape(num_tokens, head_dim)
    return table if table.stride(-1) == 1 else table.contiguous()


def apply_rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"apply_rotary: head_dim {head_dim} must be even")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = _rows(cos, num_tokens, head_dim), _rows(sin, num_tokens, head_dim)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    half = head_dim // 2
    block_h = min(next_power_of_2(num_heads), 16)
    _rotary_kernel[(num_tokens, cdiv(num_heads, block_h))](
        x, cos, sin, out, num_heads,
        x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        HALF=half, HALF_PAD=next_power_of_2(half), BLOCK_H=block_h,
    )  # fmt: skip
    return out
