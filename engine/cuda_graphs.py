"""Static-shape decode steps, captured once per batch-size bucket in CUDA graphs and replayed each step.

A decode step of a small model on a GPU is mostly kernel-launch time: hundreds of small kernels whose
launches cost more than their math. A CUDA graph replays the whole forward with one launch, but it
replays fixed shapes and fixed addresses. So a decode-only step (every chunk one token) of n sequences,
n <= the largest bucket, is padded to the next bucket size b >= n and run on static buffers, sized once
for the largest bucket; bucket b reads their first b rows:

    rows          [4, B_max] int64    0: input ids   1: positions   2: slots   3: context lengths
    block_tables  [B_max, max_blocks_per_seq] int64, max_blocks_per_seq = cdiv(max_model_len, block_size)

    row i < n        the step's i-th chunk: its token, position, slot, position + 1, its block table
    row n <= i < b   padding: token 0 at position 0, slot SCRATCH = scratch_block * block_size,
                     length 1, a table of the scratch block alone

The scratch block is one KV block past the pool's (`build_runtime` allocates num_blocks + 1): the pool
never hands it out, so no request's K/V lives there, and the padding rows write and read only it. Their
hidden rows are never sampled. Columns of a real row past its own blocks may hold ids left by an earlier
step: they are valid ids, never read by the Triton kernel (it stops at the row's length) and masked by
the torch twin. Decode attention gets static shapes: a full-width block table and lengths from a tensor.

On CUDA, `capture` records one graph per bucket, largest first, all in one memory pool (each graph's
activations reuse the previous one's memory); `load_inputs` copies the step's rows in and `run_bucket`
replays. Off CUDA `capture` is a no-op and the same static buffers run eagerly, so the padding, bucketing
and scratch slot are tested on CPU (tests/test_cuda_graphs.py) against the plain runner.

A `GraphReplayer` is a part of the one `ModelRunner` (engine/model_runner.py), which asks it first: steps
with a prefill chunk, more sequences than the largest bucket, or a per-layer callback (a prefill worker
shipping KV) run eagerly there instead, and the runner samples either way. Tensor parallelism (tp_size > 1)
always runs eagerly: the followers run the unpadded step, so `build_runtime` adds a replayer only at
tp_size 1 and `ModelRunner` refuses the two together.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.kernels.decode_attention import mask_from_context_lens, twin_runs
from engine.kv_cache_manager import cdiv
from engine.model import KVCache, LlamaForCausalLM
from engine.scheduler import ScheduledChunk

log = logging.getLogger("duet.engine")

SCRATCH_BLOCKS = 1  # KV blocks past the pool's: the first is the static decode's scratch block
_IDS, _POSITIONS, _SLOTS, _LENS = range(4)  # rows of GraphReplayer.rows


def default_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, ... (powers of two, and their midpoints from 16 on), up to
    max_num_seqs, which is always the last: each bucket pads at most a third of its rows from 16 on."""
    sizes, power = [1, 2, 4, 8], 16
    while power < max_num_seqs:
        sizes += [power, power + power // 2]
        power *= 2
    return tuple(sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs}))


def batch_sizes_for(config: EngineConfig) -> tuple[int, ...]:
    """The buckets for an engine: `cuda_graph_batch_sizes` (sorted, those above max_num_seqs dropped, as no
    step is that big) or the default series up to max_num_seqs."""
    if config.cuda_graph_batch_sizes is None:
        return default_batch_sizes(config.max_num_seqs)
    sizes = sorted({s for s in config.cuda_graph_batch_sizes if s <= config.max_num_seqs})
    return tuple(sizes) or (config.max_num_seqs,)


