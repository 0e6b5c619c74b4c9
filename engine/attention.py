"""Attention over the paged KV cache.

One layer's cache, for K and likewise V, head-major:

    k_cache  [num_kv_heads, num_blocks, block_size, head_dim]
               head h, block b, offset o  ==  k_cache.view(kv_heads, -1, head_dim)[h, slot]
               where slot = b * block_size + o

Head-major because a gather of a batch's blocks (`index_select` on dim 1) then lands as
[kv_heads, batch, context, head_dim], the layout both attention matmuls take without a copy.

A step's batch is flattened to T tokens. The model runner orders it decodes first (one query token
each, attended in one batched call), then prefill chunks (several query tokens each, attended one
chunk at a time with a causal mask offset by the tokens already cached before the chunk).

Decode and prefix attention are engine/kernels dispatchers: Triton kernels on CUDA, their torch twins
(the plain-torch code that lived here) on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels import apply_rotary, decode_attention, prefix_attention
from engine.kernels.cpu_native import rotary_store_kv_native, use_native


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
    # [num_decodes, max_blocks * block_size] float32: 0 over each context, -inf past its end: the lengths below as
    # the torch twin reads them, built once a step where it runs (the Triton and C kernels read the lengths)
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    # [num_decodes] int32 context lengths; a step with decodes has them or the mask (the kernel that needs the other
    # form derives it: engine/kernels/decode_attention.py)
    decode_context_lens: torch.Tensor | None = None


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
    """Store the step's new K and V ([T, kv_heads, head_dim]) at their slots."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, slots, v.transpose(0, 1))


def rotate_and_store_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """qk [T, heads + kv_heads, head_dim] (q heads, then k heads) rotated as `apply_rotary` does, and the rotated
    K with v [T, kv_heads, head_dim] stored at `slots` as `write_kv` does; returns the rotated qk.

    On CPU one C pass does both (`rotary_store_kv_native`): the store rides along with the rotation, where
    write_kv's two index_copy_ calls cost ~150 us a layer at batch 32 on a 2-core machine to move 16 KB.
    Elsewhere (CUDA, no compiler) the two steps below run: they are the twin.
    """
    if cos.dtype == sin.dtype == qk.dtype == k_cache.dtype and use_native(qk):
        return rotary_store_kv_native(qk, v, cos, sin, k_cache, v_cache, slots)
    qk = apply_rotary(qk, cos, sin)
    write_kv(qk[:, qk.shape[1] - k_cache.shape[0]:], v, k_cache, v_cache, slots)
    return qk


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] for the step's tokens -> [T, heads, head_dim].

    The step's K/V must be in the cache already (`rotate_and_store_kv`): decodes and prefix chunks read them
    there; a chunk with nothing cached before it attends to k/v directly.
    """
    n = meta.num_decode_tokens
    if n == q.shape[0]:  # decodes only, the usual decode step: the kernel's output is the result
        return decode_attention(q, k_cache, v_cache, meta.decode_block_ids, meta.decode_mask, scale,
                                context_lens=meta.decode_context_lens)
    out = torch.empty_like(q)
    if n:
        out[:n] = decode_attention(q[:n], k_cache, v_cache, meta.decode_block_ids, meta.decode_mask, scale,
                                   context_lens=meta.decode_context_lens)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.num_query_tokens)
        if chunk.num_context_tokens == chunk.num_query_tokens:
            out[rows] = causal_attention(q[rows], k[rows], v[rows], scale)
        else:
            out[rows] = prefix_attention(q[rows], k_cache, v_cache, chunk.block_table, chunk.num_context_tokens, scale)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk with nothing cached before it: attend to its own K/V directly, no cache gather.

    SDPA gets a batch dim of 1: with 4-D inputs its CPU dispatch picks the flash kernel, with 3-D ones the
    unfused math fallback (2-7x slower in fp32, 6-8x in bf16, at 32-2048 tokens here).
    """
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, T, head_dim]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
