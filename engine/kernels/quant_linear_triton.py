"""Quantized weight-only linear on CUDA: y = x @ dequantize(w).T + bias, in Triton, for engine/quant_format.py's
int8 and int4 layouts. The twin is `quantized_linear_reference` (engine/quant_format.py).

    x     [rows, in]  fp32 / fp16 / bf16        y [rows, out] in x's dtype, accumulated in fp32
    int8  qweight [out, in] int8,  scales [out, in // group] (group = in: per output channel; or 32: Q8_0)
    int4  qweight [out, in // 2] uint8, scales and mins [out, in // 32]; in group g of row o, byte j holds
          input 32g + j in its low nibble and input 32g + j + 16 in its high one (GGUF's order), so input k
          sits in byte 16 * (k // 32) + k % 16, nibble (k // 16) % 2

Two kernels, picked by row count (`quantized_linear_triton`):

    GEMV (rows <= GEMV_MAX_ROWS, decode): bound by the bytes of the weight. A program dequantizes a
         [BLOCK_N, BLOCK_K] weight tile in fp32 registers once and multiplies it with every row of x
         (broadcast FMAs into a [rows, BLOCK_N, BLOCK_K] accumulator, reduced once at the end), so each
         weight byte is read once per call whatever the row count.
    GEMM (more rows, prefill / big batches): a tiled tl.dot; the weight tile is dequantized in registers
         and cast to x's dtype (fp16 / bf16 tensor cores; fp32 x takes an IEEE fp32 dot), x tile times it.

Both split K over a grid axis when the output alone gives too few programs to fill the SMs (a 576-wide
projection is 18 GEMV programs on a 132-SM GPU); the splits write fp32 partial sums [splits, rows, out]
that a small kernel adds in a fixed order (deterministic, unlike atomics), with the bias and the cast.
With one split the main kernel writes y itself.

Per-channel int8 (group = in) multiplies by its scale once at the end (q is exact in fp16 and bf16, so
the dot runs on the raw values); grouped kinds apply scale (and min) per weight while dequantizing.
"""

from __future__ import annotations

import torch

from engine.kernels.triton_jit import cdiv, dot_precision, jit, next_power_of_2, pipeline_stages, tl
from engine.quant_format import QuantizedWeight

GEMV_MAX_ROWS = 4  # the GEMV's accumulator is [rows padded to a power of 2, BLOCK_N, BLOCK_K] registers
MAX_SPLITS = 16
GEMV_BLOCK_N = 64
GEMV_BLOCK_K = 128  # a multiple of every group size (32, 64) and of PER_CHANNEL_SUB
PER_CHANNEL_SUB = 32
GEMM_BLOCK_N = 64
GEMM_BLOCK_K = 64


def quantized_linear_triton(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
                            num_splits: int | None = None) -> torch.Tensor:
    """x [..., in] (fp32 / fp16 / bf16, on w's device) -> [..., out] in x's dtype: the GEMV kernel for at
    most GEMV_MAX_ROWS rows, the GEMM beyond. `num_splits` (1..MAX_SPLITS) overrides the split-K count
    (default: enough programs for about two per SM on CUDA, 1 elsewhere); tests use it to reach both
    the split and the direct path under the interpreter. x is not modified; y is a new tensor."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"quantized_linear: x's last dim {x.shape[-1]} must equal in_features {w.in_features}")
    if bias is not None and bias.shape != (w.out_features,):
        raise ValueError(f"quantized_linear: bias shape {tuple(bias.shape)} must be ({w.out_features},)")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"quantized_linear: x dtype {x.dtype} must be float32, float16 or bfloat16")
    rows = x.reshape(-1, w.in_features)
    if rows.shape[0] == 0:
        return torch.empty((*x.shape[:-1], w.out_features), dtype=x.dtype, device=x.device)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    launch = quantized_gemv_triton if rows.shape[0] <= GEMV_MAX_ROWS else quantized_gemm_triton
    return launch(rows, w, bias, num_splits).view(*x.shape[:-1], w.out_features)


def default_num_splits(output_programs: int, k_tiles: int, device: torch.device) -> int:
    """Splits of K giving about two programs per SM (1 off CUDA), at most one per K tile."""
    if device.type != "cuda":
        return 1
    target_programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(cdiv(target_programs, output_programs), k_tiles, MAX_SPLITS))


class _SplitK:
    """How K is cut: `tiles_per_split` K tiles each, `count` splits (none empty)."""

    def __init__(self, in_features: int, block_k: int, output_programs: int, num_splits: int | None,
                 device: torch.device):
        k_tiles = cdiv(in_features, block_k)
        if num_splits is None:
            num_splits = default_num_splits(output_programs, k_tiles, device)
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"quantized_linear: num_splits {num_splits} must be in [1, {MAX_SPLITS}]")
        self.tiles_per_split = cdiv(k_tiles, num_splits)
        self.count = cdiv(k_tiles, self.tiles_per_split)


def _checked(x: torch.Tensor, w: QuantizedWeight) -> None:
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] != w.in_features:
        raise ValueError(f"quantized_linear: x must be [rows, {w.in_features}] with unit column stride, "
                         f"got {tuple(x.shape)} strides {x.stride()}")
    if x.device != w.qweight.device:
        raise ValueError(f"quantized_linear: x on {x.device} but the weight on {w.qweight.device}")
    for name, t in (("qweight", w.qweight), ("scales", w.scales), ("mins", w.mins)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"quantized_linear: {name} must have a unit column stride, got {t.stride()}")


def _outputs(x: torch.Tensor, w: QuantizedWeight, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, where the main kernel writes): y itself with one split, fp32 partial sums [splits, rows, out]
    otherwise."""
    y = torch.empty((x.shape[0], w.out_features), dtype=x.dtype, device=x.device)
    if splits == 1:
        return y, y
    return y, torch.empty((splits, x.shape[0], w.out_features), dtype=torch.float32, device=x.device)


