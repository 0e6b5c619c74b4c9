"""`duet`: one console command for everything (make-tiny-model, generate, demo; serving commands follow)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from engine.errors import InvalidRequestError, ModelLoadError


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
    llm = LLM(args.model, **engine_kwargs(args))
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        if args.json:
            record = {
                "prompt": prompt if isinstance(prompt, str) else None,
                "prompt_token_ids": out.prompt_token_ids,
                "token_ids": out.token_ids,
                "text": out.text,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
                "num_cached_tokens": out.num_cached_tokens,
            }
            if out.logprobs is not None:
                record["logprobs"] = [
                    {"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank, "top": lp.top}
                    for lp in out.logprobs
                ]
            print(json.dumps(record, ensure_ascii=False))
        else:
            shown = prompt if isinstance(prompt, str) else f"<ids {','.join(map(str, prompt))}>"
            print(f"--- {shown!r} -> [{out.finish_reason}] {out.text!r}")
    return 0


DEMO_SYSTEM = "You are a terse assistant. Answer in one sentence. " * 4


def cmd_demo(args: argparse.Namespace) -> int:
    """Offline demo on the embedded model; the serving issue turns this into a local cluster."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    t0 = time.monotonic()
    llm = LLM(args.model, **engine_kwargs(args))
    print(f"engine ready in {time.monotonic() - t0:.1f}s: model={llm.engine.model_id} "
          f"blocks={llm.engine.num_kv_blocks}x{llm.engine.block_size} dtype={str(llm.engine.dtype)[6:]}")
    questions = ["What is a KV cache?", "Why page it into blocks?", "What does a prefill worker do?",
                 "Explain continuous batching.", "Ünïcödé and 日本語 survive detokenization?"]
    # the first request warms the prefix cache; the rest share its long system prompt
    first = llm.chat([{"role": "system", "content": DEMO_SYSTEM}, {"role": "user", "content": questions[0]}],
                     SamplingParams(max_tokens=args.max_tokens, temperature=0))[0]
    conversations = [[{"role": "system", "content": DEMO_SYSTEM}, {"role": "user", "content": q}]
                     for q in questions[1:]]
    rest = llm.chat(conversations,
                    [SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=i)
                     for i in range(len(questions) - 1)])
    for question, out in zip(questions, [first, *rest]):
        tpot = ""
        if out.first_token_time_s is not None and len(out.token_ids) > 1:
            decode_s = out.finished_time_s - out.first_token_time_s
            tpot = f" tpot={1000 * decode_s / (len(out.token_ids) - 1):.1f}ms"
        print(f"\nQ: {question}\nA: {out.text!r}\n   [{out.finish_reason}] tokens={len(out.token_ids)} "
              f"cached_prompt_tokens={out.num_cached_tokens}/{len(out.prompt_token_ids)} "
              f"ttft={1000 * out.ttft_s:.1f}ms{tpot}")
    print("\n(the embedded model has random weights: the answers are gibberish by design; "
          "pass --model DIR for a real checkpoint)")
    llm.engine.check_integrity()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet", description="duet: disaggregated LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true")
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

    p = sub.add_parser("demo", help="run the main job on the embedded default model")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=24)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (InvalidRequestError, ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
