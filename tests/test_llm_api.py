"""The offline `LLM` API as vLLM's: prompt forms, RequestOutput/CompletionOutput, n samples sharing one prefill,
logit_bias and min_tokens through `generate`, streaming deltas, the progress bar, `get_tokenizer`, `chat`."""

from __future__ import annotations

import pytest

from engine import LLM, CompletionOutput, InvalidRequestError, Logprob, RequestOutput, SamplingParams
from engine.sampling_params import MAX_SEED

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT_IDS = list(range(3, 43))  # 40 tokens: two full 16-token blocks and 8 more


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, max_model_len=256)


def fresh(tiny_llama_dir, **kw) -> LLM:
    """An engine whose prefix cache is empty, for exact cached-token counts."""
    return LLM(tiny_llama_dir, max_model_len=256, **kw)


def tokens(outs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outs]


def test_prompt_forms_give_identical_outputs(llm):
    text = "The quick brown fox"
    ids = llm.tokenizer.encode(text)
    forms = [text, {"prompt": text}, ids, {"prompt_token_ids": ids}, tuple(ids)]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert [out.prompt for out in outs] == [text, text, None, None, None]
    assert all(out.prompt_token_ids == ids for out in outs)
    assert all(tokens([out]) == tokens(outs[:1]) for out in outs)
    # one prompt alone, in each form, is a batch of one
    for form in forms:
        [out] = llm.generate(form, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == outs[0].outputs[0].token_ids
    # a list of id lists is a batch; a bare list of ints is one prompt (duet's short form)
    assert tokens(llm.generate([ids, [5, 6, 7]], GREEDY, use_tqdm=False)) == \
        tokens(llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False))


def test_a_request_output_has_vllms_shape(llm):
    [out] = llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert isinstance(out, RequestOutput) and out.finished and out.request_id.startswith("req-")
    [sample] = out.outputs
    assert isinstance(sample, CompletionOutput) and sample.index == 0 and len(sample.token_ids) == 5
    assert sample.text == llm.tokenizer.decode(sample.token_ids)
    assert (sample.finish_reason, sample.stop_reason, sample.finished()) == ("length", None, True)
    assert sample.logprobs is None and sample.cumulative_logprob is None  # not asked for
    m = out.metrics
    assert m.arrival_time_s <= m.first_token_time_s <= m.finished_time_s and out.ttft_s >= 0


@pytest.mark.parametrize("prompt, field, fragment", [
    ({"prompt": "hi", "multi_modal_data": {"image": "x.png"}}, "prompts[0].multi_modal_data",
     "may hold only prompt, prompt_token_ids, cache_salt"),
    ({"prompt_token_ids": [1, 2], "mm_processor_kwargs": {}}, "prompts[0].mm_processor_kwargs", "may hold only"),
    ({"prompt": [1, 2, 3]}, "prompts[0].prompt", "must be a string (token ids go in 'prompt_token_ids')"),
    ({"prompt_token_ids": "1 2 3"}, "prompts[0].prompt_token_ids", "must be a list of token ids"),
    ({"prompt_token_ids": [1, "2"]}, "prompts[0].prompt_token_ids[1]", "must be an integer token id"),
    ({"prompt_token_ids": []}, "prompts[0].prompt_token_ids", "at least one token id"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "prompts[0].prompt", "exactly one of 'prompt'"),
    ({}, "prompts[0].prompt", "exactly one of 'prompt'"),
    ({"prompt": "a", "cache_salt": 5}, "prompts[0].cache_salt", "must be a string"),
    (3, "prompts[0].prompt", "must be a string, a list of token ids, or a dict"),
])
def test_a_bad_prompt_dict_is_refused_by_name_and_never_tokenized_as_text(llm, prompt, field, fragment):
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(["fine", prompt], GREEDY, use_tqdm=False)
    assert err.value.field == field.replace("[0]", "[1]") and fragment in str(err.value)
    assert not llm.engine.has_unfinished_requests()  # the good prompt beside it was not admitted either


def test_cache_salt_in_a_prompt_dict_separates_prefix_caches(tiny_llama_dir):
    llm = fresh(tiny_llama_dir)
    cached = [llm.generate({"prompt_token_ids": PROMPT_IDS, "cache_salt": salt}, GREEDY, use_tqdm=False)[0]
              .num_cached_tokens for salt in ("a", "a", "b")]
    assert cached == [0, 32, 0]


