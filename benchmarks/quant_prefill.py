"""Prefill speed of the default model (SmolLM2-135M, Q4_1 GGUF) held as quant_decode.py's modes, interleaved in one
run: does a prefill worker gain from dense weights while its decode worker keeps them quantized (issue 18 part 5)?

    .venv/bin/python benchmarks/quant_prefill.py
    .venv/bin/python benchmarks/quant_prefill.py --modes float32,bfloat16,auto --prompt-lens 128,512,2048 --repeats 3

Prefill is compute-bound: every weight is used by every prompt token of a chunk, so its cost is the GEMMs' math,
not the bytes of the weights; a kept-quantized linear pays a dequantize pass per call on top (the C panels up to
128 rows, one dequantize + torch GEMM above: engine/kernels/quant_linear.py). A cell is one request of
`--prompt-len` fresh random tokens with max_tokens=1 through `LLMEngine.step` (chunked by the engine's default
token budget; no prefix-cache hit: every cell's prompt is new), timed from add_request to the first token: prompt
tokens/s, min / median / max over repeats. Cells of every mode alternate, repeat by repeat. The tokens agree
across modes only up to near-ties (the dense and quantized models are the same numbers; bf16 rounds them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prompts import make_prompts  # noqa: E402
from quant_decode import MODES, engine_for, spread  # noqa: E402

from engine.default_model import default_model_path  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def prefill_cell(llm: LLM, prompt_len: int, repeat: int, seed: int) -> float:
    """Prompt tokens/s of one prefill (see the module docstring)."""
    engine = llm.engine
    prompt = make_prompts(seed, 1, repeat, prompt_len, engine.model_config.vocab_size)[0]
    start = time.perf_counter()
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return prompt_len / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="float32,bfloat16,auto", help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--prompt-lens", default="128,512,2048")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args(argv)
    modes, lengths = args.modes.split(","), [int(n) for n in args.prompt_lens.split(",")]
    torch.set_num_threads(args.threads)
    model_path = default_model_path()
    print(f"config: modes={modes} prompt_lens={lengths} repeats={args.repeats} threads={args.threads} "
          f"model={model_path.name}", flush=True)
    engines = {}
    for mode in modes:
        engines[mode] = engine_for(model_path, mode, max_model_len=max(lengths) + 16)
        prefill_cell(engines[mode], 64, repeat=-1, seed=7)  # warm-up, untimed
    rates: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in lengths}
    for repeat in range(args.repeats):
        order = modes if repeat % 2 == 0 else modes[::-1]
        for n in lengths:
            for mode in order:
                rate = prefill_cell(engines[mode], n, repeat, seed=1000 + n)
                rates[(mode, n)].append(rate)
                print(f"repeat={repeat} prompt_len={n} {mode}: {rate:.0f} prompt tok/s", flush=True)
    print("\n| mode | " + " | ".join(f"{n} tokens: prompt tok/s" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for mode in modes:
        print(f"| {mode} | " + " | ".join(spread(rates[(mode, n)]) for n in lengths) + " |")
    print()
    for mode in [m for m in modes if m != "auto"]:
        if "auto" in modes:
            ratios = [statistics.median(rates[(mode, n)]) / statistics.median(rates[("auto", n)]) for n in lengths]
            print(f"{mode} / auto (medians): " + ", ".join(f"{n} tokens: {r:.2f}x" for n, r in zip(lengths, ratios)))


if __name__ == "__main__":
    main()
