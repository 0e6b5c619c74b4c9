"""RMSNorm, alone or fused with the residual add before it.

Semantics (the twin is the model's RMSNorm, moved here unchanged):

    fp32:        out = x * rsqrt(mean(x²) + eps) * weight
    fp16/bf16:   out = weight * (x32 * rsqrt(mean(x32²) + eps)).to(dtype)      (Hugging Face's order:
                 normalize in fp32, cast, then scale), x32 = x.float()
    fused add:   residual = x + residual (rounded to the dtype, as torch's add); out = norm(residual)

The Triton kernel is one program per token row: one read of x (and residual), one write of out (and the
new residual), so the add costs no extra pass over the hidden state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.cpu_native import add_rms_norm_native, use_native
from engine.kernels.triton_jit import jit, next_power_of_2, tl, use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., hidden]; Triton on CUDA, C on CPU (2-D x), the twin otherwise."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps)
    if x.dim() == 2 and weight.dtype == x.dtype and use_native(x):
        return add_rms_norm_native(x, None, weight, eps)[0]
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); neither input is modified. Triton on CUDA, C on CPU (2-D x),
    the twin otherwise."""
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    if x.dim() == 2 and residual.dtype == weight.dtype == x.dtype and use_native(x):
        return add_rms_norm_native(x, residual, weight, eps)
    return fused_add_rms_norm_torch(x, residual, weight, eps)


# --- torch twins ---------------------------------------------------------------------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # fused; same math in fp32
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)  # HF's order: normalize in fp32, cast, then scale


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm_torch(residual, weight, eps), residual


# --- Triton ----------------------------------------------------------------------------------------------


@jit
def _rms_norm_kernel(
    X,
    Residual,
    Weight,
    Out,
    ResidualOut,
    eps,
    hidden,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + cols, mask=mask, other=0.0)
        # an fp32 add rounded once to the dtype is exactly torch's fp16/bf16 add
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResidualOut + row * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / hidden
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(X.dtype.element_ty)  # cast, then scale
    w = tl.load(Weight + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} must be ({hidden},)")
    rows = x.reshape(-1, hidden)  # a view for the model's [T, hidden] activations
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out_rows = out.view(-1, hidden)
    if residual is None:
        res_rows = res_out_rows = rows  # unused: HAS_RESIDUAL is off
        residual_out = None
    else:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"fused_add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x "
                f"{tuple(x.shape)} {x.dtype}"
            )
        res_rows = residual.reshape(-1, hidden)
        if res_rows.stride(-1) != 1:
            res_rows = res_rows.contiguous()
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        res_out_rows = residual_out.view(-1, hidden)
    block = next_power_of_2(hidden)
    num_warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    _rms_norm_kernel[(rows.shape[0],)](
        rows, res_rows, weight, out_rows, res_out_rows, eps, hidden,
        rows.stride(0), res_rows.stride(0), out_rows.stride(0), res_out_rows.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return out, residual_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps)
