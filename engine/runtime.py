"""The model runtime one worker holds: model, tokenizer, KV pool, block tables, scheduler, runner.

`LLMEngine` (offline), the prefill worker and the decode worker each build one with `build_runtime` and
drive it through one `EngineCore` (engine/engine_core.py); the parts, and how their sizes are derived,
are the same everywhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig, ModelConfig, parse_dtype, resolve_device
from engine.cpu_allocator import reuse_freed_memory
from engine.cuda_graphs import SCRATCH_BLOCKS, make_graph_replayer, static_decode_enabled
from engine.drafter import Drafter, build_drafter, draft_kv_bytes_per_block
from engine.errors import ModelLoadError
from engine.grammar_compiler import GrammarCompiler
from engine.kernels.cpu_native import native_library
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.linear_fast import linear_fast_paths
from engine.memory_budget import device_memory, kv_cache_budget_bytes
from engine.model import KVCache, LlamaForCausalLM
from engine.model_runner import ModelRunner, allocate_kv_caches, kv_bytes_per_block
from engine.quantization import memory_report, weight_bytes_by_kind
from engine.sampler import Sampler
from engine.scheduler import Scheduler, SchedulerConfig
from engine.speculation import Speculator
from engine.speculative_config import SpeculativeConfig
from engine.tokenizer import Tokenizer
from engine.weights import build_model, planned_weight_bytes

if TYPE_CHECKING:
    from engine.tp_runner import TPDriver

log = logging.getLogger("duet.engine")


@dataclass
class Runtime:
    config: EngineConfig
    model_dir: Path
    model_config: ModelConfig
    model_id: str
    dtype: torch.dtype
    tokenizer: Tokenizer
    model: LlamaForCausalLM
    max_model_len: int  # prompt + output tokens of one sequence
    num_kv_blocks: int
    block_pool: BlockPool
    kv_cache: KVCacheManager
    scheduler: Scheduler
    kv_caches: list[KVCache]
    runner: ModelRunner
    followers: list = field(default_factory=list)  # tensor-parallel ranks 1..N-1 (processes)
    tp_driver: TPDriver | None = None  # rank 0's control link to `followers` (None at tp_size 1)
    grammar_compiler: GrammarCompiler | None = None  # structured output (rank 0 samples, so only it needs one)
    drafter: Drafter | None = None  # speculative decoding with a draft model (engine/drafter.py)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def draft_ships_kv(self) -> bool:
        """With a draft model, in a cluster its prompt KV travels with the target's, whatever its shape
        (kvtransfer/layout.py numbers the draft's layers after the target's). At tp_size > 1 the draft runs whole on
        rank 0 (`build_runtime`) beside rank 0's shard of the target, so only rank 0 ships and receives it."""
        return self.drafter is not None

    @property
    def transfer_caches(self) -> list[KVCache]:
        """The caches KV transfer moves, layer by layer: the target's, then the draft's if it travels."""
        return self.kv_caches + (self.drafter.runner.kv_caches if self.draft_ships_kv else [])

    @property
    def transfer_draft_caches(self) -> list[KVCache]:
        """The draft's part of `transfer_caches` (empty when none travels)."""
        return self.drafter.runner.kv_caches if self.draft_ships_kv else []

    @property
    def tp_size(self) -> int:
        return self.config.tp_size

    def call_followers(self, op: object) -> bool:
        """Run a serving worker's operation `op` (a frozen dataclass, engine/follower_ops.py) on every
        tensor-parallel follower rank (engine/tp_runner.py's CALL); True iff every rank ran it (the failing
        ranks and how they failed are logged). At tp_size 1: True, and `op` goes nowhere."""
        if not self.followers:
            return True
        return self.tp_driver.call_followers(op).ok

    def close(self) -> None:
        """Stop the tensor-parallel followers (no-op at tp_size 1). Idempotent."""
        if not self.followers:
            return
        from engine.tp_runner import close_group

        close_group(self.tp_driver, self.followers)
        self.followers = []


def kv_cache_bytes(config: EngineConfig, model_config: ModelConfig, model_dir: Path, dtype: torch.dtype,
                   device: torch.device, draft: SpeculativeConfig | None = None) -> int:
    """The KV cache's budget: `kv_cache_bytes`, or what `kv_cache_memory_fraction` of the device leaves after this
    rank's weights as they will be held (quantized ones packed), a draft model's too. Raises ModelLoadError when
    the fraction leaves nothing."""
    if config.kv_cache_memory_fraction is None:
        return config.kv_cache_bytes
    weights = planned_weight_bytes(model_config, model_dir, dtype, config.tp_size, config.quantization)
    if draft is not None:
        draft_path = Path(draft.model)
        weights += planned_weight_bytes(ModelConfig.from_path(draft_path), draft_path, dtype, 1, draft.quantization)
    try:
        return kv_cache_budget_bytes(config.kv_cache_memory_fraction, device_memory(device), weights)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None


