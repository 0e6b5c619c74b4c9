"""Turns a step's scheduled chunks into tensors, runs the model, samples.

It never sees a request: only `ScheduledChunk`s (tokens, positions, block table, sampling params)
in, and a token (plus logprobs) per sampled request out. It owns the KV cache tensors.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, PrefillChunk
from engine.model import KVCache, LlamaForCausalLM
from engine.sampler import Sampler, SamplingRow, TokenLogprobs
from engine.scheduler import ScheduledChunk


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None


def allocate_kv_caches(model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device | str | None = None) -> list[KVCache]:
    """Zeroed (never NaN: padded gathers read unused slots, and 0 * NaN would poison the sum), on `device`
    (None: the model's)."""
    cfg = model.config
    device = model.embed_tokens.weight.device if device is None else device
    shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)  # head-major: see engine/attention.py
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)]


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element_bytes


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int, sampler: Sampler):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.device = kv_caches[0][0].device

    @torch.inference_mode()
    def execute(
        self, chunks: list[ScheduledChunk], on_layer_done: Callable[[int], None] | None = None
    ) -> dict[str, SampledToken]:
        """Compute the chunks' KV (written to the cache) and sample for the chunks that ask for it.

        `on_layer_done(i)` is called as soon as layer i's K/V for every chunk is in the cache.
        """
        if not chunks:
            return {}
        ordered = [c for c in chunks if len(c.token_ids) == 1] + [c for c in chunks if len(c.token_ids) > 1]
        input_ids, positions, meta = self.prepare_inputs(ordered)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, on_layer_done)
        return self.sample(hidden, ordered)

    def sample(self, hidden: torch.Tensor, ordered: list[ScheduledChunk]) -> dict[str, SampledToken]:
        """Sample for the chunks that ask for it, from `hidden` [T, hidden]: row i is `ordered`'s i-th token."""
        sample_rows, sample_chunks, offset = [], [], 0
        for chunk in ordered:
            offset += len(chunk.token_ids)
            if chunk.sample:
                sample_rows.append(offset - 1)
                sample_chunks.append(chunk)
        if not sample_chunks:
            return {}
        if len(sample_rows) < hidden.shape[0]:  # else every token is a sampled decode: all rows, in order
            hidden = hidden.index_select(0, self._on_device(int64_tensor(sample_rows)))
        logits = self.model.compute_logits(hidden)
        rows = [SamplingRow(c.sampling_params, c.prompt_token_ids, c.output_token_ids) for c in sample_chunks]
        sampled = self.sampler(logits, rows)
        return {
            c.request_id: SampledToken(t, lp)
            for c, t, lp in zip(sample_chunks, sampled.token_ids, sampled.logprobs)
        }

    def prepare_inputs(self, ordered: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten decodes-then-prefills into input ids, positions, slots and attention metadata."""
        bs = self.block_size
        decodes = [c for c in ordered if len(c.token_ids) == 1]
        input_ids = [c.token_ids[0] for c in decodes]
        positions = [c.start_position for c in decodes]
        slots = [c.block_ids[pos // bs] * bs + pos % bs for c, pos in zip(decodes, positions)]
        decode_block_ids = decode_mask = decode_context_lens = None
        if decodes:
            width = max(len(c.block_ids) for c in decodes)
            padded: list[int] = []
            for c in decodes:
                padded += c.block_ids
                padded += [0] * (width - len(c.block_ids))
            decode_block_ids = self._on_device(int64_tensor(padded))
            if self.device.type == "cpu":  # the torch twin takes a mask
                context_lens = int64_tensor([pos + 1 for pos in positions])
                past_end = torch.arange(width * bs) >= context_lens.unsqueeze(1)
                decode_mask = torch.zeros(past_end.shape).masked_fill_(past_end, float("-inf"))
            else:  # the Triton kernel takes lengths (engine/kernels/decode_attention.py)
                decode_context_lens = torch.tensor([pos + 1 for pos in positions], dtype=torch.int32).to(self.device)

        prefills = []
        for c in ordered[len(decodes) :]:
            num_q = len(c.token_ids)
            num_ctx = c.start_position + num_q
            table = c.block_ids[: -(-num_ctx // bs)]
            prefills.append(PrefillChunk(len(input_ids), num_q, num_ctx, self._on_device(int64_tensor(table))))
            input_ids += c.token_ids
            positions += range(c.start_position, num_ctx)
            slots += [table[pos // bs] * bs + pos % bs for pos in range(c.start_position, num_ctx)]

        meta = AttentionMetadata(
            slot_mapping=self._on_device(int64_tensor(slots)),
            num_decode_tokens=len(decodes),
            decode_block_ids=decode_block_ids,
            decode_mask=decode_mask,
            prefills=prefills,
            decode_context_lens=decode_context_lens,
        )
        return self._on_device(int64_tensor(input_ids)), self._on_device(int64_tensor(positions)), meta

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host-built step tensor on the model's device (as it is, on CPU)."""
        return t if self.device.type == "cpu" else t.to(self.device)


def int64_tensor(values: list[int]) -> torch.Tensor:
    """`torch.tensor(values, dtype=torch.int64)`, 3x faster from a few dozen values on: one buffer copy
    instead of a Python-object conversion per element (0.37 us each here; a step at batch 64 makes ~600)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)  # the tensor keeps the array alive
