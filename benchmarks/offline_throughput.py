"""Offline throughput: duet vs Hugging Face `generate` vs vLLM, same prompts, same machine, same run.

    make bench                                   # = .venv/bin/python benchmarks/offline_throughput.py
    .venv/bin/python benchmarks/offline_throughput.py --models small --dtypes float32 --batches 1,8 --repeats 3

For every model x dtype x batch size each engine generates `--output-len` tokens (greedy, EOS ignored) for
a batch of equal-length random prompts; the figure is output tokens/s over the whole `generate` call
(prefill included), min/median/max over repeats, and the ratio that matters: duet / competitor, of medians.
At batch 1 duet's decode rate is also set against the memory-bandwidth ceiling (see `bandwidth.py`).

Fairness: one thread count for every engine (`--threads`); fresh prompts per repeat, so no engine gets a
prefix-cache hit; each engine builds its model once and runs one untimed warm-up batch (<= 8 prompts)
first. vLLM runs in its own venv (`setup_vllm.sh`) as a subprocess (`vllm_worker.py`) with its default CPU
setup (torch.compile'd model, its own thread binding, no core reserved). duet's and vLLM's timed calls
alternate, cell by cell (duet first on even repeats, vLLM first on odd ones; the idle engine waits), so a
shared machine's drift over minutes hits both alike; `--sequential` times each engine's whole matrix in turn
instead (the older method). HF runs after them, in this process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bandwidth import Spread, decode_step_bytes, measure_read_bandwidth, weight_bytes_per_decode_step  # noqa: E402
from bench_prompts import check_prompt, make_prompts, warmup_prompts  # noqa: E402
from vllm_session import VllmSession  # noqa: E402

from engine.config import ModelConfig  # noqa: E402

CACHE_DIR = Path(os.environ.get("DUET_CACHE_DIR") or Path.home() / ".cache" / "duet")
MODELS_DIR = CACHE_DIR / "bench-models"
VLLM_VENV = Path(os.environ.get("DUET_VLLM_VENV") or CACHE_DIR / "vllm-venv")
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
ENGINES = ("duet", "hf", "vllm")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}

# Random checkpoints, made once by `engine.tiny_model.make_tiny_model`. Bump a name's suffix when its
# arguments change, so a stale cached checkpoint is never reused.
MODEL_SPECS = {
    "small": ("small-llama-v1", dict(arch="llama", layers=4, hidden=256, heads=8, kv_heads=2, vocab=4096, seed=0)),
    "qwen05b": ("qwen2-0.5b-shape-v1", dict(
        arch="qwen2", layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864, vocab=151936,
        max_position_embeddings=32768, tie_word_embeddings=True, seed=0, initializer_range=0.02,
    )),
}
# Cells that take 0.5-3 min per repeat per engine on 2 cores (bf16 has no native units on AVX-512 parts
# without avx512_bf16): model -> the smallest batch from which `--slow-repeats` replaces `--repeats`.
# With the defaults a full run should take ~35 min on a quiet 2-core Xeon (estimated from benchmarks/RESULTS.md's
# cell timings; two thirds of it qwen05b / bf16).
SLOW_CELLS = {"qwen05b": 8}
# Real checkpoints, by name: the embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF, loaded dense in the cell's dtype).
REAL_MODELS = ("smollm2",)


@dataclass(frozen=True)
class BenchConfig:
    models: list[str]
    dtypes: list[str]
    batches: list[int]
    repeats: int
    slow_repeats: int
    prompt_len: int
    output_len: int
    seed: int
    threads: int
    skip_hf: bool
    skip_vllm: bool
    sequential: bool
    vllm_kv_cache_gib: int
    bandwidth_bytes: int
    markdown: str | None
    json_out: str | None

    @property
    def max_num_batched_tokens(self) -> int:
        """Per-step token budget, the same for duet and vLLM: a whole batch-64 prefill fits in one step."""
        return max(2048, self.prompt_len + self.output_len)

    @property
    def interleaved(self) -> bool:
        """Whether duet's and vLLM's cells alternate (the default whenever vLLM runs)."""
        return not (self.skip_vllm or self.sequential)

    def repeats_for(self, model: str, batch: int) -> int:
        slow = model in SLOW_CELLS and batch >= SLOW_CELLS[model]
        return min(self.repeats, self.slow_repeats) if slow else self.repeats


@dataclass
class EngineRun:
    """One engine on one model x dtype: tokens/s per repeat per batch size, or why it failed."""

    output_tokens_per_s: dict[int, list[float]] = field(default_factory=dict)
    check_token_ids: list[int] | None = None
    decode_tokens_per_s_b1: list[float] = field(default_factory=list)  # duet only: after the first token
    startup_s: float | None = None
    error: str | None = None


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="small,qwen05b,smollm2",
                   help=f"comma-separated, from {', '.join([*MODEL_SPECS, *REAL_MODELS])}")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated, from float32, bfloat16")
    p.add_argument("--batches", default="1,8,32,64", help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per cell")
    p.add_argument("--slow-repeats", type=int, default=1,
                   help=f"repeats for the slow cells {SLOW_CELLS} (model: from batch size), to bound run time")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, the same for every engine")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--sequential", action="store_true",
                   help="time duet's whole matrix, then vLLM's, instead of alternating their cells")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=2)
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="tensor size for the DRAM bandwidth probe")
    p.add_argument("--markdown", metavar="OUT", help="append a results section to this Markdown file")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write the raw results as JSON")
    a = p.parse_args(argv)
    models, dtypes = a.models.split(","), a.dtypes.split(",")
    for name in models:
        if name not in MODEL_SPECS and name not in REAL_MODELS:
            p.error(f"--models: {name!r} is not one of {', '.join([*MODEL_SPECS, *REAL_MODELS])}")
    for name in dtypes:
        if name not in DTYPE_BYTES:
            p.error(f"--dtypes: {name!r} is not one of {', '.join(DTYPE_BYTES)}")
    batches = [int(b) for b in a.batches.split(",")]
    for name, value in (("repeats", a.repeats), ("slow-repeats", a.slow_repeats), ("prompt-len", a.prompt_len),
                        ("output-len", a.output_len), ("threads", a.threads), ("batches", min(batches))):
        if value < 1:
            p.error(f"--{name}={value} is invalid: must be >= 1")
    return BenchConfig(models, dtypes, batches, a.repeats, a.slow_repeats, a.prompt_len, a.output_len, a.seed,
                       a.threads, a.skip_hf, a.skip_vllm, a.sequential, a.vllm_kv_cache_gib, a.bandwidth_mib * 2**20,
                       a.markdown, a.json_out)


def ensure_checkpoint(name: str) -> Path:
    """The model's checkpoint: a random one's directory, made on first use, or a real one's file (`REAL_MODELS`)."""
    if name == "smollm2":
        from engine.default_model import default_model_path

        return default_model_path()
    dir_name, kwargs = MODEL_SPECS[name]

    def make(tmp: Path) -> None:
        from engine.tiny_model import make_tiny_model

        make_tiny_model(tmp, dtype="float32", **kwargs)

    return made_once(MODELS_DIR / dir_name, f"make_checkpoint model={name}", make)


