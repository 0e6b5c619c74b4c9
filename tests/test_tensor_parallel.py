"""Tensor parallelism on CPU: ranks are real processes joined by gloo; TP=2 (and TP=4, with replicated kv heads)
must give the same greedy tokens as TP=1 and logprobs within fp32 tolerance of TP=1 and of Hugging Face."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from test_engine_vs_hf import assert_matches_hf, hf_model, prompts_for

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.tensor_parallel import local_config, plan_shard

PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=4)


def test_shard_plan_exact_ranges(tiny_llama_dir):
    cfg = ModelConfig.from_dir(tiny_llama_dir)  # 4 heads, 2 kv heads, vocab 512
    s = plan_shard(cfg, 1, 2)
    assert (s.q_heads, s.kv_heads, s.vocab) == ((2, 4), (1, 2), (256, 512))
    assert s.intermediate == (cfg.intermediate_size // 2, cfg.intermediate_size)
    # 4 ranks over 2 kv heads: each kv head replicated on the 2 ranks whose query heads use it
    assert [plan_shard(cfg, r, 4).kv_heads for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [plan_shard(cfg, r, 4).q_heads for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    local = local_config(cfg, plan_shard(cfg, 0, 4))
    assert (local.num_heads, local.num_kv_heads, local.vocab_size) == (1, 1, 512)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not a multiple"):
        plan_shard(cfg, 0, 3)
    with pytest.raises(ValueError, match="tp=8 is invalid"):
        plan_shard(cfg, 0, 8)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_matches_tp1_and_hf(arch, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    prompts = prompts_for(ModelConfig.from_dir(model_dir).vocab_size, [1, 7, 17, 40], seed=9)
    ref = LLM(model_dir, max_model_len=256).generate(prompts, PARAMS)
    with LLM(model_dir, max_model_len=256, tp_size=2) as llm:
        out = llm.generate(prompts, PARAMS)
    hf = hf_model(model_dir)
    for prompt, a, b in ((p, x.outputs[0], y.outputs[0]) for p, x, y in zip(prompts, ref, out)):
        assert b.token_ids == a.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert list(la) == list(lb) and all(abs(la[t].logprob - lb[t].logprob) < 1e-5 for t in la)
        assert_matches_hf(hf, prompt, b.token_ids, b.logprobs)


def test_tp4_with_replicated_kv_heads_matches_tp1(tiny_llama_dir):
    prompts = prompts_for(512, [5, 33], seed=2)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = LLM(tiny_llama_dir, max_model_len=256).generate(prompts, params)
    with LLM(tiny_llama_dir, max_model_len=256, tp_size=4, max_num_batched_tokens=16) as llm:  # chunked prefill
        out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [r.outputs[0].token_ids for r in ref]


def test_killing_a_rank_fails_fast_and_leaves_no_process(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, max_model_len=256, tp_size=2)
    follower = llm.engine.runtime.followers[0]
    os.kill(follower.pid, signal.SIGKILL)
    follower.wait(5)
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))
    assert time.monotonic() - start < 30
    llm.close()


def test_followers_die_with_rank_0(tiny_llama_dir):
    script = (f"import os, sys\nfrom engine import LLM\nllm = LLM({str(tiny_llama_dir)!r}, max_model_len=256, "
              "tp_size=2)\nprint(llm.engine.runtime.followers[0].pid, flush=True)\nos._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}"), "a follower rank outlived rank 0"


def test_generate_cli_with_tp(tiny_llama_dir):
    ref = LLM(tiny_llama_dir).generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0))[0].outputs[0]
    out = subprocess.run([sys.executable, "-m", "duet", "generate", "--model", str(tiny_llama_dir), "--tp", "2",
                          "--prompt-ids", "5,6,7", "--max-tokens", "5", "--json"], capture_output=True, text=True,
                         timeout=120, check=True)
    import json

    assert json.loads(out.stdout)["token_ids"] == ref.token_ids


def test_step_payload_round_trip_with_a_mask_or_with_lengths(monkeypatch):
    """Rank 0 packs a step as int64 on the host whether its metadata carries a mask or lengths; a follower rebuilds
    the same step for its own device: the lengths, and the mask where its attention runs the torch twin."""
    import torch

    from engine.attention import AttentionMetadata, PrefillChunk
    from engine.kernels import cpu_native
    from engine.tp_runner import pack_step, unpack_step

    bs, lens = 4, [3, 9]
    block_ids = torch.tensor([5, 0, 0, 7, 8, 2])  # two decodes, 3 blocks wide, padded
    past_end = torch.arange(3 * bs) >= torch.tensor(lens).unsqueeze(1)
    mask = torch.zeros(past_end.shape).masked_fill_(past_end, float("-inf"))
    prefill = PrefillChunk(2, 3, 7, torch.tensor([1, 4]))
    ids, pos = torch.tensor([10, 11, 12, 13, 14]), torch.tensor([2, 8, 4, 5, 6])
    slots = torch.tensor([22, 40, 20, 21, 22])
    with_mask = AttentionMetadata(slots, 2, block_ids, mask, [prefill])
    with_lens = AttentionMetadata(slots, 2, block_ids, None, [prefill],
                                  decode_context_lens=torch.tensor(lens, dtype=torch.int32))
    packed = [pack_step(ids, pos, meta, bs, [1, 4]) for meta in (with_mask, with_lens)]
    assert all(torch.equal(a, b) for a, b in zip(*packed))
    i2, p2, meta, rows = unpack_step(*packed[1], bs)  # on CPU: the lengths, which the C attention reads
    assert torch.equal(i2, ids) and torch.equal(p2, pos) and rows == [1, 4]
    assert meta.decode_context_lens.tolist() == lens and meta.decode_context_lens.dtype == torch.int32
    assert (meta.decode_mask is None) == (cpu_native.native_library() is not None)
    assert torch.equal(meta.decode_block_ids, block_ids) and torch.equal(meta.slot_mapping, slots)
    monkeypatch.setattr(cpu_native, "_library", None)  # no C kernels: the torch twin's mask comes back too
    monkeypatch.setattr(cpu_native, "_tried", True)
    meta = unpack_step(*packed[1], bs)[2]
    assert torch.equal(meta.decode_mask, mask) and meta.decode_context_lens.tolist() == lens
    (chunk,) = meta.prefills
    assert (chunk.query_start, chunk.num_query_tokens, chunk.num_context_tokens) == (2, 3, 7)
    assert torch.equal(chunk.block_table, prefill.block_table)
