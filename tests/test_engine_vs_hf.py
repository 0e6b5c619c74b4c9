"""The external oracle: Hugging Face transformers on the same checkpoint.

Logits are compared with an fp32 tolerance; greedy tokens must match except at near-ties (where the
reference's best and our pick differ by less than NEAR_TIE in logit), which random tiny models have.
"""

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.model_runner import ModelRunner, allocate_kv_caches
from engine.scheduler import ScheduledChunk
from engine.weights import build_model

LOGIT_ATOL = 1e-4
NEAR_TIE = 1e-3
PROMPT_LENS = [1, 5, 16, 17, 40, 100]


def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def prompts_for(vocab, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


@torch.no_grad()
def hf_logits(model, token_ids):
    return model(torch.tensor([token_ids])).logits[0].float()


def assert_matches_hf(hf, prompt, output, logprobs=None):
    """Teacher-force the reference on our tokens; check each step's pick and logprobs."""
    logits = hf_logits(hf, prompt + output[:-1])[len(prompt) - 1 :]
    ref_logprobs = torch.log_softmax(logits, dim=-1)
    for step, token in enumerate(output):
        best = int(logits[step].argmax())
        gap = float(logits[step, best] - logits[step, token])
        assert token == best or gap < NEAR_TIE, f"step {step}: got {token}, reference {best} (gap {gap:.2e})"
        if logprobs is not None:
            lp = logprobs[step]  # {sampled id: Logprob, then the top-k}: k or k + 1 entries
            assert next(iter(lp)) == token
            for token_id, value in lp.items():
                assert abs(value.logprob - float(ref_logprobs[step, token_id])) < LOGIT_ATOL
            best = sorted((v.logprob for v in lp.values()), reverse=True)[: len(lp) - 1]
            ref_top = ref_logprobs[step].topk(len(best)).values
            assert torch.allclose(torch.tensor(best), ref_top, atol=LOGIT_ATOL)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    return model_dir, hf_model(model_dir)


def test_checkpoints_cover_the_required_variants(tiny_llama_dir, tiny_qwen2_dir):
    llama, qwen2 = ModelConfig.from_dir(tiny_llama_dir), ModelConfig.from_dir(tiny_qwen2_dir)
    assert llama.num_kv_heads < llama.num_heads and not llama.tie_word_embeddings and not llama.qkv_bias
    assert qwen2.num_kv_heads < qwen2.num_heads and qwen2.tie_word_embeddings and qwen2.qkv_bias


def run_chunks(model, kv, chunks):
    runner = ModelRunner(model, kv, kv[0][0].shape[2], sampler=None)
    ordered = [c for c in chunks if len(c.token_ids) == 1] + [c for c in chunks if len(c.token_ids) > 1]
    with torch.no_grad():
        ids, pos, meta = runner.prepare_inputs(ordered)
        return model.compute_logits(model(ids, pos, kv, meta)), ordered


def test_model_logits_match_hf_through_prefill_prefix_and_decode(checkpoint):
    """Raw logits at every position: a plain prefill, a chunk after a cached prefix, then 64 decodes."""
    model_dir, hf = checkpoint
    config = ModelConfig.from_dir(model_dir)
    model = build_model(config, model_dir, torch.float32, 512)
    kv = allocate_kv_caches(model, num_blocks=64, block_size=16, dtype=torch.float32)
    ids = prompts_for(config.vocab_size, [100])[0]
    ref = hf_logits(hf, ids)
    blocks = list(range(20, 27))  # scattered, non-zero ids: slot arithmetic must be right

    def chunk(a, b):
        return ScheduledChunk("r", ids[a:b], a, blocks, True, SamplingParams(), [], [])

    got = [run_chunks(model, kv, [chunk(0, 21)])[0], run_chunks(model, kv, [chunk(21, 36)])[0]]
    got += [run_chunks(model, kv, [chunk(t, t + 1)])[0] for t in range(36, 100)]
    got = torch.cat(got)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=LOGIT_ATOL, rtol=0)


def test_mixed_batch_of_decodes_and_prefills_matches_hf(checkpoint):
    """One step holding decodes of different lengths and prefill chunks, with and without a prefix."""
    model_dir, hf = checkpoint
    config = ModelConfig.from_dir(model_dir)
    model = build_model(config, model_dir, torch.float32, 512)
    kv = allocate_kv_caches(model, num_blocks=64, block_size=4, dtype=torch.float32)
    seqs = prompts_for(config.vocab_size, [9, 30, 13, 7, 22], seed=3)
    tables = [list(range(i * 12, i * 12 + 12))[::-1] for i in range(len(seqs))]  # reversed block order
    # first step: prefill all but the last token of seqs 0-1, the first 8 of seqs 2-4
    cut = [8, 29, 8, 6, 8]
    first = [ScheduledChunk(str(i), s[:c], 0, tables[i], False, SamplingParams(), [], []) for i, (s, c) in
             enumerate(zip(seqs, cut))]
    run_chunks(model, kv, first)
    # second step: seqs 0, 1, 3 decode one token each; seqs 2, 4 prefill the rest after their prefix
    second = [ScheduledChunk(str(i), s[c:], c, tables[i], True, SamplingParams(), [], []) for i, (s, c) in
              enumerate(zip(seqs, cut))]
    logits, ordered = run_chunks(model, kv, second)
    offset = 0
    for chunk in ordered:
        offset += len(chunk.token_ids)
        seq = seqs[int(chunk.request_id)]
        n = len(chunk.token_ids)
        torch.testing.assert_close(logits[offset - n : offset], hf_logits(hf, seq)[-n:], atol=LOGIT_ATOL, rtol=0)


def test_greedy_generation_matches_hf_for_a_batch_of_mixed_lengths(checkpoint):
    model_dir, hf = checkpoint
    llm = LLM(model_dir, max_model_len=512)
    prompts = prompts_for(llm.engine.model_config.vocab_size, PROMPT_LENS)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=5)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        sample = out.outputs[0]
        assert len(sample.token_ids) == 64 and sample.finish_reason == "length"
        assert_matches_hf(hf, prompt, sample.token_ids, sample.logprobs)
    single = llm.generate(prompts[3], params)[0]
    assert single.outputs[0].token_ids == outputs[3].outputs[0].token_ids
    llm.engine.check_integrity()


def test_text_prompt_and_chat_match_hf_tokenization(checkpoint):
    model_dir, hf = checkpoint
    llm = LLM(model_dir, max_model_len=512)
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    out = llm.generate("The quick brown fox jumps over the lazy dog.", params)[0]
    assert out.prompt_token_ids == hf_tok("The quick brown fox jumps over the lazy dog.")["input_ids"]
    assert_matches_hf(hf, out.prompt_token_ids, out.outputs[0].token_ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, ça va?"}]
    chat = llm.chat(messages, params)[0]
    ref_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref_ids = ref_ids["input_ids"] if isinstance(ref_ids, dict) or hasattr(ref_ids, "keys") else ref_ids
    assert chat.prompt_token_ids == list(ref_ids)
    assert_matches_hf(hf, chat.prompt_token_ids, chat.outputs[0].token_ids)