def made_once(target: Path, event: str, make) -> Path:
    """`target`, a directory `make(tmp)` fills, made on first use: in a temp dir renamed into place, so an
    interrupted run never leaves a half-made one that a later run would take."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        print(f"bench event={event} dir={target}", flush=True)
        make(tmp)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# -- engines -------------------------------------------------------------------------------------------


class DuetSession:
    """duet's engine built and warmed up once; `cell` times one generate of the benchmark's prompts."""

    def __init__(self, model_dir: Path, dtype: str, vocab: int, cfg: BenchConfig):
        from engine import LLM, SamplingParams

        self.cfg, self.vocab = cfg, vocab
        t0 = time.perf_counter()
        self.llm = LLM(model_dir, dtype=dtype, max_num_seqs=max(cfg.batches),
                       num_threads=cfg.threads, max_num_batched_tokens=cfg.max_num_batched_tokens)
        self.startup_s = time.perf_counter() - t0
        self.params = SamplingParams(max_tokens=cfg.output_len, ignore_eos=True, temperature=0)
        [check] = self.llm.generate([check_prompt(cfg.seed, cfg.prompt_len, vocab)], self.params, use_tqdm=False)
        self.check_token_ids = list(check.outputs[0].token_ids)
        self._timed(warmup_prompts(cfg.seed, cfg.batches, cfg.prompt_len, vocab))

    def _timed(self, prompts: list[list[int]]) -> tuple[float, float]:
        """(whole call, decode after the first token) seconds; checks every prompt got output_len tokens."""
        first_s = None
        counts = []
        num_tokens: dict[str, int] = {}
        t0 = time.perf_counter()
        for out in self.llm.generate_stream(prompts, self.params):  # deltas
            first_s = first_s or time.perf_counter()
            num_tokens[out.request_id] = num_tokens.get(out.request_id, 0) + len(out.outputs[0].token_ids)
            if out.finished:
                counts.append(num_tokens[out.request_id])
        end_s = time.perf_counter()
        want = self.cfg.output_len
        assert counts == [want] * len(prompts), f"duet generated {counts}, expected {want} each"
        return end_s - t0, end_s - first_s

    def cell(self, batch: int, repeat: int) -> tuple[float, float]:
        """(output tokens/s of the whole call, decode tokens/s after each sequence's first token)."""
        cfg = self.cfg
        total_s, decode_s = self._timed(make_prompts(cfg.seed, batch, repeat, cfg.prompt_len, self.vocab))
        return batch * cfg.output_len / total_s, (cfg.output_len - 1) / decode_s


def run_duet(model_dir: Path, model: str, dtype: str, vocab: int, cfg: BenchConfig,
             vllm: VllmSession | None = None) -> dict[str, EngineRun]:
    """duet's cells, alternated with vLLM's when a session is given (see the module docstring): {"duet": ...}
    and, with a session, {"vllm": ...}. A vLLM failure ends its cells and leaves duet's figures."""
    duet = DuetSession(model_dir, dtype, vocab, cfg)
    runs = {"duet": EngineRun(startup_s=duet.startup_s, check_token_ids=duet.check_token_ids)}
    if vllm is not None:
        runs["vllm"] = EngineRun(startup_s=vllm.startup_s, check_token_ids=vllm.check_token_ids)
    for batch in cfg.batches:
        for run in runs.values():
            run.output_tokens_per_s[batch] = []
        for repeat in range(cfg.repeats_for(model, batch)):
            for engine in ("duet", "vllm") if repeat % 2 == 0 else ("vllm", "duet"):
                if engine == "duet":
                    rate, decode_rate = duet.cell(batch, repeat)
                    if batch == 1:
                        runs["duet"].decode_tokens_per_s_b1.append(decode_rate)
                elif vllm is None:
                    continue
                else:
                    try:
                        rate = vllm.cell(batch, repeat)
                    except Exception as e:
                        runs["vllm"].error = f"{type(e).__name__}: {e}"
                        vllm.close()
                        vllm = None
                        continue
                runs[engine].output_tokens_per_s[batch].append(rate)
                _progress(engine, model, dtype, batch, repeat, rate)
    return runs


def run_hf(model_dir: Path, model: str, dtype: str, vocab: int, cfg: BenchConfig) -> EngineRun:
    from transformers import AutoModelForCausalLM

    run = EngineRun()
    t0 = time.perf_counter()
    if model_dir.is_file():  # a GGUF file: transformers dequantizes it, as duet does
        hf = AutoModelForCausalLM.from_pretrained(model_dir.parent, gguf_file=model_dir.name,
                                                  dtype=getattr(torch, dtype)).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    run.startup_s = time.perf_counter() - t0
    eos = hf.generation_config.eos_token_id
    pad_id = eos[0] if isinstance(eos, list) else eos

    @torch.inference_mode()
    def generate(prompts: list[list[int]]) -> tuple[float, torch.Tensor]:
        ids = torch.tensor(prompts)
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=cfg.output_len,
                          min_new_tokens=cfg.output_len, pad_token_id=pad_id)
        elapsed_s = time.perf_counter() - t0
        assert out.shape == (len(prompts), cfg.prompt_len + cfg.output_len), f"HF output shape {tuple(out.shape)}"
        return elapsed_s, out[:, cfg.prompt_len :]

    run.check_token_ids = generate([check_prompt(cfg.seed, cfg.prompt_len, vocab)])[1][0].tolist()
    generate(warmup_prompts(cfg.seed, cfg.batches, cfg.prompt_len, vocab))
    for batch in cfg.batches:
        rates = run.output_tokens_per_s[batch] = []
        for repeat in range(cfg.repeats_for(model, batch)):
            elapsed_s, _ = generate(make_prompts(cfg.seed, batch, repeat, cfg.prompt_len, vocab))
            rates.append(batch * cfg.output_len / elapsed_s)
            _progress("hf", model, dtype, batch, repeat, rates[-1])
    return run


