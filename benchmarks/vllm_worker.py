"""Time vLLM's offline `LLM.generate` on the benchmark's prompts; runs inside vLLM's own venv.

    $DUET_VLLM_VENV/bin/python benchmarks/vllm_worker.py --model DIR --dtype float32 --batches 1,8 ...

`offline_throughput.py` starts this as a subprocess (vLLM pins transformers and torch builds of its own, so
it cannot share duet's venv) and reads the one line of stdout that starts with `RESULT_PREFIX`: JSON with
output tokens/s per repeat per batch size and the greedy tokens of the check prompt. It imports nothing
from duet; the prompts come from `bench_prompts.py` (stdlib only), so they are the ids duet gets.

With `--serve` it times nothing on its own: after start-up and warm-up it prints one `READY_PREFIX` line
(start-up time, check tokens, environment) and then answers each stdin line `{"batch": B, "repeat": R}`
with one `CELL_PREFIX` line `{"batch": B, "repeat": R, "output_tokens_per_s": x}`, until stdin closes.
offline_throughput.py uses it to interleave vLLM's cells with duet's (`vllm_session.py`), so a machine
whose speed drifts over minutes slows both engines alike.

The engine is built once (its start-up, 1-4 min on 2 cores, is not timed; vLLM compiles the model with
torch.compile on first use of a checkpoint and caches it under ~/.cache/vllm), warmed up with one untimed
batch (`bench_prompts.warmup_prompts`), then every (batch size, repeat) is one timed `generate` call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prompts import check_prompt, make_prompts, warmup_prompts  # noqa: E402

RESULT_PREFIX = "VLLM_RESULT "
READY_PREFIX = "VLLM_READY "
CELL_PREFIX = "VLLM_CELL "
REPORTED_ENV = ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batches", default="1,8,32,64", help="comma-separated batch sizes")
    p.add_argument("--repeats", default="3", help="timed repeats: one integer, or one per batch size")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="OpenMP threads of the model worker (fewer than all cores binds it to cores 0..n-1)")
    p.add_argument("--enforce-eager", action="store_true", help="skip vLLM's torch.compile of the model")
    p.add_argument("--iomp", action="store_true",
                   help="LD_PRELOAD the venv's Intel OpenMP (vLLM's recommended CPU setup) instead of torch's libgomp")
    p.add_argument("--serve", action="store_true",
                   help="time the cells stdin asks for, one JSON line each (see the module docstring)")
    return p.parse_args(argv)


def per_batch_repeats(batches: list[int], spec: str) -> list[int]:
    values = [int(x) for x in spec.split(",")]
    if len(values) == 1:
        values = values * len(batches)
    if len(values) != len(batches) or min(values) < 1:
        raise ValueError(f"--repeats={spec!r} is invalid: one integer >= 1, or one per batch size {batches}")
    return values


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    repeats = per_batch_repeats(batches, args.repeats)
    # Set before vLLM is imported: its env module reads them once. On 2 cores the default reserves one core
    # for the engine-core process, which would leave the model a single thread.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.threads < (os.cpu_count() or 1):  # "auto" binding would take every core
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    if args.iomp:  # vLLM's engine and worker processes are spawned, so they start with this preload
        iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
        if not iomp.exists():
            raise FileNotFoundError(f"--iomp: {iomp} not found (pip install intel-openmp into the vLLM venv)")
        os.environ["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), os.environ.get("LD_PRELOAD")]))

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    max_batch = max(batches)
    start_s = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=args.prompt_len + args.output_len,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.prompt_len + args.output_len),
        enforce_eager=args.enforce_eager,
    )
    startup_s = time.perf_counter() - start_s
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)

    def run(prompts: list[list[int]]) -> tuple[float, list]:
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        elapsed_s = time.perf_counter() - t0
        for out in outs:
            got = len(out.outputs[0].token_ids)
            assert got == args.output_len, f"vLLM generated {got} tokens, expected {args.output_len}"
        return elapsed_s, outs

    _, check_outs = run([check_prompt(args.seed, args.prompt_len, vocab_size)])
    run(warmup_prompts(args.seed, batches, args.prompt_len, vocab_size))
    check_token_ids = list(check_outs[0].outputs[0].token_ids)
    env = {k: os.environ.get(k) for k in REPORTED_ENV}

    if args.serve:
        ready = {"startup_s": startup_s, "check_token_ids": check_token_ids, "env": env,
                 "enforce_eager": args.enforce_eager}
        print(READY_PREFIX + json.dumps(ready), flush=True)
        for line in sys.stdin:
            if not line.strip():
                continue
            ask = json.loads(line)
            batch, repeat = int(ask["batch"]), int(ask["repeat"])
            elapsed_s, _ = run(make_prompts(args.seed, batch, repeat, args.prompt_len, vocab_size))
            cell = {"batch": batch, "repeat": repeat, "output_tokens_per_s": batch * args.output_len / elapsed_s}
            print(CELL_PREFIX + json.dumps(cell), flush=True)
        return

    tokens_per_s: dict[str, list[float]] = {}
    for batch, n in zip(batches, repeats, strict=True):
        tokens_per_s[str(batch)] = []
        for repeat in range(n):
            elapsed_s, _ = run(make_prompts(args.seed, batch, repeat, args.prompt_len, vocab_size))
            tokens_per_s[str(batch)].append(batch * args.output_len / elapsed_s)
    result = {
        "engine": "vllm",
        "startup_s": startup_s,
        "output_tokens_per_s": tokens_per_s,
        "check_token_ids": check_token_ids,
        "env": env,
        "enforce_eager": args.enforce_eager,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
