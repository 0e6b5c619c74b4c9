"""Speculative decoding on the default model: with vs without, copy-heavy vs open chat, batch 1 and 8, against
vLLM's n-gram speculation (float32 / bfloat16) and llama.cpp's prompt lookup decoding (batch 1) on the same model
and prompts (issue 19's benchmark).

    .venv/bin/python benchmarks/speculative_bench.py       # vLLM from $DUET_VLLM_VENV, llama.cpp from $DUET_LLAMA_VENV
    .venv/bin/python benchmarks/speculative_bench.py --modes auto --batches 1 --repeats 3 --no-llama --no-vllm
    .venv/bin/python benchmarks/speculative_bench.py --method draft_model --modes float32,bfloat16 --batches 1

--method draft_model drafts with the same GGUF file held as --draft-quantization (default auto: its Q4_1 weights
kept, decoded by the quantized kernels) for a target held dense (modes float32 / bfloat16); llama-cpp-python has
no draft-model decoding, so that run has no llama.cpp cells.

Workloads (chat prompts, greedy, up to --max-tokens each):
    copy   edit a given passage or code and return it whole: rename a function in duet source files, fix the
           spelling of README passages (most of the answer is in the prompt)
    chat   open questions (nothing to copy: speculation should cost nothing here)
A cell generates every prompt of a workload (batch 1: one after another; batch 8: as one batch, each prompt twice);
figure: output tokens / seconds of the whole cell, prefill included. vLLM (vllm_spec_worker.py, its own venv:
benchmarks/setup_vllm.sh) runs the dense copy of the same file (offline_throughput.dense_copy: the same numbers as
duet's `none` modes) in the cell's dtype, one engine plain and one with n-gram speculation of duet's settings,
prefix caching off. duet's speculation is
`{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4}`; llama.cpp's is
`LlamaPromptLookupDecoding(num_pred_tokens=K, max_ngram_size=4)` (llama_cpp_lookup_worker.py). Every engine's
cells alternate, repeat by repeat, so a shared machine's drift hits all alike. Acceptance rate = accepted / drafted
guesses; mean accepted length = 1 + accepted / drafts (vLLM's), both from the engine's own counters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prompts import chat_cell  # noqa: E402
from vllm_session import PeerSession  # noqa: E402

from engine.default_model import default_model_path  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODES = {"float32": ("none", "float32"), "bfloat16": ("none", "bfloat16"), "auto": ("auto", "float32")}
CHAT = ["Write a short poem about the sea.", "Explain how a bicycle works.",
        "Give me three tips for learning a new language.", "What is the difference between weather and climate?"]


def copy_prompts() -> list[str]:
    """Edit-and-return-it-whole tasks over this repository's own text (fixed files and offsets: reproducible)."""
    out = []
    for path, old, new in (("engine/ngram_proposer.py", "propose_ngram", "find_ngram_proposal"),
                           ("engine/speculation.py", "Speculator", "GuessMaker")):
        code = (ROOT / path).read_text().split('"""', 2)[2][:900]
        out.append(f"Rename {old} to {new} in this code. Return the whole code.\n\n```python{code}```")
    readme = (ROOT / "README.md").read_text()
    for start in (3000, 5000):
        passage = readme[start : start + 700].replace("the ", "teh ")
        out.append(f"Correct the spelling in the following passage and return it in full:\n\n{passage}")
    return out


def workloads() -> dict[str, list[list[dict]]]:
    return {name: [[{"role": "user", "content": text}] for text in texts]
            for name, texts in (("copy", copy_prompts()), ("chat", CHAT))}


def duet_cell(llm: LLM, conversations: list, batch: int, max_tokens: int) -> tuple[int, float]:
    return chat_cell(llm, conversations, batch, SamplingParams(max_tokens=max_tokens, temperature=0))