def build_runtime(model_dir: str | Path, config: EngineConfig, follower_module: str = "engine.tp_worker",
                  follower_argv: list[str] | tuple = ()) -> Runtime:
    """Load the checkpoint at `model_dir` (a Hugging Face checkpoint directory or a .gguf file) and size the
    KV cache. Raises `ModelLoadError` naming what is wrong.
    At tp_size > 1 the follower ranks run `python -m follower_module` with `follower_argv` added (a serving
    worker's followers also run their share of KV transfer)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_dir = Path(model_dir)
    model_config = ModelConfig.from_path(model_dir)
    device = resolve_device(config.device)
    dtype = parse_dtype(config.dtype) if config.dtype else model_config.torch_dtype
    tokenizer = Tokenizer.from_path(model_dir)
    model_id = config.model_id or model_dir.resolve().name

    max_model_len = config.max_model_len or model_config.max_position_embeddings
    if config.max_model_len and config.max_model_len > model_config.max_position_embeddings:
        raise ModelLoadError(
            f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings="
            f"{model_config.max_position_embeddings}"
        )
    if model_config.sliding_window and model_config.sliding_window < max_model_len:
        max_model_len = model_config.sliding_window  # full attention is exact only inside the window
    max_positions = max_model_len
    if config.tp_size > 1:
        from engine.tensor_parallel import local_config, plan_shard

        layer_config = local_config(model_config, plan_shard(model_config, 0, config.tp_size))
    else:
        layer_config = model_config
    element_bytes = torch.empty((), dtype=dtype).element_size()
    block_bytes = 2 * layer_config.num_layers * config.block_size * layer_config.num_kv_heads * \
        layer_config.head_dim * element_bytes  # this rank's shard of one block
    speculative = SpeculativeConfig.parse(config.speculative_config)
    draft = speculative if speculative is not None and speculative.method == "draft_model" else None
    pool_block_bytes = block_bytes + (draft_kv_bytes_per_block(draft, dtype, config.block_size) if draft else 0)
    num_blocks = config.num_kv_blocks or max(
        1, min(kv_cache_bytes(config, model_config, model_dir, dtype, device, draft) // pool_block_bytes,
               config.max_num_seqs * cdiv(max_model_len, config.block_size))
    )
    if num_blocks * config.block_size < max_model_len:
        max_model_len = num_blocks * config.block_size  # one sequence must always fit
    followers: list = []
    if config.tp_size > 1:
        from engine.tp_runner import start_group

        model, followers, control = start_group(model_config, model_dir, dtype, max_positions, num_blocks, config,
                                                follower_module, follower_argv, device)
        weights_by_kind = weight_bytes_by_kind(model)  # rank 0's shard
    else:
        model = build_model(model_config, model_dir, dtype, max_positions=max_positions, device=device,
                            quantization=config.quantization)
        # after loading (and any sharding): transformations of the plain model
        linear_fast_paths(model, config.fast_linears, config.quantized_activations)
        weights_by_kind = weight_bytes_by_kind(model)
    assert kv_bytes_per_block(model, config.block_size, dtype) == block_bytes
    if torch.device(device).type == "cpu":
        native_library()  # build (first run) or load the C kernels now, not inside the first request's step

    block_pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
    kv_cache = KVCacheManager(block_pool, model_id)
    scheduler = Scheduler(
        SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len), kv_cache,
        Speculator(speculative, max_model_len) if speculative is not None else None,
    )
    # the pool's blocks and, past them, a scratch block no request owns (engine/cuda_graphs.py pads into it)
    kv_caches = allocate_kv_caches(model, num_blocks + SCRATCH_BLOCKS, config.block_size, dtype, device)
    tp_driver = replayer = None
    if followers:
        from engine.tp_runner import TPDriver

        tp_driver = TPDriver(config.block_size, control)
    elif static_decode_enabled(config, device):  # CUDA, tp_size 1: decode steps replay CUDA graphs
        replayer = make_graph_replayer(model, kv_caches, config, max_model_len, scratch_block=num_blocks)
        replayer.capture()
    runner = ModelRunner(model, kv_caches, config.block_size, Sampler(config.seed), graph_replayer=replayer,
                         step_broadcaster=tp_driver)
    drafter = None
    # A draft model runs whole (unsharded) in this process at any tp_size, as vLLM's draft_tensor_parallel_size=1:
    # rank 0 schedules and samples, so the guesses are made where they are verified, with no all-reduce a draft
    # layer. Its KV blocks mirror the target's, scratch blocks included.
    if draft is not None:
        drafter = build_drafter(draft, model_config, tokenizer, dtype, device, max_positions,
                                num_blocks + SCRATCH_BLOCKS, config.block_size, config.seed, config.fast_linears)
    if device.type == "cpu":
        reuse_freed_memory()  # after the long-lived weights and KV cache: only step temporaries are affected
    log.info(
        "engine model=%s dtype=%s device=%s blocks=%d block_size=%d max_model_len=%d tp=%d quantization=%s",
        model_id, str(dtype).removeprefix("torch."), device, num_blocks, config.block_size, max_model_len,
        config.tp_size, config.quantization,
    )
    if drafter is not None:
        for kind, num_bytes in weight_bytes_by_kind(drafter.runner.model).items():
            weights_by_kind[kind] = weights_by_kind.get(kind, 0) + num_bytes
    log.info("engine memory %s", memory_report(weights_by_kind, num_blocks * pool_block_bytes))
    return Runtime(
        config=config, model_dir=model_dir, model_config=model_config, model_id=model_id, dtype=dtype,
        tokenizer=tokenizer, model=model, max_model_len=max_model_len, num_kv_blocks=num_blocks,
        block_pool=block_pool, kv_cache=kv_cache, scheduler=scheduler, kv_caches=kv_caches, runner=runner,
        followers=followers, tp_driver=tp_driver, grammar_compiler=GrammarCompiler(tokenizer, model_config.vocab_size),
        drafter=drafter,
    )
