"""vLLM's n-gram speculative decoding as a peer of duet's; runs inside vLLM's venv (benchmarks/setup_vllm.sh).

    $DUET_VLLM_VENV/bin/python benchmarks/vllm_spec_worker.py --model DIR --dtype float32 --workloads W.json \
        [--ngram K] --serve

`speculative_bench.py`'s vLLM peer: the same chat prompts through vLLM's `LLM.chat`, greedy, on the dense copy of
the default model (offline_throughput.dense_copy), one engine per worker: plain, or with
`speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
"prompt_lookup_max": 4}` (duet's settings). Prefix caching is off, so every cell prefills as duet's cells do.
stdlib + vllm only (and bench_prompts.py, stdlib only): nothing from duet.

Protocol (`vllm_session.PeerSession`): one READY_PREFIX line once loaded and warmed up, then per stdin line
`{"batch": B, "repeat": R, "workload": NAME}` one CELL_PREFIX line echoing them with `tokens` (generated: batch 1
every prompt of the workload in turn, batch B the prompts repeated to B conversations in one call), `seconds`, and
vLLM's own speculation counters over the cell (`drafts`, `draft_tokens`, `accepted_tokens`; null where this vLLM
does not report them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prompts import chat_cell  # noqa: E402

READY_PREFIX = "VLLM_SPEC_READY "
CELL_PREFIX = "VLLM_SPEC_CELL "
COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
            "accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}


def spec_counters(llm) -> dict:
    """vLLM's spec_decode counters now (None each where its metrics API or the counter is absent)."""
    try:
        metrics = {m.name: m for m in llm.get_metrics()}
    except Exception:  # noqa: BLE001 - an older vLLM without the API: the cell reports none
        return dict.fromkeys(COUNTERS)
    return {key: (int(metrics[name].value) if name in metrics else None) for key, name in COUNTERS.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--workloads", required=True, help="JSON: {name: [messages, ...]}")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--ngram", type=int, default=0, help="num_speculative_tokens of n-gram speculation (0: plain)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (each engine holds its own)")
    p.add_argument("--serve", action="store_true")
    args = p.parse_args(argv)
    # before vLLM is imported (its env module reads them once): on 2 cores the default reserves one core for the
    # engine-core process, which would leave the model a single thread
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    workloads = json.loads(open(args.workloads).read())
    spec = None if args.ngram == 0 else {"method": "ngram", "num_speculative_tokens": args.ngram,
                                         "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = LLM(model=args.model, dtype=args.dtype, seed=0, max_model_len=args.max_model_len, max_num_seqs=args.max_batch,
              enable_prefix_caching=False, speculative_config=spec, disable_log_stats=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)

    chat_cell(llm, next(iter(workloads.values()))[:1], 1, params)  # warm-up (vLLM compiles on first use)
    print(READY_PREFIX + json.dumps({"startup_s": time.perf_counter() - t0, "check_token_ids": [],
                                     "env": {"vllm": vllm.__version__, "speculative_config": spec}}), flush=True)
    if not args.serve:
        return
    for line in sys.stdin:
        cell = json.loads(line)
        before = spec_counters(llm)
        tokens, seconds = chat_cell(llm, workloads[cell["workload"]], int(cell["batch"]), params)
        after = spec_counters(llm)
        counts = {k: (None if after[k] is None or before[k] is None else after[k] - before[k]) for k in COUNTERS}
        print(CELL_PREFIX + json.dumps({**cell, "tokens": tokens, "seconds": seconds, **counts}), flush=True)


if __name__ == "__main__":
    main()
