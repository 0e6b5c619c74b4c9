"""Prefill attention for a chunk that follows cached tokens: queries attend causally to prefix + chunk.

A chunk of num_q query tokens sits at positions [num_ctx - num_q, num_ctx) of its sequence; its own K/V
are already written to the paged cache (engine/attention.py writes before it attends), so the whole
context is read from the cache through the chunk's block table:

    query i (position num_ctx - num_q + i) sees context tokens j <= num_ctx - num_q + i

The twin (`prefix_attention_torch`, moved here from engine/attention.py unchanged) gathers the context
into a contiguous copy and calls SDPA with that boolean mask. On CUDA, SDPA with an arbitrary mask cannot
use its flash backend, and with grouped-query heads it falls back to the math path (scores materialized,
K/V repeated per query head), so the twin there costs a gather copy plus O(num_q * num_ctx) memory per
head. The Triton kernel instead is flash attention over the block table, reading K/V in place: the
approach of vLLM's `context_attention_fwd` (triton prefix_prefill) and SGLang's `extend_attention`, both
of which read the cached prefix from the paged pool inside the kernel. A chunk with nothing cached
before it does not come here: engine/attention.py gives it SDPA with is_causal on its own K/V, which
picks the flash kernel on CUDA.

Grid (query tiles, heads): one program per BLOCK_M queries of one head; keys past the tile's last
visible position are never loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.triton_jit import cdiv, dot_precision, jit, next_power_of_2, pipeline_stages, tl, use_triton

BLOCK_M = 64  # query tokens per program
BLOCK_N = 64  # context tokens per inner step (tl.dot needs both >= 16)


def prefix_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_context_tokens: int,
    scale: float,
) -> torch.Tensor:
    """q [num_q, heads, head_dim] of a chunk whose context (cached prefix + the chunk, num_context_tokens
    in all, already in the cache) lies in `block_table` -> [num_q, heads, head_dim]; Triton on CUDA."""
    if use_triton(q):
        return prefix_attention_triton(q, k_cache, v_cache, block_table, num_context_tokens, scale)
    return prefix_attention_torch(q, k_cache, v_cache, block_table, num_context_tokens, scale)


# --- torch twin ------------------------------------------------------------------------------------------


def prefix_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_context_tokens: int,
    scale: float,
) -> torch.Tensor:
    """Gather the chunk's context from the cache; query i sees keys <= its position.

    SDPA gets a batch dim of 1, as in engine/attention.py's causal_attention: with 4-D inputs its CPU dispatch
    takes the flash kernel (a mask allowed), with 3-D ones the unfused math fallback, 2.3-6x slower in bf16 and
    3-18x in fp32 at 30-512 queries over 330-2048 context tokens here (a prefix hit's prefill is mostly this).
    """
    num_ctx, num_q = num_context_tokens, q.shape[0]
    kv_heads, head_dim = k_cache.shape[0], k_cache.shape[3]
    k = k_cache.index_select(1, block_table).view(kv_heads, -1, head_dim)[:, :num_ctx]
    v = v_cache.index_select(1, block_table).view(kv_heads, -1, head_dim)[:, :num_ctx]
    query_pos = torch.arange(num_ctx - num_q, num_ctx, device=q.device).unsqueeze(1)
    mask = torch.arange(num_ctx, device=q.device).unsqueeze(0) <= query_pos  # [num_q, num_ctx]
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


# --- Triton ----------------------------------------------------------------------------------------------


@jit
def _prefix_attention_kernel(
    Q,
    K,
    V,
    BlockTable,
    Out,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    num_query_tokens,
    num_context_tokens,
    stride_qt,
    stride_qh,
    stride_kh,
    stride_kb,
    stride_ko,
    stride_vh,
    stride_vb,
    stride_vo,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP
    prefix = num_context_tokens - num_query_tokens
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the chunk
    d = tl.arange(0, HEAD_DIM_PAD)
    i_mask = i < num_query_tokens
    d_mask = d < HEAD_DIM
    q_mask = i_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + i[:, None].to(tl.int64) * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # the tile's last query sees up to position prefix + (tile + 1) * BLOCK_M - 1
    end = tl.minimum(prefix + (tile + 1) * BLOCK_M, num_context_tokens)
    for start in range(0, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block = tl.load(BlockTable + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        offset = n % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            K + kv_head * stride_kh + block[:, None] * stride_kb + offset[:, None] * stride_ko + d[None, :],
            mask=kv_mask, other=0.0,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = n_mask[None, :] & (n[None, :] <= prefix + i[:, None])
        s = tl.where(visible, s, float("-inf"))
        # every row sees token 0 in the first step, so m is finite from then on
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

    out = acc / l[:, None]
    out_ptr = Out + i[:, None].to(tl.int64) * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=q_mask)


def prefix_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_context_tokens: int,
    scale: float,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> torch.Tensor:
    """As `prefix_attention`; `block_m` / `block_n` (powers of 2, >= 16) let the tests reach many query
    tiles and context steps on small chunks."""
    num_q, num_heads, head_dim = q.shape
    kv_heads, _, block_size, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % kv_heads:
        raise ValueError(
            f"prefix_attention: q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)} "
            "(head_dim must match, heads must be a multiple of kv_heads)"
        )
    if not num_q <= num_context_tokens <= block_table.shape[0] * block_size:
        raise ValueError(
            f"prefix_attention: num_context_tokens {num_context_tokens} must be in "
            f"[{num_q}, {block_table.shape[0] * block_size}] (query tokens, block table capacity)"
        )
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size != next_power_of_2(size):
            raise ValueError(f"prefix_attention: {name} {size} must be a power of 2, >= 16")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((num_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    _prefix_attention_kernel[(cdiv(num_q, block_m), num_heads)](
        q, k_cache, v_cache, block_table, out, scale * 1.4426950408889634, num_q, num_context_tokens,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(next_power_of_2(head_dim), 16),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4, num_stages=pipeline_stages(q.dtype, 3),
    )  # fmt: skip
    return out
