"""Turns a step's scheduled chunks into tensors, runs the model, samples.

It never sees a request: only `ScheduledChunk`s (tokens, positions, block table, sampling params)
in, and the tokens (plus logprobs) each sampled chunk gained out. It owns the KV cache tensors.

One runner serves every engine; what differs between them are parts it composes, each optional:

    execute(chunks)
      ├─ graph_replayer (CUDA, tp_size 1): a decode-only step that fits a bucket replays a captured
      │    CUDA graph on padded static buffers (engine/cuda_graphs.py) ─────────────────────┐
      └─ else eagerly: prepare_inputs                                                       │
           ├─ step_broadcaster (tp_size > 1): the packed step goes to the follower ranks    │
           │    first, so they run the same forward in lockstep (engine/tp_runner.py)       │
           ├─ fused decode (CPU, a decode-only step, C linears): the layers in one C call   │
           │    (engine/fused_decode.py), the logits in one more (then the sampler); a step │
           │    whose sampling is only each row's argmax (Sampler.reduces_to_argmax) gets   │
           │    its tokens from that call instead, no `sample`                              │
           └─ else the model forward (CPU fast paths in the model: engine/linear_fast.py)   │
      sample: logits of the rows that sample ─▶ Sampler.sample, once, on this rank ◀────────┘
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Protocol

import torch

from engine.attention import AttentionMetadata, PrefillChunk
from engine.cuda_graphs import GraphReplayer
from engine.fused_decode import FusedDecode
from engine.kernels.decode_attention import mask_from_context_lens, twin_runs
from engine.model import KVCache, LlamaForCausalLM
from engine.sampler import SampledTokens, Sampler, SamplingRow
from engine.scheduler import ScheduledChunk


class StepBroadcaster(Protocol):
    """Rank 0's link to tensor-parallel followers (engine/tp_runner.py's `TPDriver`)."""

    def broadcast_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       sample_rows: list[int]) -> None:
        """Send one eager step to every follower, which runs the same forward (and joins the logits
        all-gather for `sample_rows`) right after; call it just before this rank's forward."""


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
    """Executes one step's chunks: `execute` is the contract; the parts are described in the module docstring.

    `graph_replayer` and `step_broadcaster` cannot be combined (ValueError): the followers would run the
    unpadded eager step while rank 0 replayed a padded one, and their collectives would not match.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int, sampler: Sampler, *,
                 graph_replayer: GraphReplayer | None = None, step_broadcaster: StepBroadcaster | None = None):
        if graph_replayer is not None and step_broadcaster is not None:
            raise ValueError("graph_replayer and step_broadcaster are invalid together: CUDA-graph replay runs "
                             "at tp_size 1 only")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.graph_replayer = graph_replayer
        self.step_broadcaster = step_broadcaster
        self.device = kv_caches[0][0].device
        self._twin_attention = twin_runs(kv_caches[0][0].dtype, self.device)  # decode steps need the twin's mask
        self._fused_decode: FusedDecode | None | bool = False  # built on the first decode step (False: not yet)

    @torch.inference_mode()
    def execute(
        self, chunks: list[ScheduledChunk], on_layer_done: Callable[[int], None] | None = None
    ) -> dict[str, SampledTokens]:
        """Compute the chunks' KV (written to the cache) and sample for the chunks that ask for it: their
        request ids map to the tokens they gained. A chunk's proposed tokens are computed after its tokens and
        verified by the sampler (the tokens it gains: the accepted ones and one more).

        `on_layer_done(i)` is called as soon as layer i's K/V for every chunk is in the cache (such a step
        always runs eagerly).
        """
        if not chunks:
            return {}
        replayer = self.graph_replayer
        bucket = replayer.bucket_for_step(chunks) if replayer is not None and on_layer_done is None else None
        if bucket is not None:
            replayer.load_inputs(chunks, bucket)
            hidden = replayer.run_bucket(bucket)  # valid until the next replay: sampled from right below
            return self.sample(hidden[: len(chunks)], chunks)
        ordered = [c for c in chunks if _is_decode(c)] + [c for c in chunks if not _is_decode(c)]
        input_ids, positions, meta = self.prepare_inputs(ordered)
        if self.step_broadcaster is not None:
            self.step_broadcaster.broadcast_step(input_ids, positions, meta, sample_rows(ordered)[0])
        fused = self._fused_decode_for(input_ids, meta) if on_layer_done is None else None
        if fused is not None:  # a decode-only step on CPU with C linears: one C call for the layers
            if fused.takes_lm_head(input_ids.shape[0]) and all(c.sample for c in ordered):  # and one for the logits
                if self._only_argmax(ordered):  # or for the tokens, where sampling is their argmax alone
                    token_ids = fused.argmax(input_ids, positions, meta)
                    return {c.request_id: SampledTokens([t], None) for c, t in zip(ordered, token_ids, strict=True)}
                return self._draw(fused.logits(input_ids, positions, meta), ordered)  # every row is sampled
            hidden = fused(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, on_layer_done)
        return self.sample(hidden, ordered)

    def _fused_decode_for(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> FusedDecode | None:
        """engine/fused_decode.py's fast path where it applies to this model and step (bound on first use, after
        every transformation of the loaded model)."""
        if self.step_broadcaster is not None or meta.num_decode_tokens != input_ids.shape[0]:
            return None
        if self._fused_decode is False:
            self._fused_decode = FusedDecode.for_model(self.model, self.kv_caches)
        fused = self._fused_decode
        return fused if fused is not None and fused.applies_to(meta, input_ids.shape[0]) else None

    def sample(self, hidden: torch.Tensor, ordered: list[ScheduledChunk]) -> dict[str, SampledTokens]:
        """Sample for the chunks that ask for it, from `hidden` [T, hidden]: row i is `ordered`'s i-th token (a chunk's
        proposed tokens after its own). A chunk with k proposed tokens samples from k + 1 rows."""
        rows, sample_chunks = sample_rows(ordered)
        if not sample_chunks:
            return {}
        if len(rows) < hidden.shape[0]:  # else every token is a sampled decode: all rows, in order
            hidden = hidden.index_select(0, self._on_device(int64_tensor(rows)))
        return self._draw(self.model.compute_logits(hidden), sample_chunks)

    def _draw(self, logits: torch.Tensor, sample_chunks: list[ScheduledChunk]) -> dict[str, SampledTokens]:
        """The sampler's tokens for `sample_chunks` from their rows' logits (`sample_rows`' order)."""
        sampling_rows = [_sampling_row(c) for c in sample_chunks]
        return {c.request_id: s for c, s in zip(sample_chunks, self.sampler.sample(logits, sampling_rows))}

    def _only_argmax(self, ordered: list[ScheduledChunk]) -> bool:
        """Whether every token of the step (each chunk samples) is sampled by the argmax of its raw logits alone, one
        per chunk (no proposals: `Sampler.reduces_to_argmax`)."""
        return self.sampler.reduces_to_argmax([_sampling_row(c) for c in ordered])

    def prepare_inputs(self, ordered: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten decodes-then-prefills into input ids, positions, slots and attention metadata.

        A decoding chunk's proposed tokens are decode rows too, one per token, each over the chunk's block table
        up to its own position: every row's K/V is stored before any row attends (engine/attention.py), so row j
        sees the rows before it, which is causal attention over the guesses. So a verification step takes the
        decode paths (the CPU's fused layers, the decode kernels), not the prefill one."""
        bs = self.block_size
        decodes = [c for c in ordered if _is_decode(c)]
        tables = [c.block_ids for c in decodes for _ in range(_width(c))]  # one per decode row
        input_ids = [t for c in decodes for t in (c.token_ids + c.proposed_token_ids if c.proposed_token_ids
                                                  else c.token_ids)]
        positions = [c.start_position + j for c in decodes for j in range(_width(c))]
        slots = [table[pos // bs] * bs + pos % bs for table, pos in zip(tables, positions)]
        decode_block_ids = decode_mask = decode_context_lens = None
        if decodes:
            width = max(len(table) for table in tables)
            padded: list[int] = []
            for table in tables:
                padded += table
                padded += [0] * (width - len(table))
            decode_block_ids = self._on_device(int64_tensor(padded))
            decode_context_lens = self._on_device(int32_tensor([pos + 1 for pos in positions]))
            if self._twin_attention:  # built once here, not once a layer
                decode_mask = mask_from_context_lens(decode_context_lens, width * bs)

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
            num_decode_tokens=len(tables),
            decode_block_ids=decode_block_ids,
            decode_mask=decode_mask,
            prefills=prefills,
            decode_context_lens=decode_context_lens,
        )
        return self._on_device(int64_tensor(input_ids)), self._on_device(int64_tensor(positions)), meta

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host-built step tensor on the model's device (as it is, on CPU)."""
        return t if self.device.type == "cpu" else t.to(self.device)


def sample_rows(ordered: list[ScheduledChunk]) -> tuple[list[int], list[ScheduledChunk]]:
    """(rows, chunks): the hidden-state rows each sampling chunk samples from when `ordered`'s tokens are laid out
    in order (its last token's, then each proposed token's), and those chunks."""
    rows, chunks, offset = [], [], 0
    for chunk in ordered:
        offset += _width(chunk)
        if chunk.sample:
            num_proposed = len(chunk.proposed_token_ids)
            rows.extend(range(offset - 1 - num_proposed, offset))
            chunks.append(chunk)
    return rows, chunks


def _sampling_row(chunk: ScheduledChunk) -> SamplingRow:
    return SamplingRow(chunk.sampling_params, chunk.prompt_token_ids, chunk.output_token_ids,
                       chunk.proposed_token_ids, chunk.eos_token_ids, chunk.grammar,
                       chunk.proposal_probs if chunk.proposed_token_ids else None)


def _width(chunk: ScheduledChunk) -> int:
    """Tokens the step computes for a chunk: its own and its proposed ones."""
    return len(chunk.token_ids) + len(chunk.proposed_token_ids)


def _is_decode(chunk: ScheduledChunk) -> bool:
    """A decoding chunk: one known token (and maybe guesses after it); its tokens are decode rows."""
    return len(chunk.token_ids) == 1


def int64_tensor(values: list[int]) -> torch.Tensor:
    """`torch.tensor(values, dtype=torch.int64)`, 3x faster from a few dozen values on: one buffer copy
    instead of a Python-object conversion per element (0.37 us each here; a step at batch 64 makes ~600)."""
    return _host_tensor(values, "q", torch.int64)


def int32_tensor(values: list[int]) -> torch.Tensor:
    """`int64_tensor`'s int32 twin."""
    return _host_tensor(values, "i", torch.int32)


def _host_tensor(values: list[int], typecode: str, dtype: torch.dtype) -> torch.Tensor:
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(typecode, values), dtype=dtype)  # the tensor keeps the array alive
