"""A follower rank of a tensor-parallel engine: `python -m engine.tp_worker --rank R --size N ...`.

Started by rank 0 (engine/tp_runner.spawn_followers) with the engine settings rank 0 resolved, so every
rank sizes its KV cache shard identically; it loads only its shard of the checkpoint, then runs whatever
steps rank 0 broadcasts until told to stop or a collective fails (rank 0 gone): then it exits.
A serving worker's followers run `worker.tp_rank`, which adds the worker's share of KV transfer as hooks.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from engine.config import ModelConfig, parse_dtype
from engine.cpu_allocator import reuse_freed_memory
from engine.linear_fast import fast_linears
from engine.model_runner import allocate_kv_caches
from engine.tensor_parallel import TPGroup, build_tp_model
from engine.tp_runner import FollowerHooks, follow, init_group

log = logging.getLogger("duet.tp")


MakeHooks = Callable[[argparse.Namespace, list, list, torch.dtype], FollowerHooks]  # (args, model, caches, dtype)


def engine_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--num-kv-blocks", type=int, required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-fast-linears", action="store_true", help="plain F.linear (engine/linear_fast.py off)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: this rank runs on cuda:<rank>")
    return p


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None,
         make_hooks: MakeHooks | None = None) -> int:
    args = (parser or engine_arg_parser()).parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda", args.rank) if args.device == "cuda" else torch.device("cpu")
    control = init_group(args.rank, args.size, args.init_method, device=device)
    hooks = None
    try:
        config = ModelConfig.from_dir(args.model)
        dtype = parse_dtype(args.dtype)
        model = build_tp_model(config, args.model, dtype, args.max_model_len, TPGroup(args.rank, args.size), device)
        if not args.no_fast_linears:
            fast_linears(model)  # as rank 0 does
        kv_caches = allocate_kv_caches(model, args.num_kv_blocks, args.block_size, dtype)
        hooks = make_hooks(args, model, kv_caches, dtype) if make_hooks else None
        if device.type == "cpu":
            reuse_freed_memory()  # as rank 0's build_runtime: step temporaries reuse freed memory
        dist.barrier()  # every rank loaded: rank 0 may start stepping
        follow(model, kv_caches, args.block_size, control, hooks)
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
