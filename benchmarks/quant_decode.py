"""Decode speed of the default model (SmolLM2-135M, Q4_1 GGUF) held seven ways, each against its own memory
roofline, and llama.cpp on the same file, interleaved in one run (issue 18's benchmark).

    .venv/bin/python benchmarks/quant_decode.py                     # llama.cpp from $DUET_LLAMA_VENV (see below)
    .venv/bin/python benchmarks/quant_decode.py --modes auto,float32 --batches 1 --repeats 3 --no-llama
    .venv/bin/python benchmarks/quant_decode.py --modes auto,auto-int8act --temperature 0.7 --top-p 0.9

Modes (duet's `LLM(quantization=..., dtype=...)` on the same file):
    float32 / bfloat16   quantization="none": the file dequantized to a dense model of that dtype
    int8 / int4          round-to-nearest of the dequantized weights on load (fp32 activations)
    auto                 the file's Q4_1 / Q8_0 tensors kept as stored (the default), fp32 activations
    auto-int8act         auto with --quantized-activations int8 (x rounded per 32 inputs: llama.cpp's way)
    auto-bf16            auto with dtype bfloat16: bf16 activations (many rows: bf16 panels, vdpbf16ps)

A cell is `--steps` decode steps of `--batch` sequences after a `--prompt-len`-token prefill each, timed from the
step after every sequence has its first token to the last: duet through its engine (`LLMEngine.step`: scheduler,
model, greedy sampling), llama.cpp through its C API (`llama_decode` with logits for every row, no sampling:
llama_cpp_worker.py, in its own venv; recipe there, or set $DUET_LLAMA_VENV). With `--temperature T` (and `--top-p
P`) both sample every row each step (unseeded; llama.cpp's sampler chain: temperature, top-p, the draw).
Figures: decode tokens/s, min / median / max over repeats; the roofline of a mode = read bandwidth / the bytes of
weights a step reads (its linears as held, norms, the lm_head; one embedding row is ignored), with the bandwidth (a
1 GiB `sum`) sampled at every repeat of this run and its fastest sample used. Cells of every engine alternate,
repeat by repeat, so a shared machine's drift hits all of them alike.
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
from bandwidth import measure_read_bandwidth  # noqa: E402
from bench_prompts import make_prompts  # noqa: E402
from llama_cpp_worker import CELL_PREFIX, READY_PREFIX  # noqa: E402
from vllm_session import PeerSession  # noqa: E402

from engine.default_model import default_model_path  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.model import RMSNorm  # noqa: E402
from engine.quantized_linear import QuantizedLinear  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

MODES = {"float32": ("none", "float32", "float"), "bfloat16": ("none", "bfloat16", "float"),
         "int8": ("int8", "float32", "float"), "int4": ("int4", "float32", "float"),
         "auto": ("auto", "float32", "float"), "auto-int8act": ("auto", "float32", "int8"),
         "auto-bf16": ("auto", "bfloat16", "float")}
LLAMA = "llama.cpp"


def step_weight_bytes(llm: LLM) -> int:
    """Bytes of weights one decode step reads: every linear once as held (quantized buffers, or the dense weight in
    the model's dtype), the norms, and the lm_head (the embedding matrix when tied and dense)."""
    model = llm.engine.runner.model
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += sum(t.numel() * t.element_size() for t in (module.qweight, module.scales, module.mins)
                         if t is not None)
        elif hasattr(module, "in_features") and hasattr(module, "out_features"):  # nn.Linear or a FastLinear
            total += module.in_features * module.out_features * model.embed_tokens.weight.element_size()
        elif isinstance(module, RMSNorm):
            total += module.weight.numel() * module.weight.element_size()
    if model.lm_head is None:
        total += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def engine_for(model_path: Path, mode: str, **engine_args) -> LLM:
    """duet's LLM on the file held as `mode` (MODES), with any further engine arguments."""
    quantization, dtype, activations = MODES[mode]
    return LLM(model_path, quantization=quantization, dtype=dtype, quantized_activations=activations, **engine_args)


def duet_cell(llm: LLM, batch: int, prompt_len: int, steps: int, repeat: int, temperature: float = 0.0,
              top_p: float = 1.0) -> float:
    """Decode tokens/s of one cell (see the module docstring)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=temperature, top_p=top_p, ignore_eos=True)
    for prompt in make_prompts(1000 + repeat, batch, repeat, prompt_len, engine.model_config.vocab_size):
        engine.add_request({"prompt_token_ids": prompt}, params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return batch * steps / (time.perf_counter() - start)


def spread(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per cell")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (see the module docstring)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    p.add_argument("--llama-venv", default=os.environ.get("DUET_LLAMA_VENV", "/work/llama-venv"))
    args = p.parse_args(argv)
    modes, batches = args.modes.split(","), [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    model_path = default_model_path()
    print(f"config: modes={modes} batches={batches} repeats={args.repeats} prompt_len={args.prompt_len} "
          f"steps={args.steps} threads={args.threads} temperature={args.temperature} top_p={args.top_p} "
          f"model={model_path.name}", flush=True)

    engines: dict[str, LLM] = {}
    step_bytes: dict[str, int] = {}
    for mode in modes:
        engines[mode] = engine_for(model_path, mode, max_num_seqs=max(batches))
        step_bytes[mode] = step_weight_bytes(engines[mode])
        duet_cell(engines[mode], min(8, max(batches)), args.prompt_len, 4, repeat=-1)  # warm-up, untimed
    llama = None
    if not args.no_llama:
        cmd = [f"{args.llama_venv}/bin/python", str(Path(__file__).with_name("llama_cpp_worker.py")), "--model",
               str(model_path), "--threads", str(args.threads), "--max-batch", str(max(batches)), "--prompt-len",
               str(args.prompt_len), "--steps", str(args.steps), "--temperature", str(args.temperature), "--top-p",
               str(args.top_p), "--serve"]
        llama = PeerSession(cmd, READY_PREFIX, CELL_PREFIX)
        step_bytes[LLAMA] = llama.ready["model_bytes"]
        print(f"llama.cpp: {llama.ready['env']}", flush=True)

    names = [*modes, *([LLAMA] if llama else [])]
    rates: dict[tuple[str, int], list[float]] = {(n, b): [] for n in names for b in batches}
    bandwidths: list[float] = []
    try:
        for repeat in range(args.repeats):
            bandwidths.append(measure_read_bandwidth(1 << 30, repeats=3).max)
            order = names if repeat % 2 == 0 else names[::-1]
            for batch in batches:
                for name in order:
                    if name == LLAMA:
                        rate = float(llama.ask(batch, repeat)["decode_tokens_per_s"])
                    else:
                        rate = duet_cell(engines[name], batch, args.prompt_len, args.steps, repeat,
                                         args.temperature, args.top_p)
                    rates[(name, batch)].append(rate)
                    print(f"repeat={repeat} batch={batch} {name}: {rate:.1f} tok/s", flush=True)
    finally:
        if llama is not None:
            llama.close()

    bandwidth = max(bandwidths)
    print(f"\nread bandwidth GB/s (1 GiB sum, per repeat): {spread([b / 1e9 for b in bandwidths])}; roofline uses "
          f"the max\n")
    print("| engine | weight MB / step | roofline tok/s | " + " | ".join(f"batch {b} tok/s" for b in batches)
          + " | batch-1 of roofline |")
    print("|---|---:|---:|" + "---|" * len(batches) + "---:|")
    for name in names:
        roofline = bandwidth / step_bytes[name]
        cells = " | ".join(spread(rates[(name, b)]) for b in batches)
        first = statistics.median(rates[(name, batches[0])]) / roofline if batches[0] == 1 else float("nan")
        print(f"| {name} | {step_bytes[name] / 1e6:.1f} | {roofline:.0f} | {cells} | {first:.2f} |")
    print()
    for other in [n for n in names if n != "float32"]:
        if "float32" in names:
            ratios = [statistics.median(rates[(other, b)]) / statistics.median(rates[("float32", b)])
                      for b in batches]
            print(f"{other} / float32 (medians): " + ", ".join(f"batch {b}: {r:.2f}x" for b, r in zip(batches, ratios)))
    for mine in [n for n in ("auto", "auto-int8act") if n in names and llama is not None]:
        ratios = [statistics.median(rates[(mine, b)]) / statistics.median(rates[(LLAMA, b)]) for b in batches]
        print(f"{mine} / llama.cpp (medians): " + ", ".join(f"batch {b}: {r:.2f}x" for b, r in zip(batches, ratios)))


if __name__ == "__main__":
    main()
