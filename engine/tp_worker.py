"""A follower rank of a tensor-parallel engine: `python -m engine.tp_worker --rank R --size N ...`.

Started by rank 0 (engine/tp_runner.spawn_followers) with the engine settings rank 0 resolved, as one JSON
`EngineConfig` (`--engine-config`), so every rank sizes its KV cache shard identically; it loads only its
shard of the checkpoint, then runs whatever steps rank 0 broadcasts until told to stop or a collective
fails (rank 0 gone): then it exits.
A serving worker's followers run `<role>_worker.tp_rank` (worker/tp_rank.py), which adds the worker's share of
KV transfer as hooks.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from engine.config import EngineConfig, ModelConfig, parse_dtype
from engine.cpu_allocator import reuse_freed_memory
from engine.linear_fast import linear_fast_paths
from engine.model_runner import allocate_kv_caches
from engine.tensor_parallel import TPGroup
from engine.tp_runner import FollowerHooks, follow, init_group
from engine.weights import build_model

log = logging.getLogger("duet.tp")


MakeHooks = Callable[[argparse.Namespace, list, list, torch.dtype], FollowerHooks]  # (args, model, caches, dtype)


def engine_arg_parser() -> argparse.ArgumentParser:
    """The follower's command line, as engine/tp_runner.spawn_followers writes it: rank, group size,
    rendezvous, checkpoint, and the engine settings rank 0 resolved as one JSON argument."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--engine-config", type=_resolved_config, required=True,
                   help="EngineConfig.to_json() with dtype, num_kv_blocks and max_model_len (the positions the "
                        "model covers) resolved, and device cpu or cuda (this rank runs on cuda:<rank>)")
    return p


def _resolved_config(text: str) -> EngineConfig:
    try:
        config = EngineConfig.from_json(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"--engine-config is invalid: {e}") from None
    unresolved = [n for n in ("dtype", "num_kv_blocks", "max_model_len") if getattr(config, n) is None]
    if unresolved:
        raise argparse.ArgumentTypeError(f"--engine-config is invalid: {', '.join(unresolved)} must be resolved "
                                         "by rank 0, not None")
    if config.device not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"--engine-config is invalid: device={config.device!r} must be resolved "
                                         "by rank 0 to cpu or cuda")
    return config


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None,
         make_hooks: MakeHooks | None = None) -> int:
    args = (parser or engine_arg_parser()).parse_args(argv)
    config: EngineConfig = args.engine_config
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = torch.device("cuda", args.rank) if config.device == "cuda" else torch.device("cpu")
    control = init_group(args.rank, args.size, args.init_method, device=device)
    hooks = None
    try:
        model_config = ModelConfig.from_path(args.model)
        dtype = parse_dtype(config.dtype)
        tp = TPGroup(args.rank, args.size)
        model = build_model(model_config, args.model, dtype, config.max_model_len, device, tp, config.quantization)
        linear_fast_paths(model, config.fast_linears, config.quantized_activations)  # as rank 0 does
        kv_caches = allocate_kv_caches(model, config.num_kv_blocks, config.block_size, dtype)
        hooks = make_hooks(args, model, kv_caches, dtype) if make_hooks else None
        if device.type == "cpu":
            reuse_freed_memory()  # as rank 0's build_runtime: step temporaries reuse freed memory
        dist.barrier()  # every rank loaded: rank 0 may start stepping
        follow(model, kv_caches, config.block_size, control, hooks)
    except RuntimeError as e:  # a collective failed: rank 0 is gone or broke; nothing to finish
        log.warning("tp rank=%d event=exit reason=%s", args.rank, e)
        return 1
    finally:
        if hooks is not None:
            hooks.close()
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
