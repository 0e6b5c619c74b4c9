"""Static-shape decode steps (engine/cuda_graphs.py's GraphReplayer inside the ModelRunner) against the
plain eager runner.

Off CUDA the graph replayer runs its padded buckets eagerly (`capture` is a no-op), so the bucket choice,
the padding and the scratch slot are tested here for real on CPU; the last test captures and replays
CUDA graphs where a GPU is present.
"""

import argparse
import importlib.util
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch

from duet.cli_common import add_engine_args, engine_config
from engine import LLM, SamplingParams
from engine.config import EngineConfig, ModelConfig, resolve_device
from engine.cuda_graphs import (
    SCRATCH_BLOCKS,
    GraphReplayer,
    batch_sizes_for,
    bucket_for,
    default_batch_sizes,
    make_graph_replayer,
)
from engine.model_runner import ModelRunner, allocate_kv_caches
from engine.sampler import Sampler
from engine.scheduler import ScheduledChunk
from engine.weights import build_model

HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
LOGPROB_ATOL = 1e-5  # fp32: the padded step differs from the eager one by GEMM shape (summation order) only
BATCH_SIZES = (1, 2, 4, 8)
MAX_MODEL_LEN = 256


# -- buckets -------------------------------------------------------------------------------------------------


def test_default_buckets_end_at_max_num_seqs():
    assert default_batch_sizes(128) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
    assert default_batch_sizes(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100)
    assert default_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert default_batch_sizes(8) == (1, 2, 4, 8)
    assert default_batch_sizes(3) == (1, 2, 3)
    assert default_batch_sizes(1) == (1,)
    assert batch_sizes_for(EngineConfig(max_num_seqs=64)) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    # given sizes: sorted, deduplicated, none above max_num_seqs
    assert batch_sizes_for(EngineConfig(max_num_seqs=16, cuda_graph_batch_sizes=[8, 1, 32, 4, 8])) == (1, 4, 8)
    assert batch_sizes_for(EngineConfig(max_num_seqs=16, cuda_graph_batch_sizes=(32,))) == (16,)


def test_bucket_is_the_smallest_that_holds_the_batch():
    sizes = default_batch_sizes(64)
    got = {n: bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 25, 33, 49, 64, 65)}
    assert got == {1: 1, 2: 2, 3: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 24, 25: 32, 33: 48, 49: 64, 64: 64, 65: None}


def decode(request_id, token, position, block_ids):
    return ScheduledChunk(request_id, [token], position, block_ids, True, SamplingParams(), [1], [])


@pytest.fixture(scope="module")
def small_runner(tiny_llama_dir):
    """A graph replayer over 8 pool blocks + the scratch block (id 8), tables 4 blocks wide, buckets 1, 2, 4."""
    config = ModelConfig.from_dir(tiny_llama_dir)
    model = build_model(config, tiny_llama_dir, torch.float32, max_positions=64)
    kv_caches = allocate_kv_caches(model, 8 + SCRATCH_BLOCKS, 16, torch.float32)
    return GraphReplayer(model, kv_caches, 16, batch_sizes=(1, 2, 4), max_blocks_per_seq=4, scratch_block=8)


def test_inputs_are_padded_to_the_bucket_into_the_scratch_slot(small_runner):
    r = small_runner
    chunks = [decode("a", 11, 0, [5]), decode("b", 12, 20, [2, 7]), decode("c", 13, 47, [1, 3, 0])]
    assert r.bucket_for_step(chunks) == 4
    r.load_inputs(chunks, 4)
    scratch_slot = 8 * 16
    assert r.rows[:, :4].tolist() == [
        [11, 12, 13, 0],  # input ids; padding: token 0
        [0, 20, 47, 0],  # positions; padding: 0
        [5 * 16, 7 * 16 + 4, 0 * 16 + 15, scratch_slot],  # slots; padding: the scratch slot
        [1, 21, 48, 1],  # context lengths; padding: 1 (its own token, in the scratch slot)
    ]
    assert r.block_tables[:4].tolist() == [[5, 8, 8, 8], [2, 7, 8, 8], [1, 3, 0, 8], [8, 8, 8, 8]]


