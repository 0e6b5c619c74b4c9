"""Same tokens whatever path a request takes: prefix-cache hit, chunked prefill, preemption, batch mates."""

import pytest
import torch

from engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)


def prompts_for(vocab, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir):
    """Plain run: big budget, no prefix caching, lots of blocks."""
    llm = LLM(tiny_llama_dir, enable_prefix_caching=False, max_model_len=512)
    prompts = prompts_for(512, [7, 33, 64, 90])
    seeded = [SamplingParams(max_tokens=48, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    return {
        "prompts": prompts,
        "greedy": [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)],
        "seeded_params": seeded,
        "seeded": [o.outputs[0].token_ids for o in llm.generate(prompts, seeded)],
    }


def test_prefix_cache_hit_gives_the_same_tokens(tiny_llama_dir, baseline):
    llm = LLM(tiny_llama_dir, max_model_len=512)
    prompts = baseline["prompts"]
    first = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in first] == [0, 0, 0, 0]
    # the same prompts again, and prompts sharing a prefix with them
    again = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in again] == [0, 32, 48, 80]  # full blocks, one token left to compute
    assert [o.outputs[0].token_ids for o in again] == baseline["greedy"]
    extended = [p + [5, 6, 7] for p in prompts]
    hit = llm.generate(extended, GREEDY)
    assert [o.num_cached_tokens for o in hit] == [0, 32, 64, 80]
    ref = LLM(tiny_llama_dir, enable_prefix_caching=False, max_model_len=512).generate(extended, GREEDY)
    assert [o.outputs[0].token_ids for o in hit] == [o.outputs[0].token_ids for o in ref]
    llm.engine.check_integrity()


def test_chunked_prefill_gives_the_same_tokens(tiny_llama_dir, baseline):
    llm = LLM(tiny_llama_dir, max_num_batched_tokens=16, enable_prefix_caching=False, max_model_len=512)
    assert [o.outputs[0].token_ids for o in llm.generate(baseline["prompts"], GREEDY)] == baseline["greedy"]
    seeded = llm.generate(baseline["prompts"], baseline["seeded_params"])
    assert [o.outputs[0].token_ids for o in seeded] == baseline["seeded"]


def test_preemption_by_recompute_gives_the_same_tokens(tiny_llama_dir, baseline):
    # 4 prompts need 4 + 6 + 8 + 9 blocks at the end; 14 blocks force preemptions along the way
    llm = LLM(tiny_llama_dir, num_kv_blocks=14, max_model_len=160)
    out = llm.generate(baseline["prompts"], GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in out] == baseline["greedy"]
    before = llm.engine.scheduler.num_preemptions
    out = llm.generate(baseline["prompts"], baseline["seeded_params"])
    assert llm.engine.scheduler.num_preemptions > before
    assert [o.outputs[0].token_ids for o in out] == baseline["seeded"]
    llm.engine.check_integrity()
    assert llm.engine.block_pool.num_free_blocks == 14


def test_seeded_request_is_reproducible_whatever_else_is_in_the_batch(tiny_llama_dir, baseline):
    llm = LLM(tiny_llama_dir, max_model_len=512)
    prompts, seeded = baseline["prompts"], baseline["seeded_params"]
    alone = llm.generate(prompts[2], seeded[2])[0].outputs[0].token_ids
    assert alone == baseline["seeded"][2]
    # reversed order, with unseeded and greedy neighbours
    noisy = SamplingParams(max_tokens=20, temperature=1.5, ignore_eos=True)
    mixed = llm.generate([prompts[0], prompts[2], prompts[1]], [noisy, seeded[2], GREEDY])
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=48, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    assert llm.generate(prompts[2], other_seed)[0].outputs[0].token_ids != alone


def test_finished_sequences_leave_at_once(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, max_model_len=512)
    prompts = prompts_for(512, [10, 10, 10])
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (2, 30, 5)]
    finished_at = {}
    for out in llm.generate_stream(prompts, params):
        if out.finished:
            finished_at[out.request_id] = llm.engine.scheduler.num_running
    assert sorted(finished_at.values()) == [0, 1, 2]  # each leaves the running set the step it finishes


def test_stream_deltas_add_up_and_closing_early_aborts(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, max_model_len=512)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    text, ids = "", []
    for delta in llm.generate_stream("Hello there, general", params):
        text += delta.outputs[0].text
        ids += delta.outputs[0].token_ids
    assert delta.finished and delta.outputs[0].finish_reason == "length"
    final = llm.generate("Hello there, general", params)[0].outputs[0]
    assert (text, ids) == (final.text, final.token_ids) and len(ids) == 20
    stream = llm.generate_stream(["one", "two"], params)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert llm.engine.block_pool.usage() == 0.0


def test_stop_strings_and_stop_tokens_end_generation_exactly(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, max_model_len=512)
    base = llm.generate("A story:", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].outputs[0]
    text = base.text
    stop = text[10:13]
    assert stop and stop not in text[:10]
    cut = llm.generate("A story:", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))[0]
    cut = cut.outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (text[: text.index(stop)], "stop", stop)
    kept = llm.generate("A story:", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop],
                                                  include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    token = base.token_ids[5]
    first = base.token_ids.index(token)
    by_id = llm.generate("A story:", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                   stop_token_ids=[token]))[0].outputs[0]
    assert (by_id.token_ids, by_id.finish_reason, by_id.stop_reason) == (base.token_ids[: first + 1], "stop", token)


def test_kv_events_from_real_generation_rebuild_the_cached_set(tiny_llama_dir):
    from engine.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored

    llm = LLM(tiny_llama_dir, num_kv_blocks=12, max_model_len=160)
    pool = llm.engine.block_pool
    mirror: set[int] = set()
    sequences = []
    removed = []

    def on_event(event):
        sequences.append(event.sequence)
        assert event.epoch == pool.epoch
        if isinstance(event, BlocksStored):
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            mirror.update(event.block_hashes)
        elif isinstance(event, BlocksRemoved):
            removed.extend(event.block_hashes)
            mirror.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            mirror.clear()

    pool.subscribe(on_event)
    for seed in range(4):  # more distinct prefixes than 12 blocks hold: evictions happen
        llm.generate(prompts_for(512, [40, 25], seed=seed), SamplingParams(max_tokens=8, temperature=0))
    assert removed, "the scenario must evict"
    assert sequences == list(range(sequences[0], sequences[-1] + 1))  # no gaps
    assert mirror == pool.cached_hashes() and 0 < len(mirror) <= 12
    pool.reset_prefix_cache()
    assert mirror == set() == pool.cached_hashes()
    llm.engine.check_integrity()
