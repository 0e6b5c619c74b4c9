"""Attention over the paged KV cache, in plain torch.

One layer's cache, for K and likewise V, head-major:

    k_cache  [num_kv_heads, num_blocks, block_size, head_dim]
               head h, block b, offset o  ==  k_cache.view(kv_heads, -1, head_dim)[h, slot]
               where slot = b * block_size + o

Head-major because a gather of a batch's blocks (`index_select` on dim 1) then lands as
[kv_heads, batch, context, head_dim], the layout both attention matmuls take without a copy.

A step's batch is flattened to T tokens. The model runner orders it decodes first (one query token
each, attended in one batched call), then prefill chunks (several query tokens each, attended one
chunk at a time with a causal mask offset by the tokens already cached before the chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    query_start: int  # index of the chunk's first token in the flattened batch
    num_query_tokens: int
    num_context_tokens: int  # cached before the chunk + the chunk itself
    block_table: torch.Tensor  # [blocks covering num_context_tokens], int64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each token's K and V are written
    num_decode_tokens: int  # the first num_decode_tokens tokens are decodes
    decode_block_ids: torch.Tensor | None  # [num_decodes * max_blocks] int64: block tables, padded, flat
    decode_mask: torch.Tensor | None  # [num_decodes, max_blocks * block_size] float32: 0 or -inf past the end
    prefills: list[PrefillChunk]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
    """Store the step's new K and V ([T, kv_heads, head_dim]) at their slots."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] for the step's tokens -> [T, heads, head_dim]."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    n = meta.num_decode_tokens
    if n:
        out[:n] = decode_attention(q[:n], k_cache, v_cache, meta.decode_block_ids, meta.decode_mask, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.num_query_tokens)
        if chunk.num_context_tokens == chunk.num_query_tokens:
            out[rows] = causal_attention(q[rows], k[rows], v[rows], scale)
        else:
            out[rows] = prefix_attention(q[rows], k_cache, v_cache, chunk, scale)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk with nothing cached before it: attend to its own K/V directly, no cache gather."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


def prefix_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PrefillChunk, scale: float
) -> torch.Tensor:
    """A chunk after cached tokens: gather its context from the cache; query i sees keys <= its position."""
    num_ctx, num_q = chunk.num_context_tokens, chunk.num_query_tokens
    kv_heads, head_dim = k_cache.shape[0], k_cache.shape[3]
    k = k_cache.index_select(1, chunk.block_table).view(kv_heads, -1, head_dim)[:, :num_ctx]
    v = v_cache.index_select(1, chunk.block_table).view(kv_heads, -1, head_dim)[:, :num_ctx]
    query_pos = torch.arange(num_ctx - num_q, num_ctx).unsqueeze(1)
    mask = torch.arange(num_ctx).unsqueeze(0) <= query_pos  # [num_q, num_ctx]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def decode_attention(
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
