"""llama.cpp's prompt lookup decoding as a peer of duet's n-gram speculation; runs inside llama-cpp-python's venv.

    /work/llama-venv/bin/python benchmarks/llama_cpp_lookup_worker.py --model FILE.gguf --workloads W.json --serve

`speculative_bench.py`'s peer at batch 1 (llama-cpp-python's high-level `Llama` serves one sequence): the same
chat prompts through `create_chat_completion`, greedy, once with llama.cpp's plain decoding and once with
`LlamaPromptLookupDecoding` (its n-gram draft over the prompt and output), both loaded side by side. Recipe for the
venv: benchmarks/llama_cpp_worker.py. stdlib + llama_cpp only: nothing from duet.

Protocol (`vllm_session.PeerSession`): one READY_PREFIX line once loaded and warmed up, then per stdin line
`{"batch": 1, "repeat": R, "workload": NAME, "lookup": BOOL}` one CELL_PREFIX line echoing them with `tokens`
(generated, every prompt of the workload in turn) and `seconds`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

READY_PREFIX = "LOOKUP_READY "
CELL_PREFIX = "LOOKUP_CELL "


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--workloads", required=True, help="JSON: {name: [messages, ...]}")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-pred-tokens", type=int, default=5)
    p.add_argument("--max-ngram-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--serve", action="store_true")
    args = p.parse_args(argv)
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    t0 = time.perf_counter()
    workloads = json.loads(open(args.workloads).read())
    common = dict(model_path=args.model, n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads,
                  verbose=False, seed=0)
    engines = {False: llama_cpp.Llama(**common),
               # verifying draft tokens reads the logits of every evaluated position: logits_all, as its docs say
               True: llama_cpp.Llama(**common, logits_all=True, draft_model=LlamaPromptLookupDecoding(
                   num_pred_tokens=args.num_pred_tokens, max_ngram_size=args.max_ngram_size))}

    def run(lookup: bool, messages_list: list) -> tuple[int, float]:
        tokens, start = 0, time.perf_counter()
        for messages in messages_list:
            engines[lookup].reset()  # no prompt cache across prompts: every cell prefills as duet's does
            reply = engines[lookup].create_chat_completion(messages, max_tokens=args.max_tokens, temperature=0.0)
            tokens += reply["usage"]["completion_tokens"]
        return tokens, time.perf_counter() - start

    first = next(iter(workloads.values()))[:1]
    run(False, first), run(True, first)  # warm-up
    print(READY_PREFIX + json.dumps({"startup_s": time.perf_counter() - t0, "check_token_ids": [], "env": {
        "llama_cpp": llama_cpp.__version__}}), flush=True)
    if not args.serve:
        return
    for line in sys.stdin:
        cell = json.loads(line)
        tokens, seconds = run(bool(cell["lookup"]), workloads[cell["workload"]])
        print(CELL_PREFIX + json.dumps({**cell, "tokens": tokens, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