def test_steps_the_static_buffers_cannot_hold_run_eagerly(small_runner):
    r = small_runner
    assert r.bucket_for_step([]) is None
    assert r.bucket_for_step([decode(str(i), 1, 3, [i]) for i in range(4)]) == 4
    assert r.bucket_for_step([decode(str(i), 1, 3, [i]) for i in range(5)]) is None  # past the largest bucket
    prefill = ScheduledChunk("p", [1, 2], 0, [0], True, SamplingParams(), [1, 2], [])
    assert r.bucket_for_step([decode("a", 1, 3, [1]), prefill]) is None  # a mixed step
    assert r.bucket_for_step([decode("a", 1, 70, [0, 1, 2, 3, 4])]) is None  # wider than the static table


def test_runner_rejects_a_scratch_block_outside_the_caches(small_runner):
    r = small_runner
    with pytest.raises(ValueError, match=r"scratch_block=9 is invalid: .* in \[0, 9\)"):
        GraphReplayer(r.model, r.kv_caches, 16, batch_sizes=(1,), max_blocks_per_seq=4, scratch_block=9)
    with pytest.raises(ValueError, match="batch_sizes=.* is invalid"):
        GraphReplayer(r.model, r.kv_caches, 16, batch_sizes=(4, 2), max_blocks_per_seq=4, scratch_block=8)


def test_runner_refuses_graph_replay_with_tensor_parallel_followers(small_runner):
    r = small_runner

    class Broadcaster:  # a StepBroadcaster that must never be reached
        def broadcast_step(self, input_ids, positions, meta, sample_rows):
            raise AssertionError("unreachable")

    with pytest.raises(ValueError, match="graph_replayer and step_broadcaster are invalid together"):
        ModelRunner(r.model, r.kv_caches, 16, Sampler(0), graph_replayer=r, step_broadcaster=Broadcaster())


# -- the static path gives the eager path's tokens -----------------------------------------------------------


def make_llm(model_dir, static: bool) -> LLM:
    llm = LLM(model_dir, max_model_len=MAX_MODEL_LEN, cuda_graph_batch_sizes=BATCH_SIZES)
    if static:  # what build_runtime does on CUDA, minus the capture
        rt = llm.engine.runtime
        replayer = make_graph_replayer(rt.model, rt.kv_caches, rt.config, rt.max_model_len,
                                       scratch_block=rt.num_kv_blocks)
        llm.engine.core.runner = ModelRunner(rt.model, rt.kv_caches, rt.block_size, Sampler(rt.config.seed),
                                             graph_replayer=replayer)
    return llm


def run_in_lockstep(llms: dict, schedule: dict[int, list], after_step=None) -> tuple[dict, int]:
    """Step every engine once per round, adding `schedule`'s requests at their step, until the first engine
    is done; `after_step()` runs after each round. Returns ({name: {request_id: its last CompletionOutput}},
    rounds)."""
    outputs, step, first = {name: {} for name in llms}, 0, next(iter(llms.values()))
    while step in schedule or first.engine.has_unfinished_requests():
        for name, llm in llms.items():
            for rid, prompt, params in schedule.get(step, []):
                llm.engine.add_request(prompt, params, request_id=rid)
            for out in llm.engine.step():
                outputs[name][out.request_id] = out.outputs[0]
        if after_step is not None:
            after_step()
        step += 1
    return outputs, step


def arrivals(vocab: int) -> dict[int, list]:
    """Requests joining at given steps so the running batch is 1, 3, 5 and 9 sequences (the last past the
    largest bucket), of different lengths, finishing at different steps so it shrinks across buckets."""
    g = torch.Generator().manual_seed(5)
    prompt_lens = [1, 17, 40, 5, 64, 2, 33, 16, 9]
    max_tokens = [90, 30, 75, 12, 50, 64, 3, 40, 21]
    prompts = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in max_tokens]
    joins = {0: [0], 3: [1, 2], 6: [3, 4], 10: [5, 6, 7, 8]}
    return {step: [(f"r{i}", prompts[i], params[i]) for i in ids] for step, ids in joins.items()}


