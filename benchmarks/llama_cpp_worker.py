"""Time llama.cpp's decode step on a GGUF file; runs inside llama-cpp-python's own venv.

    /work/llama-venv/bin/python benchmarks/llama_cpp_worker.py --model FILE.gguf --threads 2 --serve

The peer of `quant_decode.py` (issue 18's benchmark): llama.cpp keeps a GGUF's quantized tensors as stored and
decodes straight from them, the thing duet's `quantization="auto"` does. Recipe (own venv, ~8 minutes on 2 cores;
llama-cpp-python compiles the llama.cpp tree it vendors, with -march=native):

    python3 -m venv /work/llama-venv && /work/llama-venv/bin/pip install llama-cpp-python

It uses llama.cpp's own C API through llama-cpp-python's ctypes bindings (what `llama-batched-bench` does in C):
one context with a sequence per batch row; a cell prefills `--prompt-len` tokens per sequence in one
`llama_decode`, then times `--steps` decode steps, each one `llama_decode` of one token per sequence with logits
for every row, as a serving engine's step needs them. Greedy (`--temperature 0`, the default): no sampling is timed
(the next token is a fixed id: a step's cost does not depend on which token it is); with `--temperature T` (and
`--top-p P`) each row's next token is drawn by llama.cpp's sampler chain (temperature, top-p, then the draw: the
order of vLLM's and duet's pipeline) and fed back. stdlib + llama_cpp only: nothing from duet.

Protocol (as vllm_worker.py's `--serve`, so `vllm_session.PeerSession` drives both): one `READY_PREFIX` line once
loaded and warmed up, then per stdin line `{"batch": B, "repeat": R}` one `CELL_PREFIX` line with
`decode_tokens_per_s`, until stdin closes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

READY_PREFIX = "LLAMA_READY "
CELL_PREFIX = "LLAMA_CELL "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--max-batch", type=int, default=32, help="sequences the context holds")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per cell")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy, untimed (see the module docstring)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--serve", action="store_true", help="answer cells from stdin (see the module docstring)")
    return p.parse_args(argv)


class LlamaDecoder:
    def __init__(self, path: str, threads: int, max_batch: int, positions: int, temperature: float = 0.0,
                 top_p: float = 1.0):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lc.llama_context_default_params()
        params.n_ctx = max_batch * positions
        params.n_batch = params.n_ubatch = max(512, max_batch * positions)
        params.n_seq_max = max_batch
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context")
        self.vocab_size = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.model_bytes = lc.llama_model_size(self.model)  # every tensor as stored: what a step reads (tied lm_head)
        self.batch = lc.llama_batch_init(params.n_batch, 0, 1)
        self.sampler = None
        if temperature > 0:
            self.sampler = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
            lc.llama_sampler_chain_add(self.sampler, lc.llama_sampler_init_temp(temperature))
            if top_p < 1.0:
                lc.llama_sampler_chain_add(self.sampler, lc.llama_sampler_init_top_p(top_p, 1))
            lc.llama_sampler_chain_add(self.sampler, lc.llama_sampler_init_dist(1234))

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants_logits) rows."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        if (rc := self.lc.llama_decode(self.ctx, b)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        self.lc.llama_synchronize(self.ctx)

    def cell(self, batch: int, prompt_len: int, steps: int, seed: int) -> float:
        """Decode tokens/s of `steps` steps of `batch` sequences after a `prompt_len`-token prefill each."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        first = 4 + seed % 1000
        self._decode([((first + 7 * s + p) % self.vocab_size, p, s, p == prompt_len - 1)
                      for s in range(batch) for p in range(prompt_len)])
        tokens = [(first + s) % self.vocab_size for s in range(batch)]
        start = time.perf_counter()
        for step in range(steps):
            self._decode([(tokens[s], prompt_len + step, s, True) for s in range(batch)])
            if self.sampler is not None:
                tokens = [self.lc.llama_sampler_sample(self.sampler, self.ctx, s) for s in range(batch)]
            else:
                tokens = [(first + s + step + 1) % self.vocab_size for s in range(batch)]
        return batch * steps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    decoder = LlamaDecoder(args.model, args.threads, args.max_batch, args.prompt_len + args.steps + 1,
                           args.temperature, args.top_p)
    decoder.cell(min(8, args.max_batch), args.prompt_len, 4, seed=999)  # warm-up: allocations, thread pool
    import llama_cpp

    ready = {"startup_s": time.perf_counter() - started, "check_token_ids": [], "model_bytes": decoder.model_bytes,
             "env": {"llama_cpp_python": llama_cpp.__version__, "threads": args.threads,
                     "system_info": llama_cpp.llama_print_system_info().decode().strip()}}
    print(READY_PREFIX + json.dumps(ready), flush=True)
    if not args.serve:
        return
    for line in sys.stdin:
        ask = json.loads(line)
        rate = decoder.cell(ask["batch"], args.prompt_len, args.steps, seed=ask["repeat"])
        print(CELL_PREFIX + json.dumps({**ask, "decode_tokens_per_s": rate}), flush=True)


if __name__ == "__main__":
    main()