def bucket_for(num_seqs: int, batch_sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds `num_seqs` rows (sorted `batch_sizes`), or None if none does."""
    i = bisect.bisect_left(batch_sizes, num_seqs)
    return batch_sizes[i] if i < len(batch_sizes) else None


class GraphReplayer:
    """Runs decode-only steps padded to a bucket on static buffers: replaying a CUDA graph per bucket after
    `capture` on CUDA, eagerly elsewhere. Hidden states out; the `ModelRunner` that owns it samples.

    `kv_caches` must hold `scratch_block` (one block no request ever owns) besides the pool's blocks.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int, *,
                 batch_sizes: Sequence[int], max_blocks_per_seq: int, scratch_block: int):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = kv_caches[0][0].device
        num_cache_blocks = kv_caches[0][0].shape[1]
        if not 0 <= scratch_block < num_cache_blocks:
            raise ValueError(f"scratch_block={scratch_block} is invalid: must be a block of the caches, "
                             f"in [0, {num_cache_blocks})")
        if not batch_sizes or list(batch_sizes) != sorted(set(batch_sizes)) or batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes={tuple(batch_sizes)} is invalid: must be distinct ints >= 1, ascending")
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq={max_blocks_per_seq} is invalid: must be >= 1")
        self.batch_sizes = tuple(batch_sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        max_batch = self.batch_sizes[-1]
        self.rows = torch.zeros((4, max_batch), dtype=torch.int64, device=self.device)
        self.block_tables = torch.full((max_batch, max_blocks_per_seq), scratch_block, dtype=torch.int64,
                                       device=self.device)
        self._load_padding(0, max_batch)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # each graph's hidden states [bucket, hidden]: static too

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def capture(self) -> None:
        """Record one CUDA graph per bucket (largest first, one shared memory pool), each after an eager
        warm-up run (Triton compiles its kernels there: a capture must not). No-op off CUDA. Call it before
        serving, while no other thread uses the device; the capture runs on padding rows, so it writes
        only the scratch block."""
        if self.device.type != "cuda" or self._graphs:
            return
        self._load_padding(0, self.batch_sizes[-1])
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bucket in reversed(self.batch_sizes):
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    self._forward(bucket)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[bucket] = self._forward(bucket)
                self._graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        log.info("engine event=cuda_graphs_captured batch_sizes=%s", ",".join(map(str, self.batch_sizes)))

    def bucket_for_step(self, chunks: list[ScheduledChunk]) -> int | None:
        """The bucket this step pads to, or None when it runs eagerly (a prefill chunk, one with guesses, too many
        sequences, or a block table wider than the static one)."""
        if not chunks:
            return None
        for c in chunks:
            if len(c.token_ids) != 1 or c.proposed_token_ids or len(c.block_ids) > self.max_blocks_per_seq:
                return None
        return bucket_for(len(chunks), self.batch_sizes)

    def load_inputs(self, chunks: list[ScheduledChunk], bucket: int) -> None:
        """Copy the step's decodes into rows [0, n) of the static buffers and padding into [n, bucket).

        Two host-to-device copies: the four per-row values, and the block tables as wide as this step's
        widest (columns past it keep older valid ids, which no row reads: see the module docstring).
        """
        bs, n = self.block_size, len(chunks)
        positions = [c.start_position for c in chunks]
        slots = [c.block_ids[pos // bs] * bs + pos % bs for c, pos in zip(chunks, positions)]
        pad = bucket - n
        values = ([c.token_ids[0] for c in chunks] + [0] * pad) + (positions + [0] * pad) + \
            (slots + [self.scratch_slot] * pad) + ([pos + 1 for pos in positions] + [1] * pad)
        self.rows[:, :bucket].copy_(torch.tensor(values, dtype=torch.int64).view(4, bucket))
        width = max(len(c.block_ids) for c in chunks)
        table: list[int] = []
        for c in chunks:
            table += c.block_ids
            table += [self.scratch_block] * (width - len(c.block_ids))
        table += [self.scratch_block] * (width * pad)
        self.block_tables[:bucket, :width].copy_(torch.tensor(table, dtype=torch.int64).view(bucket, width))

    def run_bucket(self, bucket: int) -> torch.Tensor:
        """Hidden states [bucket, hidden] of the loaded rows: the graph's replay (its static output, valid
        until the next replay) when captured, else an eager run of the same static step."""
        graph = self._graphs.get(bucket)
        if graph is None:
            return self._forward(bucket)
        graph.replay()
        return self._outputs[bucket]

    def _forward(self, bucket: int) -> torch.Tensor:
        """The static step: the model over rows [0, bucket) of the buffers, attention over full-width tables."""
        rows = self.rows[:, :bucket]
        tables = self.block_tables[:bucket]
        context_lens = rows[_LENS].to(torch.int32)
        # the twin (CUDA without triton) takes a mask: build it once here, not once per layer
        twin = twin_runs(self.kv_caches[0][0].dtype, tables.device)
        mask = mask_from_context_lens(rows[_LENS], tables.shape[1] * self.block_size) if twin else None
        meta = AttentionMetadata(
            slot_mapping=rows[_SLOTS],
            num_decode_tokens=bucket,
            decode_block_ids=tables.reshape(-1),  # rows of a contiguous table: a view
            decode_mask=mask,
            prefills=[],
            decode_context_lens=context_lens,
        )
        return self.model(rows[_IDS], rows[_POSITIONS], self.kv_caches, meta)

    def _load_padding(self, start: int, stop: int) -> None:
        """Rows [start, stop) as padding: token 0 at position 0 into the scratch slot, length 1."""
        self.rows[:, start:stop] = torch.tensor([0, 0, self.scratch_slot, 1], device=self.device).unsqueeze(1)
        self.block_tables[start:stop] = self.scratch_block


def static_decode_enabled(config: EngineConfig, device: torch.device) -> bool:
    """Whether `build_runtime` gives a CUDA engine's runner a graph replayer for its decode steps."""
    return device.type == "cuda" and config.cuda_graphs and config.tp_size == 1


def make_graph_replayer(model: LlamaForCausalLM, kv_caches: list[KVCache], config: EngineConfig,
                        max_model_len: int, scratch_block: int) -> GraphReplayer:
    """The graph replayer for an engine (not yet captured): buckets from `config`, tables as wide as a
    `max_model_len` sequence needs."""
    return GraphReplayer(model, kv_caches, config.block_size, batch_sizes=batch_sizes_for(config),
                         max_blocks_per_seq=cdiv(max_model_len, config.block_size), scratch_block=scratch_block)