def dense_copy(gguf_path: Path) -> Path:
    """A Hugging Face checkpoint directory of a GGUF file's weights, dequantized by transformers (made once):
    what vLLM's CPU build loads for the real model, the same weights duet and HF dequantize from the file."""

    def make(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kwargs = dict(gguf_file=gguf_path.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
        # transformers refuses to save a model loaded from GGUF: a plain one of the same config takes its weights
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs).save_pretrained(tmp)

    return made_once(MODELS_DIR / f"{gguf_path.stem}-dense-v1", f"dense_copy model={gguf_path.name}", make)


def vllm_command(model_dir: Path, model: str, dtype: str, cfg: BenchConfig, serve: bool) -> list[str]:
    if model_dir.is_file():  # a GGUF file: vLLM gets the same weights as a dense checkpoint
        model_dir = dense_copy(model_dir)
    cmd = [str(VLLM_VENV / "bin" / "python"), str(WORKER), "--model", str(model_dir), "--dtype", dtype,
           "--batches", ",".join(map(str, cfg.batches)),
           "--repeats", ",".join(str(cfg.repeats_for(model, b)) for b in cfg.batches),
           "--prompt-len", str(cfg.prompt_len), "--output-len", str(cfg.output_len), "--seed", str(cfg.seed),
           "--max-num-batched-tokens", str(cfg.max_num_batched_tokens), "--kv-cache-gib", str(cfg.vllm_kv_cache_gib),
           "--threads", str(cfg.threads)]
    if serve:
        cmd.append("--serve")
    print(f"bench event=vllm_start model={model} dtype={dtype} cmd={shlex.join(cmd)}", flush=True)
    return cmd


def run_duet_and_vllm(model_dir: Path, model: str, dtype: str, vocab: int, cfg: BenchConfig) -> dict[str, EngineRun]:
    """vLLM started as a session, then `run_duet` alternating with it; duet alone if it cannot start."""
    if not (VLLM_VENV / "bin" / "python").exists():
        error = f"no vLLM venv at {VLLM_VENV}: run benchmarks/setup_vllm.sh"
        return {**run_duet(model_dir, model, dtype, vocab, cfg), "vllm": EngineRun(error=error)}
    try:  # first, so that its start-up (torch.compile) does not share the machine with duet's
        vllm = VllmSession(vllm_command(model_dir, model, dtype, cfg, serve=True))
    except Exception as e:
        return {**run_duet(model_dir, model, dtype, vocab, cfg), "vllm": EngineRun(error=f"{type(e).__name__}: {e}")}
    with vllm:
        return run_duet(model_dir, model, dtype, vocab, cfg, vllm)


def run_vllm(model_dir: Path, model: str, dtype: str, cfg: BenchConfig) -> EngineRun:
    if not (VLLM_VENV / "bin" / "python").exists():
        return EngineRun(error=f"no vLLM venv at {VLLM_VENV}: run benchmarks/setup_vllm.sh")
    cmd = vllm_command(model_dir, model, dtype, cfg, serve=False)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            result = json.loads(line.removeprefix("VLLM_RESULT "))
            run = EngineRun(
                output_tokens_per_s={int(b): r for b, r in result["output_tokens_per_s"].items()},
                check_token_ids=result["check_token_ids"],
                startup_s=result["startup_s"],
            )
            for batch, rates in run.output_tokens_per_s.items():
                for repeat, rate in enumerate(rates):
                    _progress("vllm", model, dtype, batch, repeat, rate)
            return run
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return EngineRun(error=f"vllm_worker exited {proc.returncode}: {' | '.join(tail)}")


def _progress(engine: str, model: str, dtype: str, batch: int, repeat: int, rate: float) -> None:
    print(f"bench engine={engine} model={model} dtype={dtype} batch={batch} repeat={repeat} "
          f"output_tokens_per_s={rate:.1f}", flush=True)


# -- one model x dtype -----------------------------------------------------------------------------


def bench_cell(model: str, dtype: str, cfg: BenchConfig) -> dict:
    model_dir = ensure_checkpoint(model)
    mcfg = ModelConfig.from_path(model_dir)
    runs: dict[str, EngineRun] = {}
    load_before = os.getloadavg()[0]
    weight_bytes = weight_bytes_per_decode_step(mcfg, DTYPE_BYTES[dtype])
    # Right before duet's batch-1 timing, so ceiling and measurement share the machine's mood.
    dram = measure_read_bandwidth(cfg.bandwidth_bytes)
    cache_sized = measure_read_bandwidth(max(weight_bytes, 2**20))
    if cfg.interleaved:
        engines = [("duet+vllm", lambda: run_duet_and_vllm(model_dir, model, dtype, mcfg.vocab_size, cfg))]
    else:
        engines = [("duet", lambda: run_duet(model_dir, model, dtype, mcfg.vocab_size, cfg))]
    if not cfg.skip_hf:
        engines.append(("hf", lambda: {"hf": run_hf(model_dir, model, dtype, mcfg.vocab_size, cfg)}))
    if not (cfg.skip_vllm or cfg.interleaved):
        engines.append(("vllm", lambda: {"vllm": run_vllm(model_dir, model, dtype, cfg)}))
    for name, fn in engines:
        try:
            runs.update(fn())
        except Exception as e:  # one engine failing must not lose the others' figures
            for engine in name.split("+"):
                runs[engine] = EngineRun(error=f"{type(e).__name__}: {e}")
            print(f"bench engine={name} model={model} dtype={dtype} event=failed error={type(e).__name__}: {e!r}",
                  flush=True)
        gc.collect()
    context = cfg.prompt_len + cfg.output_len // 2  # the mean context over the decode steps
    step_bytes = decode_step_bytes(mcfg, DTYPE_BYTES[dtype], context)
    return {
        "model": model, "dtype": dtype, "model_dir": str(model_dir),
        "weight_bytes": weight_bytes, "decode_step_bytes": step_bytes, "mean_context_tokens": context,
        "dram_bandwidth": asdict(dram), "cache_sized_bandwidth": asdict(cache_sized),
        "runs": {name: asdict(run) for name, run in runs.items()},
        "load_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)],
    }


# -- report -------------------------------------------------------------------------------------------


def _fmt(values: list[float] | None) -> str:
    if not values:
        return "-"
    s = Spread.of(values)
    return f"{s.median:,.1f} ({s.min:,.1f}-{s.max:,.1f}, n={len(values)})"


def _ratio(a: list[float] | None, b: list[float] | None, pick=None) -> str:
    if not a or not b:
        return "-"
    if pick is None:
        return f"{Spread.of(a).median / Spread.of(b).median:.2f}"
    return f"{pick(a) / pick(b):.2f}"


def _agreement(a: list[int] | None, b: list[int] | None) -> str:
    if not a or not b:
        return "-"
    if a == b:
        return f"all {len(a)} identical"
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"first {same} of {len(a)} identical"


def report(cells: list[dict], cfg: BenchConfig, env: dict) -> str:
    lines = ["## Offline throughput", "",
             f"- date: {env['date']}", f"- machine: {env['machine']}", f"- duet commit: {env['engine_commit']}",
             f"- command: `{env['command']}`",
             f"- config: `{json.dumps(env['config'])}`", f"- versions: {env['versions']}", "",
             "Output tokens/s, median (min-max, n=repeats), whole `generate` call incl. prefill. "
             + ("duet's and vLLM's timed calls alternated cell by cell (duet first on even repeats). "
                if cfg.interleaved else "Each engine's matrix was timed in turn. ") +
             "Ratios are of medians; `best` ratios are of the fastest repeats (on a shared machine other "
             "processes only ever slow a repeat down, so the fastest one is the least disturbed).", ""]
    for cell in cells:
        runs = cell["runs"]
        lines += [f"### {cell['model']} / {cell['dtype']}", "",
                  f"1-min load average before / after: {cell['load_1min'][0]} / {cell['load_1min'][1]} "
                  f"(on {os.cpu_count()} cores).", "",
                  "| batch | duet | HF transformers | vLLM | duet/HF | duet/vLLM | best duet/HF | best duet/vLLM |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for batch in cfg.batches:
            get = {name: (runs.get(name) or {}).get("output_tokens_per_s", {}).get(batch) for name in ENGINES}
            lines.append(f"| {batch} | {_fmt(get['duet'])} | {_fmt(get['hf'])} | {_fmt(get['vllm'])} "
                         f"| {_ratio(get['duet'], get['hf'])} | {_ratio(get['duet'], get['vllm'])} "
                         f"| {_ratio(get['duet'], get['hf'], max)} | {_ratio(get['duet'], get['vllm'], max)} |")
        for name in ENGINES:
            run = runs.get(name)
            if run and run.get("error"):
                lines.append(f"\n{name} failed: {run['error']}")
        lines.append("")
    lines += ["### Batch-1 decode vs the memory-bandwidth ceiling", "",
              "Bytes per decode step = all weights read once (lm_head incl.) + K/V at the mean decode context. "
              "Ceiling = the fastest DRAM read bandwidth measured in this run (`torch.sum` over "
              f"{cfg.bandwidth_bytes / 2**30:g} GiB) / bytes per step. duet decode = tokens after the first / "
              "time after the first. A model whose weights fit in the last-level cache reads faster than DRAM "
              "(last column), so its row is bound by per-step overhead, not by this ceiling.", "",
              "| model / dtype | bytes/step (MB) | DRAM read GB/s, median (min-max) | ceiling tok/s | "
              "duet decode tok/s | duet / ceiling | read GB/s at weight size (max) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for cell in cells:
        dram, at_weights = Spread(**cell["dram_bandwidth"]), Spread(**cell["cache_sized_bandwidth"])
        step = cell["decode_step_bytes"]
        ceiling = dram.max / step
        duet_decode = cell["runs"].get("duet", {}).get("decode_tokens_per_s_b1") or []
        frac = f"{Spread.of(duet_decode).median / ceiling:.0%}" if duet_decode else "-"
        lines.append(
            f"| {cell['model']} / {cell['dtype']} | {step / 1e6:,.1f} | {dram.median / 1e9:.1f} "
            f"({dram.min / 1e9:.1f}-{dram.max / 1e9:.1f}) | {ceiling:,.1f} | {_fmt(duet_decode)} | {frac} "
            f"| {at_weights.max / 1e9:.1f} |")
    lines += ["", "### Greedy tokens of the check prompt (first divergence)", "",
              "| model / dtype | duet vs HF | duet vs vLLM | HF vs vLLM |", "|---|---|---|---|"]
    for cell in cells:
        ids = {name: (cell["runs"].get(name) or {}).get("check_token_ids") for name in ENGINES}
        lines.append(f"| {cell['model']} / {cell['dtype']} | {_agreement(ids['duet'], ids['hf'])} "
                     f"| {_agreement(ids['duet'], ids['vllm'])} | {_agreement(ids['hf'], ids['vllm'])} |")
    return "\n".join(lines) + "\n"


def _short_path(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _environment(cfg: BenchConfig) -> dict:
    model_name = platform.processor() or "unknown CPU"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model_name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    import transformers

    root = Path(__file__).resolve().parent.parent
    try:
        git = ["git", "-C", str(root)]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "engine"], capture_output=True, text=True).stdout
        commit = (commit or "unknown") + (" (engine/ has uncommitted changes)" if dirty.strip() else "")
    except OSError:
        commit = "unknown"
    return {
        "engine_commit": commit,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} cores, no GPU, {model_name}",
        "command": shlex.join([_short_path(sys.executable), *sys.argv]),
        "config": asdict(cfg),
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, "
                    f"python {platform.python_version()}",
    }


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    import engine.llm  # noqa: F401  load the engine now, so the commit recorded below is the code measured

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    env = _environment(cfg)
    print(f"bench event=config {json.dumps(env)}", flush=True)
    cells = []
    t0 = time.perf_counter()
    for model in cfg.models:
        for dtype in cfg.dtypes:
            cells.append(bench_cell(model, dtype, cfg))
    env["elapsed_s"] = round(time.perf_counter() - t0)
    text = report(cells, cfg, env) + f"\nTotal run time: {env['elapsed_s']} s.\n"
    print(text, flush=True)
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps({"env": env, "cells": cells}, indent=1))
    if cfg.markdown:
        with open(cfg.markdown, "a", encoding="utf-8") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