def spread(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="float32,bfloat16,auto")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    p.add_argument("--method", default="ngram", choices=("ngram", "draft_model"))
    p.add_argument("--draft-quantization", default="auto", help="draft_model: how the draft's linears are held")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--disable-by-batch-size", type=int, default=None, help="default: engine/speculative_config.py's")
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--vllm-venv", default=os.environ.get("DUET_VLLM_VENV", str(Path.home() / ".cache/duet/vllm-venv")))
    p.add_argument("--llama-venv", default=os.environ.get("DUET_LLAMA_VENV", "/work/llama-venv"))
    args = p.parse_args()
    modes, batches = args.modes.split(","), [int(b) for b in args.batches.split(",")]
    model = default_model_path()
    if args.method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    else:
        spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": args.k,
                "quantization": args.draft_quantization}
        args.no_llama = args.no_vllm = True
    if args.disable_by_batch_size is not None:  # e.g. 64: speculate at every batch size, to see where it stops paying
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    loads = workloads()
    print(f"config: modes={modes} batches={batches} repeats={args.repeats} max_tokens={args.max_tokens} k={args.k} "
          f"threads={args.threads} model={model.name} speculative={json.dumps(spec)}", flush=True)
    engines = {(mode, on): LLM(model, quantization=MODES[mode][0], dtype=MODES[mode][1], num_threads=args.threads,
                               speculative_config=spec if on else None)
               for mode in modes for on in (False, True)}
    for llm in engines.values():  # warm-up: kernels built, memory touched
        duet_cell(llm, loads["chat"][:1], 1, 8)
    llama = None
    if not args.no_llama:
        workload_file = Path(tempfile.mkstemp(suffix=".json")[1])
        workload_file.write_text(json.dumps(loads))
        llama = PeerSession([f"{args.llama_venv}/bin/python", str(ROOT / "benchmarks/llama_cpp_lookup_worker.py"),
                             "--model", str(model), "--workloads", str(workload_file), "--max-tokens",
                             str(args.max_tokens), "--num-pred-tokens", str(args.k), "--threads", str(args.threads),
                             "--serve"], "LOOKUP_READY ", "LOOKUP_CELL ")
    vllm = {} if args.no_vllm else vllm_sessions(args, [m for m in modes if MODES[m][0] == "none"], loads, batches)
    rates: dict[tuple, list[float]] = {}
    counts: dict[tuple, list[tuple[int, int, int]]] = {}
    try:
        for repeat in range(args.repeats):
            for name in loads:
                for batch in batches:
                    for (mode, on), llm in engines.items():
                        stats0 = llm.engine.core.speculation
                        tokens, seconds = duet_cell(llm, loads[name], batch, args.max_tokens)
                        stats1 = llm.engine.core.speculation
                        key = (mode, name, batch, on)
                        rates.setdefault(key, []).append(tokens / seconds)
                        counts.setdefault(key, []).append((stats1.num_drafts - stats0.num_drafts,
                                                           stats1.num_draft_tokens - stats0.num_draft_tokens,
                                                           stats1.num_accepted_tokens - stats0.num_accepted_tokens))
                        print(f"repeat={repeat} {name} batch={batch} {mode} speculative={on}: "
                              f"{tokens / seconds:.1f} tok/s", flush=True)
                    for (mode, on), session in vllm.items():
                        reply = session.ask(batch, repeat, workload=name)
                        key = (f"vLLM {mode}", name, batch, on)
                        rates.setdefault(key, []).append(reply["tokens"] / reply["seconds"])
                        if reply.get("drafts") is not None:
                            counts.setdefault(key, []).append((reply["drafts"], reply["draft_tokens"],
                                                               reply["accepted_tokens"]))
                        print(f"repeat={repeat} {name} batch={batch} vLLM {mode} speculative={on}: "
                              f"{reply['tokens'] / reply['seconds']:.1f} tok/s", flush=True)
                    if llama is not None and batch == 1:
                        for on in (False, True):
                            reply = llama.ask(1, repeat, workload=name, lookup=on)
                            rates.setdefault(("llama.cpp", name, 1, on), []).append(reply["tokens"] / reply["seconds"])
                            print(f"repeat={repeat} {name} batch=1 llama.cpp lookup={on}: "
                                  f"{reply['tokens'] / reply['seconds']:.1f} tok/s", flush=True)
    finally:
        if llama is not None:
            llama.close()
        for session in vllm.values():
            session.close()
    print(f"\n| engine | workload | batch | plain tok/s | {args.method} tok/s | {args.method} / plain "
          "(min / median / max) | acceptance | mean accepted length |")
    print("|---|---|---:|---|---|---|---:|---:|")
    for (mode, name, batch, on), values in rates.items():
        if on:
            continue
        with_spec = rates[(mode, name, batch, True)]
        ratios = [b / a for a, b in zip(values, with_spec)]
        drafted = [c for c in counts.get((mode, name, batch, True), [])]
        drafts, guesses, accepted = (sum(c[i] for c in drafted) for i in range(3)) if drafted else (0, 0, 0)
        acceptance = f"{accepted / guesses:.2f}" if guesses else "-"
        length = f"{1 + accepted / drafts:.2f}" if drafts else "-"
        print(f"| {mode} | {name} | {batch} | {spread(values)} | {spread(with_spec)} | "
              f"{min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f} | {acceptance} | {length} |")


def vllm_sessions(args, modes: list[str], loads: dict, batches: list[int]) -> dict:
    """(mode, speculative) -> a vLLM worker (vllm_spec_worker.py) on the default model's dense copy in that dtype."""
    from offline_throughput import dense_copy

    model_dir = dense_copy(default_model_path())
    workload_file = Path(tempfile.mkstemp(suffix=".json")[1])
    workload_file.write_text(json.dumps(loads))
    sessions = {}
    try:
        for mode in modes:
            for on in (False, True):
                sessions[(mode, on)] = PeerSession(
                    [f"{args.vllm_venv}/bin/python", str(ROOT / "benchmarks/vllm_spec_worker.py"), "--model",
                     str(model_dir), "--dtype", MODES[mode][1], "--workloads", str(workload_file), "--max-tokens",
                     str(args.max_tokens), "--max-batch", str(max(batches)), "--ngram", str(args.k if on else 0),
                     "--serve"], "VLLM_SPEC_READY ", "VLLM_SPEC_CELL ")
                print(f"vLLM {mode} speculative={on}: ready in {sessions[(mode, on)].startup_s:.0f} s "
                      f"({sessions[(mode, on)].env})", flush=True)
    except BaseException:
        for session in sessions.values():
            session.close()
        raise
    return sessions


if __name__ == "__main__":
    main()
