"""Where does a duet `generate` spend its time? Wall-clock per engine phase, then the hottest ops.

    .venv/bin/python benchmarks/profile_duet.py --model small --dtype float32 --batch 1
    .venv/bin/python benchmarks/profile_duet.py --model qwen05b --batch 64 --torch-profiler

Three views of one workload (the benchmark's prompts, `--output-len` greedy tokens, EOS ignored):
1. phases: the engine's own methods wrapped with timers (cheap, so the split is close to an unprofiled
   run): scheduling, input preparation, the model forward, logits, sampling, detokenizing, the rest.
2. cProfile's top functions by self time (Python overhead made visible; inflates Python-heavy code).
3. with `--torch-profiler`: torch ops by self CPU time (which kernels the forward pays for).
It patches methods on the classes for the life of this process only; engine/ is not modified.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prompts import make_prompts, warmup_prompts  # noqa: E402
from offline_throughput import ensure_checkpoint  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

PHASES: dict[str, float] = defaultdict(float)


def timer(totals: dict[str, float], key: str, fn):
    """`fn`, adding the wall time of every call to totals[key] (also benchmarks/decode_step_cpu.py)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t0

    return wrapper


def _timed(owner: type, name: str, phase: str) -> None:
    setattr(owner, name, timer(PHASES, phase, getattr(owner, name)))


def instrument() -> None:
    """Wrap the phase boundaries of one engine step (nested phases are subtracted in `phase_table`)."""
    from engine.detokenizer import IncrementalDetokenizer
    from engine.llm_engine import LLMEngine
    from engine.model import LlamaForCausalLM
    from engine.model_runner import ModelRunner
    from engine.sampler import Sampler
    from engine.scheduler import Scheduler

    _timed(LLMEngine, "step", "step")
    _timed(Scheduler, "schedule", "schedule")
    _timed(Scheduler, "update_from_output", "update_from_output")
    _timed(ModelRunner, "execute", "execute")
    _timed(ModelRunner, "prepare_inputs", "prepare_inputs")
    _timed(LlamaForCausalLM, "forward", "forward")
    _timed(LlamaForCausalLM, "compute_logits", "compute_logits")
    _timed(Sampler, "__call__", "sample")
    _timed(IncrementalDetokenizer, "add_token", "detokenize")


def phase_table(total_s: float) -> str:
    p = PHASES
    runner_other = p["execute"] - p["prepare_inputs"] - p["forward"] - p["compute_logits"] - p["sample"]
    engine_other = p["step"] - p["schedule"] - p["execute"] - p["update_from_output"] - p["detokenize"]
    rows = [
        ("schedule", p["schedule"]), ("prepare_inputs", p["prepare_inputs"]), ("model forward", p["forward"]),
        ("compute_logits (lm_head)", p["compute_logits"]), ("sample", p["sample"]),
        ("runner other (row picking, dicts)", runner_other), ("update_from_output", p["update_from_output"]),
        ("detokenize", p["detokenize"]), ("step other (outputs, bookkeeping)", engine_other),
        ("outside step (generate loop, add requests)", total_s - p["step"]),
    ]
    lines = [f"{'phase':<44}{'s':>9}{'share':>8}"]
    lines += [f"{name:<44}{sec:>9.3f}{sec / total_s:>8.1%}" for name, sec in rows]
    lines.append(f"{'total':<44}{total_s:>9.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="a model name from offline_throughput.MODEL_SPECS")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-profiler", action="store_true", help="also table torch ops by self CPU time")
    p.add_argument("--no-cprofile", action="store_true", help="skip the cProfile pass (slow cells)")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    print(f"profile config {vars(args)}", flush=True)

    model_dir = ensure_checkpoint(args.model)
    llm = LLM(model_dir, dtype=args.dtype, max_num_seqs=max(args.batch, 1), num_threads=args.threads)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    llm.generate(warmup_prompts(args.seed, [args.batch], args.prompt_len, vocab), params, use_tqdm=False)

    instrument()
    t0 = time.perf_counter()
    llm.generate(make_prompts(args.seed, args.batch, 0, args.prompt_len, vocab), params, use_tqdm=False)
    total_s = time.perf_counter() - t0
    print(f"\n== phases: batch={args.batch} {args.batch * args.output_len / total_s:.1f} output tokens/s")
    print(phase_table(total_s))

    if not args.no_cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        llm.generate(make_prompts(args.seed, args.batch, 1, args.prompt_len, vocab), params, use_tqdm=False)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
        text = out.getvalue()
        print("\n== cProfile, by self time\n" + text[text.index("ncalls") :].rstrip())

    if args.torch_profiler:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate(make_prompts(args.seed, args.batch, 2, args.prompt_len, vocab), params, use_tqdm=False)
        print("\n== torch ops, by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
