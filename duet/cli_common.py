"""Flags shared by `duet` commands, mapped onto `EngineConfig` and `SamplingParams`."""

from __future__ import annotations

import argparse
from pathlib import Path


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids={text!r} is invalid: must be comma-separated ints") from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", type=Path, default=None, help="HF checkpoint dir (default: the embedded tiny model)")
    g.add_argument("--dtype", default=None, help="float32|float16|bfloat16 (default: the checkpoint's)")
    g.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (default: from memory)")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step (prefill chunk)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes; gloo on CPU)")
    g.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                   help="where weights, KV cache and steps live; auto: cuda when available (default: cpu)")
    g.add_argument("--no-cuda-graphs", action="store_true",
                   help="on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs")
    g.add_argument("--cuda-graph-batch-sizes", type=_parse_sizes, default=None,
                   help="batch sizes captured as CUDA graphs, e.g. 1,2,4,8 (default: 1,2,4,8,16,24,32,48,... "
                        "up to --max-num-seqs)")


def _parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(t) for t in text.replace(" ", "").split(",") if t != "")
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--cuda-graph-batch-sizes={text!r} is invalid: must be comma-separated "
                                         "ints >= 1")
    return sizes


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=_parse_ids, default=[])
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None, help="top-n logprobs per token")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.threads,
        tp_size=args.tp,
        device=args.device,
        cuda_graphs=not args.no_cuda_graphs,
        cuda_graph_batch_sizes=args.cuda_graph_batch_sizes,
    )


def sampling_params(args: argparse.Namespace):
    from engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
