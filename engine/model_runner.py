"""Turns a step's scheduled chunks into tensors, runs the model, samples.

It never sees a request: only `ScheduledChunk`s (tokens, positions, block table, sampling params)
in, and a token (plus logprobs) per sampled request out. It owns the KV cache tensors.
"""

from __future__ import annotations

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


def allocate_kv_caches(model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype) -> list[KVCache]:
    """Zeroed (never NaN: padded gathers read unused slots, and 0 * NaN would poison the sum)."""
    cfg = model.config
    shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)  # head-major: see engine/attention.py
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)]


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

        sample_rows, sample_chunks, offset = [], [], 0
        for chunk in ordered:
            offset += len(chunk.token_ids)
            if chunk.sample:
                sample_rows.append(offset - 1)
                sample_chunks.append(chunk)
        if not sample_chunks:
            return {}
        logits = self.model.compute_logits(hidden[sample_rows])
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
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for c in decodes:
            pos = c.start_position
            input_ids.append(c.token_ids[0])
            positions.append(pos)
            slots.append(c.block_ids[pos // bs] * bs + pos % bs)
        decode_block_ids = decode_mask = None
        if decodes:
            width = max(len(c.block_ids) for c in decodes)
            padded: list[int] = []
            for c in decodes:
                padded += c.block_ids
                padded += [0] * (width - len(c.block_ids))
            decode_block_ids = torch.tensor(padded)
            context_lens = torch.tensor([c.start_position + 1 for c in decodes])
            past_end = torch.arange(width * bs) >= context_lens.unsqueeze(1)
            decode_mask = torch.zeros(past_end.shape).masked_fill_(past_end, float("-inf"))

        prefills = []
        prefill_slots = []
        for c in ordered[len(decodes) :]:
            num_q = len(c.token_ids)
            num_ctx = c.start_position + num_q
            table = torch.tensor(c.block_ids[: -(-num_ctx // bs)])
            pos = torch.arange(c.start_position, num_ctx)
            prefills.append(PrefillChunk(len(input_ids), num_q, num_ctx, table))
            input_ids.extend(c.token_ids)
            positions.extend(range(c.start_position, num_ctx))
            prefill_slots.append(table[pos // bs] * bs + pos % bs)

        slot_mapping = torch.tensor(slots, dtype=torch.int64)
        if prefill_slots:
            slot_mapping = torch.cat([slot_mapping, *prefill_slots])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=len(decodes),
            decode_block_ids=decode_block_ids,
            decode_mask=decode_mask,
            prefills=prefills,
        )
        return torch.tensor(input_ids), torch.tensor(positions), meta