def test_padded_static_steps_match_eager_tokens_logprobs_and_kv(tiny_llama_dir):
    eager, static = make_llm(tiny_llama_dir, False), make_llm(tiny_llama_dir, True)
    runner = static.engine.runner.graph_replayer
    buckets = Counter()
    run_bucket = runner.run_bucket
    runner.run_bucket = lambda b: buckets.update([b]) or run_bucket(b)
    num_blocks = eager.engine.num_kv_blocks
    assert static.engine.num_kv_blocks == num_blocks and runner.scratch_block == num_blocks
    schedule = arrivals(eager.engine.model_config.vocab_size)
    running_sizes, scratch_written = set(), False

    def check_step():
        nonlocal scratch_written
        running_sizes.add(eager.engine.scheduler.num_running)
        # every block a request can own holds the same K/V on both paths; only the scratch block differs
        for (ek, ev), (sk, sv) in zip(eager.engine.runtime.kv_caches, static.engine.runtime.kv_caches):
            for e, s in ((ek, sk), (ev, sv)):
                assert e.shape[1] == num_blocks + SCRATCH_BLOCKS
                torch.testing.assert_close(s[:, :num_blocks], e[:, :num_blocks], rtol=0, atol=1e-5)
                assert not e[:, num_blocks:].any()  # the eager path never touches it
                scratch_written |= bool(s[:, num_blocks:].any())

    outputs, step = run_in_lockstep({"eager": eager, "static": static}, schedule, check_step)
    assert step >= 90 and scratch_written
    assert {1, 3, 5, 9} <= running_sizes
    assert set(buckets) == {1, 2, 4, 8}  # 9 running ran eagerly; every bucket replayed
    assert sum(buckets.values()) > 64
    assert outputs["static"].keys() == outputs["eager"].keys() and len(outputs["eager"]) == 9
    for rid, want in outputs["eager"].items():
        got = outputs["static"][rid]
        assert got.finished() and got.token_ids == want.token_ids, rid
        for a, b in zip(got.logprobs, want.logprobs, strict=True):  # {sampled id: Logprob, then the top-k}
            assert list(a) == list(b) and [x.rank for x in a.values()] == [y.rank for y in b.values()]
            assert max(abs(a[t].logprob - b[t].logprob) for t in a) <= LOGPROB_ATOL
    for llm in (eager, static):
        llm.engine.check_integrity()
        pool = llm.engine.block_pool
        assert pool.num_free_blocks == pool.num_blocks == num_blocks


def test_static_path_matches_eager_for_sampled_requests_and_generate(tiny_llama_dir):
    """Seeded sampling and a plain `generate` of 5 prompts (the batch shrinks from bucket 8 to 1)."""
    eager, static = make_llm(tiny_llama_dir, False), make_llm(tiny_llama_dir, True)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (3, 30, 11, 50, 7)]
    params = [SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, seed=40 + n, ignore_eos=True)
              for n in (70, 5, 33, 20, 48)]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in static.generate(prompts, params)] == want
    static.engine.check_integrity()
    assert static.engine.block_pool.num_free_blocks == static.engine.num_kv_blocks


# -- configuration -------------------------------------------------------------------------------------------