def test_greedy_n_gives_n_identical_samples_equal_to_n_1(llm):
    [one] = llm.generate(PROMPT_IDS, GREEDY, use_tqdm=False)
    [three] = llm.generate(PROMPT_IDS, SamplingParams(n=3, max_tokens=8, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    assert [c.index for c in three.outputs] == [0, 1, 2]
    assert [c.token_ids for c in three.outputs] == [one.outputs[0].token_ids] * 3
    assert [c.text for c in three.outputs] == [one.outputs[0].text] * 3
    assert all(c.finish_reason == "length" for c in three.outputs) and three.finished


def test_seeded_sample_i_uses_seed_plus_i_and_shares_the_prompts_blocks(tiny_llama_dir):
    params = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=1000, ignore_eos=True, logprobs=1)
    llm = fresh(tiny_llama_dir)
    [out] = llm.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)
    # the prompt was prefilled once: samples 1..3 took its two full blocks from the prefix cache
    assert [c.num_cached_tokens for c in out.outputs] == [0, 32, 32, 32] and out.num_cached_tokens == 0
    assert llm.engine.core.num_prefix_hit_tokens == 3 * 32
    alone = fresh(tiny_llama_dir)
    for i, sample in enumerate(out.outputs):
        single = SamplingParams(max_tokens=10, temperature=1.0, seed=1000 + i, ignore_eos=True, logprobs=1)
        [ref] = alone.generate(PROMPT_IDS, single, use_tqdm=False)
        assert sample.token_ids == ref.outputs[0].token_ids and sample.index == i
        assert sample.cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-5)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4  # four seeds, four different samples
    llm.engine.check_integrity()
    assert llm.engine.block_pool.usage() == 0.0


def test_n_without_a_prefix_cache_or_a_full_block_admits_all_samples_at_once(tiny_llama_dir):
    params = SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=7, ignore_eos=True)
    [off] = fresh(tiny_llama_dir, enable_prefix_caching=False).generate(PROMPT_IDS, params, use_tqdm=False)
    [on] = fresh(tiny_llama_dir).generate(PROMPT_IDS, params, use_tqdm=False)
    assert [c.num_cached_tokens for c in off.outputs] == [0, 0, 0]
    assert tokens([off]) == tokens([on])  # sharing the prefill changes no token
    short = fresh(tiny_llama_dir)
    [out] = short.generate([5, 6, 7], params, use_tqdm=False)  # no full block before the last token
    assert [c.num_cached_tokens for c in out.outputs] == [0, 0, 0] and len(out.outputs) == 3


def test_unseeded_samples_differ(llm):
    [out] = llm.generate("Once", SamplingParams(n=4, max_tokens=12, temperature=1.0, ignore_eos=True),
                         use_tqdm=False)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_a_seed_leaving_no_room_for_n_seeds_is_refused(llm):
    with pytest.raises(InvalidRequestError, match=r"prompts\[0\]\.seed=18446744073709551614 is invalid: must be "
                                                  r"at most 18446744073709551613 with n=3"):
        llm.generate("x", SamplingParams(n=3, seed=MAX_SEED - 1), use_tqdm=False)
    [out] = llm.generate("x", SamplingParams(n=3, seed=MAX_SEED - 2, max_tokens=2), use_tqdm=False)
    assert len(out.outputs) == 3


def test_logit_bias_bans_the_greedy_token_and_forces_another(llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    [base] = llm.generate(PROMPT_IDS, params, use_tqdm=False)
    greedy = base.outputs[0].token_ids
    banned = greedy[0]
    [out] = llm.generate(PROMPT_IDS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                    logit_bias={banned: -100}), use_tqdm=False)
    assert banned not in out.outputs[0].token_ids and out.outputs[0].token_ids[0] != greedy[0]
    forced = 77
    [out] = llm.generate(PROMPT_IDS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                    logit_bias={forced: 100}), use_tqdm=False)
    assert out.outputs[0].token_ids == [forced] * 12


def test_min_tokens_holds_back_eos_and_stop_tokens(llm):
    eos = min(llm.tokenizer.eos_token_ids)
    wants_eos = {eos: 100}  # eos is the greedy pick at every step once allowed
    [early] = llm.generate(PROMPT_IDS, SamplingParams(max_tokens=20, temperature=0, logit_bias=wants_eos),
                           use_tqdm=False)
    assert early.outputs[0].token_ids == [eos] and early.outputs[0].finish_reason == "stop"
    [held] = llm.generate(PROMPT_IDS, SamplingParams(max_tokens=20, temperature=0, logit_bias=wants_eos, min_tokens=5),
                          use_tqdm=False)
    sample = held.outputs[0]
    assert len(sample.token_ids) == 6 and eos not in sample.token_ids[:5] and sample.token_ids[5] == eos
    assert sample.finish_reason == "stop"
    # a stop token id: the first greedy token would end the answer at once; min_tokens=4 masks it for 4 tokens
    [base] = llm.generate(PROMPT_IDS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    stop_id = base.outputs[0].token_ids[0]
    [out] = llm.generate(PROMPT_IDS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                    stop_token_ids=[stop_id], min_tokens=4), use_tqdm=False)
    got = out.outputs[0].token_ids
    assert len(got) >= 4 and stop_id not in got[:4]
    assert got[-1] == stop_id if out.outputs[0].finish_reason == "stop" else len(got) == 12