def _sum_splits(partial: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> None:
    splits, rows, out = partial.shape
    block = min(1024, next_power_of_2(out))
    _sum_splits_kernel[(rows, cdiv(out, block))](
        partial, bias if bias is not None else y, y, splits, out,
        partial.stride(0), partial.stride(1), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK=block,
    )  # fmt: skip


def quantized_gemv_triton(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
                          num_splits: int | None = None) -> torch.Tensor:
    """x [rows, in] (rows <= GEMV_MAX_ROWS, unit column stride) -> [rows, out]: the decode kernel."""
    _checked(x, w)
    rows = x.shape[0]
    if not 1 <= rows <= GEMV_MAX_ROWS:
        raise ValueError(f"quantized_gemv: {rows} rows; the GEMV takes 1..{GEMV_MAX_ROWS}")
    block_m = next_power_of_2(rows)
    n_blocks = cdiv(w.out_features, GEMV_BLOCK_N)
    split = _SplitK(w.in_features, GEMV_BLOCK_K, n_blocks, num_splits, x.device)
    y, target = _outputs(x, w, split.count)
    _quantized_gemv_kernel[(n_blocks, split.count)](
        x, w.qweight, w.scales, w.mins if w.mins is not None else w.scales,
        bias if bias is not None and split.count == 1 else y, target,
        rows, w.out_features, w.in_features, split.tiles_per_split * GEMV_BLOCK_K,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), target.stride(-2),
        target.stride(0) if split.count > 1 else 0,
        IS_INT4=w.kind == "int4", SUB=_sub_block(w), PER_CHANNEL=_per_channel(w),
        HAS_BIAS=bias is not None and split.count == 1,
        BLOCK_M=block_m, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=GEMV_BLOCK_K, num_warps=4,
    )  # fmt: skip
    if split.count > 1:
        _sum_splits(target, bias, y)
    return y


def quantized_gemm_triton(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
                          num_splits: int | None = None) -> torch.Tensor:
    """x [rows, in] (any row count, unit column stride) -> [rows, out]: the tiled tl.dot kernel."""
    _checked(x, w)
    rows = x.shape[0]
    block_m = min(128, max(16, next_power_of_2(rows)))
    m_blocks, n_blocks = cdiv(rows, block_m), cdiv(w.out_features, GEMM_BLOCK_N)
    split = _SplitK(w.in_features, GEMM_BLOCK_K, m_blocks * n_blocks, num_splits, x.device)
    y, target = _outputs(x, w, split.count)
    _quantized_gemm_kernel[(m_blocks, n_blocks, split.count)](
        x, w.qweight, w.scales, w.mins if w.mins is not None else w.scales,
        bias if bias is not None and split.count == 1 else y, target,
        rows, w.out_features, w.in_features, split.tiles_per_split * GEMM_BLOCK_K,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), target.stride(-2),
        target.stride(0) if split.count > 1 else 0,
        IS_INT4=w.kind == "int4", SUB=_sub_block(w), PER_CHANNEL=_per_channel(w),
        HAS_BIAS=bias is not None and split.count == 1,
        BLOCK_M=block_m, BLOCK_N=GEMM_BLOCK_N, BLOCK_K=GEMM_BLOCK_K, DOT_PRECISION=dot_precision(x.dtype),
        num_warps=4, num_stages=pipeline_stages(x.dtype, 3),
    )  # fmt: skip
    if split.count > 1:
        _sum_splits(target, bias, y)
    return y


