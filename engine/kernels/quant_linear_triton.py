"""Quantized weight-only linear on CUDA: y = x @ dequantize(w).T + bias, in Triton, for engine/quant_format.py's
int8 and int4 layouts. The twin is `quantized_linear_reference` (engine/quant_format.py).

    x     [rows, in]  fp32 / fp16 / bf16        y [rows, out] in x's dtype, accumulated in fp32
    int8  qweight [out, in] int8,  scales [out, in // group] (group = in: per output channel; or 32: Q8_0)
    int4  qweight [out, in // 2] uint8, scales and mins [out, in // 32]; in group g of row o, byte j holds
          input 32g + j in its low nibble and input 32g + j + 16 in its high one (GGUF's order), so input k
          sits in byte 16 * (k // 32) + k % 16, nibble (k // 16) % 2

Three paths, picked by row count (`quantized_linear_triton`), where they measured fastest on an H200
(benchmarks/quant_triton_bench.py --sweep, benchmarks/RESULTS.md):

    GEMV (1..GEMV_MAX_ROWS rows: decode at batch 1-2): bound by the bytes of the weight. A program reads a
         [BLOCK_N, BLOCK_K] weight tile as [BLOCK_N, groups, group] (16-byte loads), converts it once, dots
         each group with each row of x in fp32 and scales the group's sum once (int4: plus the group's min
         times the group's sum of x), so scales and mins are read once per group, not once per weight. Past
         2 rows its FMAs per row cost more than the GEMM's tensor cores.
    GEMM (up to the dequantize threshold: batched decode, short prefill): a tiled tl.dot per group; the group's
         weights are dequantized in registers with its [BLOCK_N] scales and cast to x's dtype (fp16 / bf16
         tensor cores, rows padded to 16; fp32 x takes an IEEE fp32 dot). Per-channel int8, with no group
         scales, dots a whole K tile of raw q at once instead (`_per_channel_gemm_kernel`).
    DEQUANTIZE + cuBLAS (`dequantize_min_rows`: 128 rows, 256 for per-channel int8): at prefill row counts
         the linear is compute-bound, and cuBLAS's dense GEMM beats a Triton GEMM that dequantizes every
         weight tile once per row block; one pass writes the weight in x's dtype (`dequantize_triton`), used
         by this call only (2.4-3.3x faster than the GEMM at 512 rows for grouped int8 and int4).

Both split K over a grid axis when the output alone gives too few programs to fill the SMs (a 576-wide
projection is 36 GEMV programs on a 132-SM GPU; the GEMV aims at GEMV_PROGRAMS_PER_SM small programs per SM
to keep enough loads in flight); the splits write fp32 partial sums [splits, rows, out]
that a small kernel adds in a fixed order (deterministic, unlike atomics), with the bias and the cast.
With one split the main kernel writes y itself.

Per-channel int8 (group = in) multiplies by its scale once at the end (q is exact in fp16 and bf16, so
the dot runs on the raw values).
"""

from __future__ import annotations

import torch

from engine.kernels.triton_jit import cdiv, dot_precision, jit, next_power_of_2, pipeline_stages, tl
from engine.quant_format import QuantizedWeight

# Tile sizes and launch shapes: module constants that the launchers read per call (benchmarks/
# quant_triton_bench.py --sweep sets them to time each choice).
GEMV_MAX_ROWS = 2  # the GEMV / GEMM time on Llama-3-8B's projections: 0.97 at 2 rows, 1.47 at 4, 2.49 at 8
DEQUANT_MIN_ROWS = 128  # from here on, dequantize + cuBLAS (see the module docstring)
PER_CHANNEL_DEQUANT_MIN_ROWS = 256  # the same for per-channel int8, whose GEMM (no group scales) stays ahead longer
MAX_SPLITS = 16
GEMV_BLOCK_N = 16
GEMV_BLOCK_K = 512  # a multiple of every group size (32, 64) and of PER_CHANNEL_SUB
GEMV_PROGRAMS_PER_SM = 8  # small programs (4 warps, one tile in flight each): several per SM keep loads in flight
GEMV_NUM_WARPS = 4
GEMV_NUM_STAGES = 1
PER_CHANNEL_SUB = 32
GEMM_BLOCK_N = 128
GEMM_BLOCK_K = 64
GEMM_PROGRAMS_PER_SM = 2
GEMM_NUM_WARPS = 4
GEMM_NUM_STAGES = 3
PER_CHANNEL_GEMM_BLOCK_K = 128  # per-channel int8's GEMM: one dot per K tile (see `_per_channel_gemm_kernel`)
DEQUANT_BLOCK_N = 16
DEQUANT_BLOCK_K = 256