def test_logprobs_have_vllms_shape(llm):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    [out] = llm.generate(PROMPT_IDS, params, use_tqdm=False)
    sample = out.outputs[0]
    assert len(sample.logprobs) == len(sample.token_ids) == 6
    for token_id, position in zip(sample.token_ids, sample.logprobs):
        assert next(iter(position)) == token_id  # the sampled token first
        assert position[token_id].rank == 1  # greedy: the best token (no ties in a random model's logits)
        assert len(position) == 2  # it is also the top-1, so it appears once
        assert [lp.rank for lp in position.values()] == [1, 2]
        for t, lp in position.items():
            assert isinstance(lp, Logprob) and lp.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
    assert sample.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(sample.token_ids,
                                                                                       sample.logprobs)))
    # sampled at a high temperature, a token outside the top-1 comes first, with its vocabulary rank
    hot = SamplingParams(max_tokens=16, temperature=50.0, seed=3, ignore_eos=True, logprobs=1)
    [out] = llm.generate(PROMPT_IDS, hot, use_tqdm=False)
    outside = [p for t, p in zip(out.outputs[0].token_ids, out.outputs[0].logprobs) if p[t].rank > 1]
    assert outside and all(len(p) == 2 and list(p.values())[1].rank == 1 for p in outside)


def test_stream_yields_deltas_that_add_up_to_generate(llm):
    params = SamplingParams(n=2, max_tokens=9, temperature=0.9, seed=5, ignore_eos=True, logprobs=1)
    prompts = [PROMPT_IDS, "Hello there"]
    final = llm.generate(prompts, params, use_tqdm=False)
    got: dict[tuple[str, int], CompletionOutput] = {}
    last_yield: dict[str, RequestOutput] = {}
    for delta in llm.generate_stream(prompts, params):
        assert delta.outputs and not last_yield.get(delta.request_id, delta).finished
        for c in delta.outputs:
            acc = got.setdefault((delta.request_id, c.index), CompletionOutput(c.index, "", [], None, []))
            assert acc.finish_reason is None  # nothing after a sample's last delta
            acc.text += c.text
            acc.token_ids += c.token_ids
            acc.logprobs += c.logprobs
            acc.cumulative_logprob, acc.finish_reason = c.cumulative_logprob, c.finish_reason
        last_yield[delta.request_id] = delta
    assert all(out.finished for out in last_yield.values()) and len(last_yield) == 2
    streamed = sorted(last_yield)
    for rid, ref in zip(streamed, final):
        for i, want in enumerate(ref.outputs):
            acc = got[(rid, i)]
            assert (acc.text, acc.token_ids, acc.finish_reason) == (want.text, want.token_ids, "length")
            assert acc.logprobs == want.logprobs and acc.cumulative_logprob == want.cumulative_logprob


def test_closing_a_stream_with_waiting_siblings_aborts_them_all(tiny_llama_dir):
    llm = fresh(tiny_llama_dir)
    stream = llm.generate_stream(PROMPT_IDS, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    first = next(stream)
    assert [c.index for c in first.outputs] == [0]  # siblings wait for sample 0's prefill
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert llm.engine.block_pool.usage() == 0.0


def test_progress_bar_is_on_by_default_and_off_when_asked(llm, capsys):
    llm.generate(["a", "b"], GREEDY)
    assert "Processed prompts: 100%" in capsys.readouterr().err
    llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert capsys.readouterr() == ("", "")


def test_get_tokenizer_has_hugging_faces_signatures_and_defaults(llm):
    tok = llm.get_tokenizer()
    ours = llm.tokenizer
    assert tok.encode("Hello world") == ours.encode("Hello world")
    assert tok("Hello")["input_ids"] == ours.encode("Hello")
    eos = min(ours.eos_token_ids)
    ids = [*ours.encode("Hi", add_special_tokens=False), eos]
    assert tok.decode(ids) == ours.decode(ids, skip_special_tokens=False) != tok.decode(ids, skip_special_tokens=True)
    assert tok.eos_token_id == eos and tok.vocab_size == 512 and tok.decode(eos) == "<|end_of_text|>"
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == ours.apply_chat_template_ids(messages, add_generation_prompt=False)
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(messages, add_generation_prompt=True)


def test_chat_returns_the_same_shape_with_the_rendered_prompt(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    params = SamplingParams(n=2, max_tokens=6, temperature=0, ignore_eos=True)
    [out] = llm.chat(messages, params, use_tqdm=False)
    assert (out.prompt, out.prompt_token_ids) == (text, ids)
    [ref] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert tokens([out]) == tokens([ref]) and len(out.outputs) == 2
    two = llm.chat([messages, messages[1:]], GREEDY, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids[:6] == out.outputs[0].token_ids
