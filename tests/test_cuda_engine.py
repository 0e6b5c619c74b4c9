"""The engine on a CUDA device, end to end: every step through the Triton kernels (attention, norms, rotary,
quantized linears) and replayed from CUDA graphs, against the external oracle and against the CPU engine.

Skipped without a GPU (CI has none); run on one with `pytest tests/test_cuda_engine.py`. The kernels alone are
tested on CUDA by tests/test_kernels.py and tests/test_quant_triton.py, the graph replayer against the eager
CUDA runner by tests/test_cuda_graphs.py.
"""

import pytest
import torch
from test_engine_vs_hf import NEAR_TIE, assert_matches_hf, hf_model, prompts_for
from test_gguf import write_gguf_from_hf
from test_speculative import NGRAM, repetitive_prompts

from engine import LLM, SamplingParams
from engine.quantized_linear import QuantizedLinear
from engine.tiny_model import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MAX_MODEL_LEN = 256
LOGPROB_ATOL = 1e-4  # fp32 on both sides: the CUDA and CPU kernels differ in summation order only


def greedy(max_tokens: int, logprobs: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)


def cuda_llm(model_dir, **kwargs) -> LLM:
    llm = LLM(model_dir, device="cuda", max_model_len=MAX_MODEL_LEN, **kwargs)
    assert llm.engine.runtime.kv_caches[0][0].is_cuda
    return llm


def assert_same_until_a_near_tie(got, want, atol: float = LOGPROB_ATOL) -> None:
    """Two engines over the same weights: the same tokens and logprobs, except that a near-tie may go either way
    (then the rest of the sequence parts and is not compared)."""
    for a, b in zip(got, want, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        for step, (la, lb) in enumerate(zip(a.logprobs, b.logprobs, strict=True)):
            if a.token_ids[step] != b.token_ids[step]:
                best = sorted(lb.values(), key=lambda v: -v.logprob)
                assert best[0].logprob - best[1].logprob < NEAR_TIE, f"step {step}: not a near-tie"
                break
            assert all(abs(la[t].logprob - lb[t].logprob) < atol for t in la if t in lb), step


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_engine_matches_transformers_in_fp32(arch, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    llm = cuda_llm(model_dir, dtype="float32")
    assert llm.engine.runner.graph_replayer is not None and llm.engine.runner.graph_replayer.captured
    prompts = prompts_for(512, [1, 5, 17, 40, 100], seed=1)
    outs = llm.generate(prompts, greedy(24, logprobs=3), use_tqdm=False)
    hf = hf_model(model_dir)
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(hf, prompt, out.outputs[0].token_ids, out.outputs[0].logprobs)
    llm.engine.check_integrity()
    assert llm.engine.block_pool.num_free_blocks == llm.engine.num_kv_blocks


def test_cuda_bf16_engine_follows_the_fp32_one(tiny_llama_dir):
    """bf16 on the GPU (the dtype it serves in) against fp32 on the GPU: tokens equal until a near-tie at bf16's
    precision, the sampled tokens' logprobs close."""
    prompts = prompts_for(512, [3, 16, 33], seed=2)
    want = cuda_llm(tiny_llama_dir, dtype="float32").generate(prompts, greedy(16), use_tqdm=False)
    got = cuda_llm(tiny_llama_dir, dtype="bfloat16").generate(prompts, greedy(16), use_tqdm=False)
    for a, b in zip(got, want):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids[0] == b.token_ids[0] or _gap(b.logprobs[0], a.token_ids[0]) < 0.05
        for step, (la, lb) in enumerate(zip(a.logprobs, b.logprobs)):
            if a.token_ids[step] != b.token_ids[step]:
                assert _gap(lb, a.token_ids[step]) < 0.05, step
                break
            assert abs(la[a.token_ids[step]].logprob - lb[a.token_ids[step]].logprob) < 0.05, step


def _gap(logprobs: dict, token: int) -> float:
    """How far `token` is below the best entry of one step's logprobs (inf if it is not among them)."""
    best = max(v.logprob for v in logprobs.values())
    return best - logprobs[token].logprob if token in logprobs else float("inf")


@pytest.fixture(scope="module")
def tiny_q_dir(tmp_path_factory):
    """Widths that are multiples of 32 (int4 groups)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-cuda-q"), arch="llama", layers=2, hidden=64, heads=4,
                           kv_heads=2, vocab=512, intermediate=128, seed=3)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_cuda_quantized_linears_give_the_cpu_engines_output(tiny_q_dir, mode):
    """Round-to-nearest on load is the same computation on both devices (same numbers), so the Triton kernels
    must give what the C kernels give."""
    prompts = prompts_for(512, [2, 9, 40, 70], seed=4)
    want = LLM(tiny_q_dir, max_model_len=MAX_MODEL_LEN, quantization=mode).generate(prompts, greedy(20),
                                                                                     use_tqdm=False)
    llm = cuda_llm(tiny_q_dir, dtype="float32", quantization=mode)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 8 and all(m.kind == mode and m.qweight.is_cuda for m in layers)
    assert_same_until_a_near_tie(llm.generate(prompts, greedy(20), use_tqdm=False), want)


def test_cuda_gguf_kept_quantized_equals_dequantized(tiny_q_dir, tmp_path):
    path = write_gguf_from_hf(tiny_q_dir, tmp_path / "tiny.gguf", "llama", quantize_matrices=True)  # Q8_0
    prompts = prompts_for(512, [4, 30], seed=5)
    kept = cuda_llm(path, dtype="float32", quantization="auto")
    assert any(isinstance(m, QuantizedLinear) for m in kept.engine.model.modules())
    dense = cuda_llm(path, dtype="float32", quantization="none")
    assert not any(isinstance(m, QuantizedLinear) for m in dense.engine.model.modules())
    assert_same_until_a_near_tie(kept.generate(prompts, greedy(20), use_tqdm=False),
                                 dense.generate(prompts, greedy(20), use_tqdm=False))


def test_cuda_speculative_decoding_is_lossless(tiny_llama_dir):
    """Guesses verified as extra decode rows on the GPU (such steps run eagerly; plain ones replay graphs)."""
    prompts = repetitive_prompts()
    plain = cuda_llm(tiny_llama_dir, dtype="float32")
    spec = cuda_llm(tiny_llama_dir, dtype="float32", speculative_config=NGRAM)
    greedy_params = [greedy(n, logprobs=0) for n in (30, 24, 17, 40, 9)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy_params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy_params, use_tqdm=False)] == want
    seeded = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7 + i, ignore_eos=True)
              for i in range(len(prompts))]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, seeded, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, seeded, use_tqdm=False)] == want
    speculator = spec.engine.core.scheduler.speculator
    assert speculator.num_accepted_tokens > 0
    spec.engine.check_integrity()
    assert spec.engine.block_pool.num_free_blocks == spec.engine.num_kv_blocks
