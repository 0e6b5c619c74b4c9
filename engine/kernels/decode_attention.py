"""Paged decode attention: one query token per sequence over its cached context (GQA, variable lengths).

The cache is head-major, one layer's K (and likewise V):

    k_cache  [kv_heads, num_blocks, block_size, head_dim]
    token t of sequence b:  k_cache[h, block_tables[b, t // block_size], t % block_size, :]

The twin (`decode_attention_torch`, moved here from engine/attention.py unchanged) gathers each sequence's
blocks into a padded [kv_heads, B, width * block_size, head_dim] copy and masks the padding with the
step's additive mask. The Triton kernel reads the blocks in place and stops at each sequence's length:

    stage 1, grid (B, kv_heads, splits): one program takes the `group` query heads that share a kv head
             (padded to 16 rows so tl.dot applies; K/V read once for the whole group) over one split of
             the context, BLOCK_N tokens at a time with an online softmax (flash-decoding).
    stage 2, grid (B, heads): merges the splits' partial outputs by their log-sum-exp. With one split,
             stage 1 writes the normalized output itself and stage 2 does not run.

Splits exist for small batches: B * kv_heads programs alone would leave most SMs idle while a long
context streams through a few of them. Their number depends only on shapes (batch, kv heads, the padded
width), never on the lengths' values, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from engine.kernels.cpu_native import decode_attention_native, use_native
from engine.kernels.triton_jit import cdiv, dot_precision, jit, next_power_of_2, pipeline_stages, tl, use_triton

MAX_SPLITS = 32
BLOCK_N = 64  # context tokens per inner step (several cache blocks when block_size < 64); tl.dot needs >= 16


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    context_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, heads, head_dim] -> [B, heads, head_dim]: Triton on CUDA, the C kernel on CPU, else the twin.

    `block_ids` [B * width] are the block tables padded to a common width, flat; `context_lens` [B] int32 each
    sequence's context length, which the kernels read; `mask` [B, width * block_size], 0 over each context and -inf
    past its end, the same lengths as the twin reads them. Either may be None: whichever path needs the other form
    derives it (the model runner gives the lengths, and the mask too, once a step, where the twin runs).
    """
    triton, native = use_triton(q), k_cache.dtype == q.dtype and use_native(q)
    if (triton or native) and context_lens is None:
        context_lens = context_lens_from_mask(mask)
    if triton:
        return decode_attention_triton(q, k_cache, v_cache, block_ids.view(q.shape[0], -1), context_lens, scale)
    if native:
        return decode_attention_native(q, k_cache, v_cache, block_ids, context_lens, scale)
    if mask is None:
        mask = mask_from_context_lens(context_lens, block_ids.numel() // q.shape[0] * k_cache.shape[2])
    return decode_attention_torch(q, k_cache, v_cache, block_ids, mask, scale)


def twin_runs(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether `decode_attention` runs the torch twin, which reads a mask, for q and caches of `dtype` on `device`:
    a caller that builds a step's inputs once builds the mask then too (`mask_from_context_lens`), rather than have
    every layer derive it from the lengths."""
    probe = torch.empty(0, dtype=dtype, device=device)
    return not (use_triton(probe) or use_native(probe))


def context_lens_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B] int32 context lengths from the step's additive decode mask (0 over the context, -inf after)."""
    return (mask == 0).sum(-1, dtype=torch.int32)


def mask_from_context_lens(context_lens: torch.Tensor, width_tokens: int) -> torch.Tensor:
    """The additive decode mask [B, width_tokens] float32 (0 over each context, -inf after) from lengths [B]."""
    past_end = torch.arange(width_tokens, device=context_lens.device) >= context_lens.unsqueeze(1)
    return torch.zeros(past_end.shape, device=context_lens.device).masked_fill_(past_end, float("-inf"))


# --- torch twin ------------------------------------------------------------------------------------------


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence, all sequences at once over their padded gathered context.

    Grouped-query heads share K/V by a reshape (q as [kv_heads, B, group, head_dim]) instead of
    repeating K/V, so the gather reads each cached K/V once; `mask` (built once per step, shared by
    every layer) is added to the scores to hide the padding past each sequence's end.
    """
    batch, num_heads, head_dim = q.shape
    kv_heads, num_blocks = k_cache.shape[0], k_cache.shape[1]
    group = num_heads // kv_heads
    k = k_cache.view(kv_heads, num_blocks, -1).index_select(1, block_ids).view(kv_heads, batch, -1, head_dim)
    v = v_cache.view(kv_heads, num_blocks, -1).index_select(1, block_ids).view(kv_heads, batch, -1, head_dim)
    q = (q * scale).view(batch, kv_heads, group, head_dim).transpose(0, 1)  # [kv_heads, B, group, head_dim]
    scores = torch.matmul(q, k.transpose(-1, -2)).float()  # [kv_heads, B, group, L]
    scores += mask[None, :, None, :]
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(batch, num_heads, head_dim)


# --- Triton ----------------------------------------------------------------------------------------------


@jit
def _decode_split_kernel(
    Q,
    K,
    V,
    BlockTables,
    ContextLens,
    Out,
    PartialOut,
    PartialMax,
    PartialSum,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    tokens_per_split,
    stride_qb,
    stride_qh,
    stride_kh,
    stride_kb,
    stride_ko,
    stride_vh,
    stride_vb,
    stride_vo,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_mb,
    stride_mh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    context_len = tl.load(ContextLens + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(Q + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], g_mask[:, None] & d_mask[None, :], 0.0)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (base-2 logits)
    l = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(logit - m)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = BlockTables + seq * stride_bt
    for tile in range(start, end, BLOCK_N):
        n = tile + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        offset = n % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            K + kv_head * stride_kh + block[:, None] * stride_kb + offset[:, None] * stride_ko + d[None, :],
            mask=kv_mask, other=0.0,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(
            V + kv_head * stride_vh + block[:, None] * stride_vb + offset[:, None] * stride_vo + d[None, :],
            mask=kv_mask, other=0.0,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:  # unnormalized; an empty split (start >= context_len) leaves m = -inf, l = 0, acc = 0
        partial = PartialOut + seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :]
        tl.store(partial, acc, mask=out_mask)
        tl.store(PartialMax + seq * stride_mb + heads * stride_mh + split, m, mask=g_mask)
        tl.store(PartialSum + seq * stride_mb + heads * stride_mh + split, l, mask=g_mask)
    else:
        out = (acc / l[:, None]).to(Out.dtype.element_ty)
        tl.store(Out + seq * stride_ob + heads[:, None] * stride_oh + d[None, :], out, mask=out_mask)


@jit
def _decode_merge_kernel(
    PartialOut,
    PartialMax,
    PartialSum,
    Out,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_mb,
    stride_mh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = s < num_splits
    m = tl.load(PartialMax + seq * stride_mb + head * stride_mh + s, mask=s_mask, other=float("-inf"))
    l = tl.load(PartialSum + seq * stride_mb + head * stride_mh + s, mask=s_mask, other=0.0)
    weight = tl.exp2(m - tl.max(m, 0))  # split 0 always holds token 0, so the max is finite; empty splits -> 0
    mask = s_mask[:, None] & (d < HEAD_DIM)[None, :]
    acc = tl.load(PartialOut + seq * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :], mask, 0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
    tl.store(Out + seq * stride_ob + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


def default_num_splits(batch: int, kv_heads: int, max_context_tokens: int, device: torch.device) -> int:
    """Enough splits for about two programs per SM (one split off CUDA), at most one per BLOCK_N tokens."""
    if device.type != "cuda":
        return 1
    target_programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(cdiv(target_programs, batch * kv_heads), cdiv(max_context_tokens, BLOCK_N), MAX_SPLITS))


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    block_n: int = BLOCK_N,
) -> torch.Tensor:
    """q [B, heads, head_dim], block_tables [B, width] (padding past a sequence's blocks is never read),
    context_lens [B] (each >= 1 and <= width * block_size) -> [B, heads, head_dim].

    `num_splits` (1..MAX_SPLITS) overrides the context split count and `block_n` (a power of 2, >= 16)
    the tokens per inner step: the tests use them to reach both stages and many steps on small contexts.
    """
    batch, num_heads, head_dim = q.shape
    kv_heads, _, block_size, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % kv_heads:
        raise ValueError(
            f"decode_attention: q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)} "
            "(head_dim must match, heads must be a multiple of kv_heads)"
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(-1) != 1:
            raise ValueError(f"decode_attention: {name} must have a unit-stride head_dim, got {cache.stride()}")
    max_context_tokens = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, max_context_tokens, q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"decode_attention: num_splits {num_splits} must be in [1, {MAX_SPLITS}]")
    if block_n < 16 or block_n != next_power_of_2(block_n):
        raise ValueError(f"decode_attention: block_n {block_n} must be a power of 2, >= 16")
    tokens_per_split = cdiv(cdiv(max_context_tokens, num_splits), block_n) * block_n
    num_splits = cdiv(max_context_tokens, tokens_per_split)  # no split starts past the padded width

    group = num_heads // kv_heads
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    split = num_splits > 1
    if split:
        partial_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        partial_max = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        partial_sum = torch.empty_like(partial_max)
    else:  # unused by the kernel when SPLIT is off
        partial_out, partial_max, partial_sum = out, out, out
    head_dim_pad = max(next_power_of_2(head_dim), 16)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, partial_out, partial_max, partial_sum,
        scale * 1.4426950408889634, tokens_per_split,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2) if split else 0,
        partial_max.stride(0), partial_max.stride(1),
        GROUP=group, GROUP_PAD=max(next_power_of_2(group), 16),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=split, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4, num_stages=pipeline_stages(q.dtype, 2),
    )  # fmt: skip
    if split:
        _decode_merge_kernel[(batch, num_heads)](
            partial_out, partial_max, partial_sum, out, num_splits,
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_max.stride(0), partial_max.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=next_power_of_2(num_splits),
        )  # fmt: skip
    return out