def quantized_linear_triton(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
                            num_splits: int | None = None) -> torch.Tensor:
    """x [..., in] (fp32 / fp16 / bf16, on w's device) -> [..., out] in x's dtype: the GEMV kernel for at
    most GEMV_MAX_ROWS rows, the GEMM below `dequantize_min_rows(w)`, dequantize + cuBLAS from there. `num_splits`
    (1..MAX_SPLITS) overrides the GEMV's and GEMM's split-K count (default: enough programs for about
    *_PROGRAMS_PER_SM per SM on CUDA, 1 elsewhere); tests use it to reach both the split and the direct path
    under the interpreter. x is not modified; y is a new tensor."""
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
    if rows.shape[0] >= dequantize_min_rows(w):
        y = dequantized_linear_triton(rows, w, bias)
    else:
        launch = quantized_gemv_triton if rows.shape[0] <= GEMV_MAX_ROWS else quantized_gemm_triton
        y = launch(rows, w, bias, num_splits)
    return y.view(*x.shape[:-1], w.out_features)


def dequantize_min_rows(w: QuantizedWeight) -> int:
    """From how many rows on a call takes dequantize + cuBLAS."""
    return PER_CHANNEL_DEQUANT_MIN_ROWS if _per_channel(w) else DEQUANT_MIN_ROWS


def default_num_splits(output_programs: int, k_tiles: int, device: torch.device, programs_per_sm: int) -> int:
    """Splits of K giving about `programs_per_sm` programs per SM (1 off CUDA), at most one per K tile."""
    if device.type != "cuda":
        return 1
    target_programs = programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(cdiv(target_programs, output_programs), k_tiles, MAX_SPLITS))


class _SplitK:
    """How K is cut: `tiles_per_split` K tiles each, `count` splits (none empty)."""

    def __init__(self, in_features: int, block_k: int, output_programs: int, num_splits: int | None,
                 device: torch.device, programs_per_sm: int):
        k_tiles = cdiv(in_features, block_k)
        if num_splits is None:
            num_splits = default_num_splits(output_programs, k_tiles, device, programs_per_sm)
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
    """x [rows, in] (1..GEMV_MAX_ROWS rows, unit column stride) -> [rows, out]: the decode kernel."""
    _checked(x, w)
    rows = x.shape[0]
    if not 1 <= rows <= GEMV_MAX_ROWS:
        raise ValueError(f"quantized_gemv: {rows} rows; the GEMV takes 1..{GEMV_MAX_ROWS}")
    n_blocks = cdiv(w.out_features, GEMV_BLOCK_N)
    split = _SplitK(w.in_features, GEMV_BLOCK_K, n_blocks, num_splits, x.device, GEMV_PROGRAMS_PER_SM)
    y, target = _outputs(x, w, split.count)
    _quantized_gemv_kernel[(n_blocks, split.count)](
        x, w.qweight, w.scales, w.mins if w.mins is not None else w.scales,
        bias if bias is not None and split.count == 1 else y, target,
        rows, w.out_features, w.in_features, split.tiles_per_split * GEMV_BLOCK_K,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), target.stride(-2),
        target.stride(0) if split.count > 1 else 0,
        IS_INT4=w.kind == "int4", SUB=_sub_block(w), PER_CHANNEL=_per_channel(w),
        HAS_BIAS=bias is not None and split.count == 1,
        BLOCK_M=next_power_of_2(rows), BLOCK_N=GEMV_BLOCK_N, BLOCK_K=GEMV_BLOCK_K,
        num_warps=GEMV_NUM_WARPS, num_stages=GEMV_NUM_STAGES,
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
    # per-channel int8 has no group scales to apply inside the K loop: one dot per K tile (1.1-1.6x the grouped
    # kernel on an H200 at 8-32 rows); a K tile spanning groups needs a scale per weight, gathered: 3-6x slower
    kernel, block_k = ((_per_channel_gemm_kernel, PER_CHANNEL_GEMM_BLOCK_K) if _per_channel(w)
                       else (_quantized_gemm_kernel, GEMM_BLOCK_K))
    m_blocks, n_blocks = cdiv(rows, block_m), cdiv(w.out_features, GEMM_BLOCK_N)
    split = _SplitK(w.in_features, block_k, m_blocks * n_blocks, num_splits, x.device, GEMM_PROGRAMS_PER_SM)
    y, target = _outputs(x, w, split.count)
    kernel[(m_blocks, n_blocks, split.count)](
        x, w.qweight, w.scales, w.mins if w.mins is not None else w.scales,
        bias if bias is not None and split.count == 1 else y, target,
        rows, w.out_features, w.in_features, split.tiles_per_split * block_k,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), target.stride(-2),
        target.stride(0) if split.count > 1 else 0,
        IS_INT4=w.kind == "int4", SUB=_sub_block(w), PER_CHANNEL=_per_channel(w),
        HAS_BIAS=bias is not None and split.count == 1,
        BLOCK_M=block_m, BLOCK_N=GEMM_BLOCK_N, BLOCK_K=block_k, DOT_PRECISION=dot_precision(x.dtype),
        num_warps=GEMM_NUM_WARPS, num_stages=pipeline_stages(x.dtype, GEMM_NUM_STAGES),
    )  # fmt: skip
    if split.count > 1:
        _sum_splits(target, bias, y)
    return y


