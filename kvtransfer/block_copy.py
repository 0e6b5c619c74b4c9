"""Copying a layer group's blocks between the paged caches and one contiguous message buffer.

    cache (per layer, K and V)                      message buffer, per layer (back to back)
    [kv_heads, num_blocks, block_size, head_dim]    [2 (K, V), kv_heads, len(ids), block_size, head_dim]
                 ▲ dim 1 indexed by block id         (messages.py's WRITE payload; KVLayout.payload_views)

`gather` is index_select on dim 1 into the buffer; `scatter` is index_copy_ on dim 1 out of it. Each moves
whole [block_size, head_dim] rows, so both may treat the bytes as int64 words (`_as_words`): same bytes,
and torch's fp16 index_copy_ is about 2x slower than its int64 one on CPU (1.7 vs 3.3 GB/s, one thread).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def _as_words(cache: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both as [kv_heads, blocks, row_words] int64 views of the same memory, when both allow it."""
    def words(t: torch.Tensor) -> torch.Tensor | None:
        row_bytes = t.shape[2] * t.shape[3] * t.element_size()
        if row_bytes % 8 or t.storage_offset() * t.element_size() % 8 or not t.is_contiguous():
            return None
        return t.view(torch.int64).view(t.shape[0], t.shape[1], row_bytes // 8)

    cache_words, rows_words = words(cache), words(rows)
    if cache_words is None or rows_words is None:
        return cache, rows  # odd shapes: the plain dtype copy is the reference behaviour anyway
    return cache_words, rows_words


def gather(kv_caches: KVCaches, layer_start: int, layer_end: int, block_ids: torch.Tensor,
           out: Sequence[torch.Tensor]) -> None:
    """out[i][0 / 1] = K / V of layer layer_start + i at `block_ids` (int64 on the caches' device)."""
    for i, layer in enumerate(range(layer_start, layer_end)):
        for kv in range(2):
            cache, rows = _as_words(kv_caches[layer][kv], out[i][kv])
            torch.index_select(cache, 1, block_ids, out=rows)


def scatter(kv_caches: KVCaches, layer_start: int, layer_end: int, block_ids: torch.Tensor,
             data: Sequence[torch.Tensor]) -> None:
    """K / V of layer layer_start + i at `block_ids` = data[i][0 / 1]; the inverse of `gather`."""
    for i, layer in enumerate(range(layer_start, layer_end)):
        for kv in range(2):
            cache, rows = _as_words(kv_caches[layer][kv], data[i][kv])
            cache.index_copy_(1, block_ids, rows)


class StagingPool:
    """Reusable flat uint8 host buffers for gathered messages.

    A fresh multi-MiB tensor page-faults on first touch (one fault per 4 KiB page), which made the gather
    ~2x slower on CPU; reusing buffers skips that. Holds at most `max_idle_bytes` of idle buffers.
    """

    def __init__(self, max_idle_bytes: int):
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, num_bytes: int) -> torch.Tensor:
        """A buffer of >= num_bytes bytes, owned by the caller until `give`n back."""
        with self._lock:
            fits = [i for i, b in enumerate(self._idle) if b.numel() >= num_bytes]
            if fits:  # by index: list.remove would compare tensors elementwise
                best = min(fits, key=lambda i: self._idle[i].numel())
                return self._idle.pop(best)
        return torch.empty(num_bytes, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            idle_bytes = sum(b.numel() for b in self._idle)
            if idle_bytes + buffer.numel() <= self.max_idle_bytes:
                self._idle.append(buffer)