def test_device_is_validated_and_resolved():
    with pytest.raises(ValueError, match=r"device='tpu' is invalid: must be one of cpu, cuda, auto"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes=.* is invalid"):
        EngineConfig(cuda_graph_batch_sizes=(4, 0))
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda' is invalid here"):
            resolve_device("cuda")


def test_cli_flags_map_onto_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    defaults = engine_config(parser.parse_args([]))
    assert (defaults.device, defaults.cuda_graphs, defaults.cuda_graph_batch_sizes) == ("cpu", True, None)
    args = parser.parse_args(["--device", "cuda", "--no-cuda-graphs", "--cuda-graph-batch-sizes", "1,2,4"])
    config = engine_config(args)
    assert (config.device, config.cuda_graphs, config.cuda_graph_batch_sizes) == ("cuda", False, (1, 2, 4))
    # `duet up` / `duet demo` pass them on to every worker
    assert config.to_flags()[-5:] == ["--device", "cuda", "--no-cuda-graphs", "--cuda-graph-batch-sizes", "1,2,4"]
    assert "--device" not in defaults.to_flags()


def test_cpu_engine_keeps_the_plain_runner(tiny_llama_dir):
    device = "cpu" if torch.cuda.is_available() else "auto"  # auto resolves to cpu on this machine
    llm = LLM(tiny_llama_dir, max_model_len=MAX_MODEL_LEN, device=device)
    runner = llm.engine.runner
    assert runner.graph_replayer is None  # cuda_graphs is on by default, but for CUDA only
    assert runner.step_broadcaster is None  # tp_size 1
    assert llm.engine.runtime.kv_caches[0][0].device.type == "cpu"


# -- the static step through the Triton kernels, in triton's CPU interpreter ---------------------------------


@pytest.mark.skipif(not HAVE_TRITON or INTERPRETED or torch.cuda.is_available(),
                    reason="triton is not installed" if not HAVE_TRITON else "the kernels run compiled here")
def test_static_path_with_triton_kernels_under_the_interpreter():
    """The static step as CUDA runs it (Triton kernels: full-width tables, lengths from the static rows), on
    CPU: a child process imports triton with TRITON_INTERPRET=1 (see tests/test_kernels.py)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", "interpreted"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert "1 passed" in proc.stdout, tail


@pytest.mark.skipif(not (HAVE_TRITON and INTERPRETED), reason="runs in the interpreter test's child process")
def test_interpreted_triton_static_steps_match_the_eager_twins(tiny_llama_dir, monkeypatch):
    modules = [f"engine.kernels.{m}" for m in ("decode_attention", "prefix_attention", "rmsnorm", "rotary")]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (1, 20, 7, 35, 3)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1) for n in (24, 6, 15, 10, 2)]
    want = make_llm(tiny_llama_dir, False).generate(prompts, params)  # the torch twins, eagerly
    for module in modules:  # each dispatcher's module (the package re-exports functions of the same names)
        monkeypatch.setattr(importlib.import_module(module), "use_triton", lambda x: True)  # a CUDA tensor's
    static = make_llm(tiny_llama_dir, True)
    buckets = Counter()
    runner = static.engine.runner.graph_replayer
    run_bucket = runner.run_bucket
    runner.run_bucket = lambda b: buckets.update([b]) or run_bucket(b)
    got = static.generate(prompts, params)
    assert set(buckets) == {1, 2, 4, 8}
    for a, b in ((x.outputs[0], y.outputs[0]) for x, y in zip(got, want, strict=True)):
        assert a.token_ids == b.token_ids
        pairs = zip(a.logprobs, b.logprobs, strict=True)
        assert max(abs(x[t].logprob - y[t].logprob) for x, y in pairs for t in x) <= 1e-4
    static.engine.check_integrity()


# -- CUDA: real capture and replay ---------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: capture and replay CUDA graphs")
def test_cuda_graphs_match_eager_cuda(tiny_llama_dir):
    kw = dict(device="cuda", dtype="float32", max_model_len=MAX_MODEL_LEN, cuda_graph_batch_sizes=BATCH_SIZES)
    graphs, eager = LLM(tiny_llama_dir, **kw), LLM(tiny_llama_dir, cuda_graphs=False, **kw)
    runner = graphs.engine.runner.graph_replayer
    assert isinstance(runner, GraphReplayer) and runner.captured
    assert eager.engine.runner.graph_replayer is None
    assert graphs.engine.runtime.kv_caches[0][0].is_cuda and next(graphs.engine.model.parameters()).is_cuda
    buckets = Counter()
    run_bucket = runner.run_bucket
    runner.run_bucket = lambda b: buckets.update([b]) or run_bucket(b)
    schedule = arrivals(graphs.engine.model_config.vocab_size)
    outputs, _ = run_in_lockstep({"eager": eager, "graphs": graphs}, schedule)
    assert set(buckets) == {1, 2, 4, 8}
    for rid, want in outputs["eager"].items():
        got = outputs["graphs"][rid]
        assert got.token_ids == want.token_ids, rid
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            sampled = next(iter(a))  # cuBLAS may pick another kernel for a padded batch:
            assert abs(a[sampled].logprob - b[sampled].logprob) <= 1e-4
    num_blocks = graphs.engine.num_kv_blocks
    for k, v in graphs.engine.runtime.kv_caches:
        for ek in (k, v):
            assert ek.shape[1] == num_blocks + SCRATCH_BLOCKS
    graphs.engine.check_integrity()
    assert graphs.engine.block_pool.num_free_blocks == num_blocks