def dequantized_linear_triton(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] (unit column stride) -> [rows, out]: the weight dequantized to x's dtype for this call
    (`dequantize_triton`), then torch's dense GEMM (cuBLAS). The prefill path; no copy outlives the call."""
    _checked(x, w)
    return torch.nn.functional.linear(x, dequantize_triton(w, x.dtype), bias)


def dequantize_triton(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight's values [out, in] in `dtype` (a new tensor): the twin is `dequantize(w).to(dtype)`
    (engine/quant_format.py), equal up to one rounding of q * scale + min (fused or not)."""
    out = torch.empty((w.out_features, w.in_features), dtype=dtype, device=w.qweight.device)
    grid = (cdiv(w.out_features, DEQUANT_BLOCK_N), cdiv(w.in_features, DEQUANT_BLOCK_K))
    _dequantize_kernel[grid](
        w.qweight, w.scales, w.mins if w.mins is not None else w.scales, out,
        w.out_features, w.in_features, w.qweight.stride(0), w.scales.stride(0), out.stride(0),
        IS_INT4=w.kind == "int4", SUB=_sub_block(w), PER_CHANNEL=_per_channel(w),
        BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=DEQUANT_BLOCK_K,
    )  # fmt: skip
    return out


def _sub_block(w: QuantizedWeight) -> int:
    """Inputs per sub-block of a K tile (see below): the group, or 32 for per-channel int8."""
    return PER_CHANNEL_SUB if _per_channel(w) else w.group_size


def _per_channel(w: QuantizedWeight) -> bool:
    """One scale per output row (int8 round-to-nearest): the kernels scale the finished dot instead."""
    return w.kind == "int8" and w.group_size == w.in_features


# --- Triton ----------------------------------------------------------------------------------------------
#
# Both kernels walk a K tile as TG = BLOCK_K // SUB sub-blocks of SUB inputs: a quantization group (int4: 32,
# int8: its group), or for per-channel int8 (no groups) PER_CHANNEL_SUB inputs, so each sub-block has one scale
# (and min) per output row, loaded once, not per weight. An int4 sub-block is 16 bytes a row: the low nibbles
# are its inputs 0..15 and the high ones 16..31, so it is two halves of 16 inputs, each with its own x.


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
    """BLOCK_M rows of x (a few): a [BLOCK_N, TG, W] weight tile (W = SUB, int4: 16 bytes) read and converted
    once, times each row's [TG, W] inputs, each group's partial dot then scaled (int4: plus its min times the
    group's sum of x); row r's sums land in acc's row r."""
    TG: tl.constexpr = BLOCK_K // SUB
    W: tl.constexpr = SUB // 2 if IS_INT4 else SUB
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < out_features
    m = tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    g = tl.arange(0, TG)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for tile in range(k_start, k_end, BLOCK_K):
        k = tile + g[:, None] * SUB + tl.arange(0, W)[None, :]  # [TG, W]: int4's low-nibble inputs
        k_mask = k < k_end  # whole groups: an int4 input k + 16 is in range whenever k is
        w_mask = n_mask[:, None, None] & k_mask[None, :, :]
        group_mask = n_mask[:, None] & (tile + g * SUB < k_end)[None, :]
        group_offsets = n[:, None] * stride_sn + (tile // SUB + g)[None, :]
        if IS_INT4:
            byte = tile // 2 + g[:, None] * W + tl.arange(0, W)[None, :]
            packed = tl.load(QWeight + n[:, None, None] * stride_qn + byte[None, :, :], mask=w_mask,
                             other=0).to(tl.int32)
            q_low, q_high = (packed & 0xF).to(tl.float32), (packed >> 4).to(tl.float32)
            scales = tl.load(Scales + group_offsets, mask=group_mask, other=0.0)
            mins = tl.load(Mins + group_offsets, mask=group_mask, other=0.0)
        else:
            q = tl.load(QWeight + n[:, None, None] * stride_qn + k[None, :, :], mask=w_mask, other=0).to(tl.float32)
            if not PER_CHANNEL:
                scales = tl.load(Scales + group_offsets, mask=group_mask, other=0.0)
        for r in tl.static_range(BLOCK_M):
            x_mask = k_mask & (tl.zeros_like(k) + r < rows)
            x = tl.load(X + r * stride_xm + k, mask=x_mask, other=0.0).to(tl.float32)
            if IS_INT4:
                x_high = tl.load(X + r * stride_xm + k + W, mask=x_mask, other=0.0).to(tl.float32)
                part = tl.sum(q_low * x[None, :, :] + q_high * x_high[None, :, :], axis=2)  # [BLOCK_N, TG]
                part = part * scales + mins * tl.sum(x + x_high, axis=1)[None, :]
            else:
                part = tl.sum(q * x[None, :, :], axis=2)
                if not PER_CHANNEL:
                    part = part * scales
            if BLOCK_M == 1:
                acc += tl.sum(part, axis=1)[None, :]
            else:
                acc += tl.where(m[:, None] == r, tl.sum(part, axis=1)[None, :], 0.0)
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
    """Grouped kinds (per-channel int8 takes `_per_channel_gemm_kernel`). Per sub-block: its [W, BLOCK_N]
    weights (transposed, so the dot needs no tl.trans) dequantized in registers with the sub-block's [BLOCK_N]
    scales (and mins), in x's dtype for the tensor cores (one rounding of each weight), times x's [BLOCK_M, W]
    inputs."""
    tl.static_assert(not PER_CHANNEL)
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
        for sub in tl.static_range(TG):
            k0 = tile + sub * SUB
            k = k0 + tl.arange(0, W)
            k_mask = k < k_end
            w_mask = k_mask[:, None] & n_mask[None, :]
            x_mask = m_mask[:, None] & k_mask[None, :]
            group_mask = n_mask & (k0 + tl.zeros_like(n) < k_end)
            group = n * stride_sn + k0 // SUB
            if IS_INT4:
                packed = tl.load(QWeight + n[None, :] * stride_qn + (k0 // 2 + tl.arange(0, W))[:, None],
                                 mask=w_mask, other=0).to(tl.int32)
                scale = tl.load(Scales + group, mask=group_mask, other=0.0)[None, :]
                low = tl.load(Mins + group, mask=group_mask, other=0.0)[None, :]
                w = (packed & 0xF).to(tl.float32) * scale + low
                x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
                acc = tl.dot(x, w.to(X.dtype.element_ty), acc, input_precision=DOT_PRECISION)
                w = (packed >> 4).to(tl.float32) * scale + low
                x = tl.load(X + m[:, None] * stride_xm + (k + W)[None, :], mask=x_mask, other=0.0)
                acc = tl.dot(x, w.to(X.dtype.element_ty), acc, input_precision=DOT_PRECISION)
            else:
                w = tl.load(QWeight + n[None, :] * stride_qn + k[:, None], mask=w_mask, other=0).to(tl.float32)
                w = w * tl.load(Scales + group, mask=group_mask, other=0.0)[None, :]
                x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
                acc = tl.dot(x, w.to(X.dtype.element_ty), acc, input_precision=DOT_PRECISION)
    _finish(acc, Scales, Bias, Out + split * stride_os, m, n, rows, out_features,
            stride_sn, stride_om, PER_CHANNEL, HAS_BIAS)


@jit
def _per_channel_gemm_kernel(
    X, QWeight, Scales, Mins, Bias, Out,
    rows, out_features, in_features, k_per_split,
    stride_xm, stride_qn, stride_sn, stride_om, stride_os,
    IS_INT4: tl.constexpr, SUB: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The GEMM for per-channel int8 (the same arguments; IS_INT4 and SUB unused): with no group scales, a whole
    [BLOCK_K, BLOCK_N] tile of raw q (exact in fp16 / bf16) goes into one dot, and `_finish` scales the rows."""
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = m < rows, n < out_features
    split = tl.program_id(2)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for tile in range(k_start, k_end, BLOCK_K):
        k = tile + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        q = tl.load(QWeight + n[None, :] * stride_qn + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
        x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, q.to(X.dtype.element_ty), acc, input_precision=DOT_PRECISION)
    _finish(acc, Scales, Bias, Out + split * stride_os, m, n, rows, out_features,
            stride_sn, stride_om, PER_CHANNEL, HAS_BIAS)


@jit
def _dequantize_kernel(
    QWeight, Scales, Mins, Out, out_features, in_features, stride_qn, stride_sn, stride_on,
    IS_INT4: tl.constexpr, SUB: tl.constexpr, PER_CHANNEL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """A [BLOCK_N, BLOCK_K] tile of the weight's values, walked as the GEMV walks it ([BLOCK_N, TG, W]: a
    scale (and min) per sub-block row, int4's low and high nibbles stored W inputs apart)."""
    TG: tl.constexpr = BLOCK_K // SUB
    W: tl.constexpr = SUB // 2 if IS_INT4 else SUB
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    tile = tl.program_id(1) * BLOCK_K
    g = tl.arange(0, TG)
    k = tile + g[:, None] * SUB + tl.arange(0, W)[None, :]  # [TG, W]: int4's low-nibble inputs
    n_mask = n < out_features
    mask = n_mask[:, None, None] & (k < in_features)[None, :, :]
    out = Out + n[:, None, None] * stride_on + k[None, :, :]
    if PER_CHANNEL:
        scale = tl.load(Scales + n * stride_sn, mask=n_mask, other=0.0)[:, None, None]
    else:
        group_offsets = n[:, None] * stride_sn + (tile // SUB + g)[None, :]
        group_mask = n_mask[:, None] & (tile + g * SUB < in_features)[None, :]
        scale = tl.load(Scales + group_offsets, mask=group_mask, other=0.0)[:, :, None]
    if IS_INT4:
        byte = tile // 2 + g[:, None] * W + tl.arange(0, W)[None, :]
        packed = tl.load(QWeight + n[:, None, None] * stride_qn + byte[None, :, :], mask=mask, other=0).to(tl.int32)
        low = tl.load(Mins + group_offsets, mask=group_mask, other=0.0)[:, :, None]
        tl.store(out, ((packed & 0xF).to(tl.float32) * scale + low).to(Out.dtype.element_ty), mask=mask)
        tl.store(out + W, ((packed >> 4).to(tl.float32) * scale + low).to(Out.dtype.element_ty), mask=mask)
    else:
        q = tl.load(QWeight + n[:, None, None] * stride_qn + k[None, :, :], mask=mask, other=0)
        tl.store(out, (q.to(tl.float32) * scale).to(Out.dtype.element_ty), mask=mask)


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
