"""`duet`: one console command for everything: make-tiny-model, generate, chat, demo, up, router, prefill, decode,
client."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

# `duet up` / `duet demo` fork + exec components while gRPC may run: gRPC's fork support can abort the child
# before exec (grpc/grpc#43055), and we never need gRPC in a forked child that does not exec.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from duet.cli_bench import add_bench_commands
from duet.cli_chat import add_chat_command
from duet.cli_common import _parse_ids, add_engine_args, add_sampling_args, engine_config, sampling_params
from duet.cli_ray import add_ray_commands
from duet.cli_serving import add_serving_commands
from engine.errors import InvalidRequestError, ModelLoadError

DEBUG_ENV_VAR = "DUET_DEBUG"


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from engine.tiny_model import make_tiny_model

    out = make_tiny_model(
        args.out_dir,
        arch=args.arch,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        intermediate=args.intermediate,
        seed=args.seed,
        max_position_embeddings=args.max_position_embeddings,
        dtype=args.dtype,
    )
    print(f"wrote {args.arch} checkpoint to {out}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM

    prompts = [*args.prompt, *args.prompt_ids]
    if not prompts:
        print("error: give at least one --prompt TEXT or --prompt-ids 1,2,3", file=sys.stderr)
        return 2
    params = sampling_params(args)
    with LLM(args.model, **dataclasses.asdict(engine_config(args))) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())  # a bar for people, not for pipes
    for prompt, out in zip(prompts, outputs):
        for sample in out.outputs:
            if args.json:
                record = {
                    "prompt": out.prompt,
                    "prompt_token_ids": out.prompt_token_ids,
                    "index": sample.index,
                    "token_ids": sample.token_ids,
                    "text": sample.text,
                    "finish_reason": sample.finish_reason,
                    "stop_reason": sample.stop_reason,
                    "num_cached_tokens": sample.num_cached_tokens,
                }
                if sample.logprobs is not None:
                    record["cumulative_logprob"] = sample.cumulative_logprob
                    record["logprobs"] = [  # per token: the sampled token, then the top-k (JSON keys are strings)
                        [{"token_id": token_id, "logprob": lp.logprob, "rank": lp.rank,
                          "decoded_token": lp.decoded_token} for token_id, lp in position.items()]
                        for position in sample.logprobs
                    ]
                print(json.dumps(record, ensure_ascii=False))
            else:
                shown = prompt if isinstance(prompt, str) else f"<ids {','.join(map(str, prompt))}>"
                print(f"--- {shown!r} -> [{sample.finish_reason}] {sample.text!r}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet", description="duet: disaggregated LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--debug", action="store_true",
                        help=f"let an error end in its traceback instead of one line (or set {DEBUG_ENV_VAR}=1)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="write a tiny random Hugging Face checkpoint with a tokenizer")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--max-position-embeddings", type=int, default=4096)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("generate", help="offline generation")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt-ids", action="append", type=_parse_ids, default=[], help="prompt token ids 1,2,3")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, one per line")
    p.set_defaults(func=cmd_generate)

    add_chat_command(sub)
    add_serving_commands(sub)
    add_bench_commands(sub)
    add_ray_commands(sub)
    return parser


def describe_error(error: Exception) -> tuple[str, int]:
    """The one line `duet` prints for an error that ends a command, and its exit status: 2 for what the user
    asked wrongly (as argparse's usage errors), 1 for what failed (a call, a file, a bug)."""
    grpc = sys.modules.get("grpc")  # loaded by whichever command made a call; not imported here for others
    if grpc is not None and isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}", 1
    if isinstance(error, (InvalidRequestError, ModelLoadError, ValueError)):
        return str(error), 2
    if isinstance(error, OSError):
        return str(error), 1
    return f"{type(error).__name__}: {error} (a bug in duet? `duet --debug ...` or {DEBUG_ENV_VAR}=1 shows where)", 1


def main(argv: list[str] | None = None) -> int:
    """Run one `duet` command. An error ends it with one line on stderr (`describe_error`), not a traceback,
    unless --debug or $DUET_DEBUG=1 asks for the traceback; Ctrl-C ends it quietly with status 130."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    debug = args.debug or os.environ.get(DEBUG_ENV_VAR, "") not in ("", "0")
    try:
        return args.func(args)
    except Exception as e:  # noqa: BLE001 - every error becomes one line; --debug re-raises
        if debug:
            raise
        line, code = describe_error(e)
        print(f"error: {line}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        if debug:
            raise
        return 130


if __name__ == "__main__":
    sys.exit(main())