def _sub_block(w: QuantizedWeight) -> int:
    """Inputs per sub-block of a K tile (see below): the group, or 32 for per-channel int8."""
    return PER_CHANNEL_SUB if _per_channel(w) else w.group_size


def _per_channel(w: QuantizedWeight) -> bool:
    """One scale per output row (int8 round-to-nearest): the kernels scale the finished dot instead."""
    return w.kind == "int8" and w.group_size == w.in_features


# --- Triton ----------------------------------------------------------------------------------------------
#
# Both kernels see a K tile as TG = BLOCK_K // SUB sub-blocks of SUB inputs: a quantization group (int4: 32,
# int8: its group), or for per-channel int8 (no groups) 32 inputs. A tile's weights are loaded as
# [BLOCK_N, TG, SUB] (int4: [BLOCK_N, TG, 16] bytes, each holding the sub-block's inputs j and j + 16), so a
# row's bytes are one contiguous run, and the scales (and mins) as [BLOCK_N, TG]: one load per group, not per
# weight. The GEMV applies them to each group's partial dot (the min times the group's sum of x); the GEMM to
# the dequantized tile before its tensor-core dot.


@jit
def _load_sub_blocks(QWeight, n, tile, k_end, stride_qn, IS_INT4: tl.constexpr, SUB: tl.constexpr,
                     TG: tl.constexpr, n_mask):
    """A K tile's quantized values as fp32 [BLOCK_N, TG, W] (W = SUB, or 16 for int4, which gives its low
    nibbles, then its high ones, as (q_lo, q_hi)); the inputs' k [TG, W] (int4: the low nibbles') and mask."""
    if IS_INT4:
        j = tl.arange(0, SUB // 2)
        k = tile + tl.arange(0, TG)[:, None] * SUB + j[None, :]
        k_mask = k < k_end  # whole groups: an input k + 16 is in range whenever k is
        byte = tile // 2 + tl.arange(0, TG)[:, None] * (SUB // 2) + j[None, :]
        packed = tl.load(QWeight + n[:, None, None] * stride_qn + byte[None, :, :],
                         mask=n_mask[:, None, None] & k_mask[None, :, :], other=0).to(tl.int32)
        lo = (packed & 0xF).to(tl.float32)
        hi = (packed >> 4).to(tl.float32)
    else:
        k = tile + tl.arange(0, TG)[:, None] * SUB + tl.arange(0, SUB)[None, :]
        k_mask = k < k_end
        lo = tl.load(QWeight + n[:, None, None] * stride_qn + k[None, :, :],
                     mask=n_mask[:, None, None] & k_mask[None, :, :], other=0).to(tl.float32)
        hi = lo  # unused: one return shape for both kinds
    return lo, hi, k, k_mask


@jit
def _load_group_params(Scales, Mins, n, tile, k_end, stride_sn, SUB: tl.constexpr, TG: tl.constexpr, n_mask,
                       IS_INT4: tl.constexpr, PER_CHANNEL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scales and mins [BLOCK_N, TG] of a K tile's groups (ones and zeros where the kind has none)."""
    g = tl.arange(0, TG)
    mask = n_mask[:, None] & (tile + g * SUB < k_end)[None, :]
    offsets = n[:, None] * stride_sn + (tile // SUB + g)[None, :]
    scales = tl.full([BLOCK_N, TG], 1.0, tl.float32)
    mins = tl.zeros([BLOCK_N, TG], tl.float32)
    if not PER_CHANNEL:
        scales = tl.load(Scales + offsets, mask=mask, other=0.0)
    if IS_INT4:
        mins = tl.load(Mins + offsets, mask=mask, other=0.0)
    return scales, mins


@jit
def _finish(acc, Scales, Bias, Out, m, n, rows, out_features, stride_sn, stride_om,
            PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 for rows `m`, outputs `n` -> Out (y with the bias, or this split's
    partial sums: Out then points at the split's [rows, out] slab)."""
    n_mask = n < out_features
    if PER_CHANNEL:
        acc = acc * tl.load(Scales + n * stride_sn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(Bias + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mask = (m < rows)[:, None] & n_mask[None, :]
    tl.store(Out + m[:, None] * stride_om + n[None, :], acc.to(Out.dtype.element_ty), mask=mask)


@jit
def _quantized_gemv_kernel(
    X, QWeight, Scales, Mins, Bias, Out,
    rows, out_features, in_features, k_per_split,
    stride_xm, stride_qn, stride_sn, stride_om, stride_os,
    IS_INT4: tl.constexpr, SUB: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    TG: tl.constexpr = BLOCK_K // SUB
    W: tl.constexpr = SUB // 2 if IS_INT4 else SUB
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < out_features
    split = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for tile in range(k_start, k_end, BLOCK_K):
        lo, hi, k, k_mask = _load_sub_blocks(QWeight, n, tile, k_end, stride_qn, IS_INT4, SUB, TG, n_mask)
        scales, mins = _load_group_params(Scales, Mins, n, tile, k_end, stride_sn, SUB, TG, n_mask, IS_INT4,
                                          PER_CHANNEL, BLOCK_N)
        for mi in tl.static_range(BLOCK_M):  # the weight tile stays in registers for every row of x
            x_mask = k_mask & (tl.full([TG, W], mi, tl.int32) < rows)  # a [TG, W] mask (a scalar one is refused)
            x = tl.load(X + mi * stride_xm + k, mask=x_mask, other=0.0).to(tl.float32)  # [TG, W]
            if IS_INT4:
                x_hi = tl.load(X + mi * stride_xm + k + SUB // 2, mask=x_mask, other=0.0).to(tl.float32)
                part = tl.sum(lo * x[None, :, :] + hi * x_hi[None, :, :], axis=2)  # [BLOCK_N, TG]
                x_sums = tl.sum(x + x_hi, axis=1)  # [TG]: what each group's min multiplies
                row = tl.sum(part * scales + mins * x_sums[None, :], axis=1)
            else:
                row = tl.sum(tl.sum(lo * x[None, :, :], axis=2) * scales, axis=1)
            acc = tl.where((m == mi)[:, None], acc + row[None, :], acc)
    _finish(acc, Scales, Bias, Out + split * stride_os, m, n, rows, out_features,
            stride_sn, stride_om, PER_CHANNEL, HAS_BIAS)


@jit
def _quantized_gemm_kernel(
    X, QWeight, Scales, Mins, Bias, Out,
    rows, out_features, in_features, k_per_split,
    stride_xm, stride_qn, stride_sn, stride_om, stride_os,
    IS_INT4: tl.constexpr, SUB: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    TG: tl.constexpr = BLOCK_K // SUB
    W: tl.constexpr = SUB // 2 if IS_INT4 else SUB
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = m < rows, n < out_features
    split = tl.program_id(2)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for tile in range(k_start, k_end, BLOCK_K):
        lo, hi, k, k_mask = _load_sub_blocks(QWeight, n, tile, k_end, stride_qn, IS_INT4, SUB, TG, n_mask)
        scales, mins = _load_group_params(Scales, Mins, n, tile, k_end, stride_sn, SUB, TG, n_mask, IS_INT4,
                                          PER_CHANNEL, BLOCK_N)
        # the tile in x's dtype for the tensor cores (exact for per-channel int8's raw q; one rounding of each
        # weight otherwise), flattened to [BLOCK_N, TG * W] in the order of k's elements
        w = tl.reshape(lo * scales[:, :, None] + mins[:, :, None], [BLOCK_N, TG * W]).to(X.dtype.element_ty)
        k_flat = tl.reshape(k, [TG * W])
        x_mask = m_mask[:, None] & tl.reshape(k_mask, [TG * W])[None, :]
        x = tl.load(X + m[:, None] * stride_xm + k_flat[None, :], mask=x_mask, other=0.0)  # [BLOCK_M, TG * W]
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if IS_INT4:  # the high nibbles: inputs k + 16
            w = tl.reshape(hi * scales[:, :, None] + mins[:, :, None], [BLOCK_N, TG * W]).to(X.dtype.element_ty)
            x = tl.load(X + m[:, None] * stride_xm + (k_flat + SUB // 2)[None, :], mask=x_mask, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    _finish(acc, Scales, Bias, Out + split * stride_os, m, n, rows, out_features,
            stride_sn, stride_om, PER_CHANNEL, HAS_BIAS)


@jit
def _sum_splits_kernel(Partial, Bias, Out, splits, out_features, stride_ps, stride_pm, stride_om,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Out[m, n] = sum over splits of Partial[s, m, n] (in split order) + bias, in Out's dtype."""
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = n < out_features
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, splits):
        acc += tl.load(Partial + s * stride_ps + m * stride_pm + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + n, acc.to(Out.dtype.element_ty), mask=mask)
