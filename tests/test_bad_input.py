"""Bad input raises an error naming the field, the value and what is allowed; the engine keeps serving."""

import pytest

from engine import LLM, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, max_model_len=64)


@pytest.mark.parametrize(
    "kwargs, field, fragment",
    [
        ({"max_tokens": 0}, "max_tokens", "must be an integer >= 1"),
        ({"temperature": -0.5}, "temperature", "must be >= 0"),
        ({"top_p": 0.0}, "top_p", "must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p", "must be in (0, 1]"),
        ({"top_k": -2}, "top_k", "must be 0 or -1 (disabled) or an integer >= 1"),
        ({"min_tokens": -1}, "min_tokens", "must be in [0, max_tokens=16]"),
        ({"min_tokens": 17}, "min_tokens", "must be in [0, max_tokens=16]"),
        ({"n": 0}, "n", "must be an integer >= 1"),
        ({"logit_bias": {5: 101.0}}, "logit_bias[5]", "must be in [-100, 100]"),
        ({"logit_bias": {-3: 1.0}}, "logit_bias", "keys must be token ids >= 0"),
        ({"min_p": -0.1}, "min_p", "must be in [0, 1]"),
        ({"min_p": 1.1}, "min_p", "must be in [0, 1]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "must be > 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "must be in [-2, 2]"),
        ({"seed": -1}, "seed", "must be in [0,"),
        ({"stop": [""]}, "stop[0]", "must be a non-empty string"),
        ({"temperature": float("nan")}, "temperature", "must be a finite number"),
    ],
)
def test_sampling_params_name_field_value_and_range(kwargs, field, fragment):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    message = str(err.value)
    assert message.startswith(f"{field}=") and fragment in message
    value = next(iter(kwargs.values()))
    shown = repr(next(iter(value.items()))[field == "logit_bias[5]"] if isinstance(value, dict) else value)
    assert message.startswith(f"{field}={shown}" if field != "stop[0]" else "stop[0]='' ")


@pytest.mark.parametrize(
    "prompt, field, fragment",
    [
        ("", "prompts[0].prompt", "must be a non-empty string"),
        ([], "prompts[0].prompt_token_ids", "at least one token id"),
        ([1, 2, 512], "prompts[0].prompt_token_ids[2]", "must be a token id in [0, 512)"),
        ([1, -1], "prompts[0].prompt_token_ids[1]", "must be a token id in [0, 512)"),
        ([5] * 65, "prompts[0].prompt", "must be at most max_model_len=64 tokens"),
    ],
)
def test_bad_prompts(llm, prompt, field, fragment):
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([prompt])
    assert err.value.field == field and fragment in str(err.value)


def test_engine_level_checks(llm):
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids\[0\]=9999 is invalid: must be a token id in"):
        llm.engine.add_request([1, 2], SamplingParams(stop_token_ids=[9999]))
    with pytest.raises(InvalidRequestError, match=r"logprobs=21 is invalid: must be in \[0, 20\]"):
        llm.engine.add_request([1, 2], SamplingParams(logprobs=21))
    with pytest.raises(InvalidRequestError, match=r"prompts\[1\]\.prompt_token_ids\[0\]"):
        llm.generate([[1, 2], [600]])
    assert not llm.engine.has_unfinished_requests()  # a bad batch admits nothing


def test_a_bad_request_never_breaks_the_others(llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate([[3, 4, 5], [6, 7, 8, 9]], params)]
    engine = llm.engine
    a = engine.add_request([3, 4, 5], params)
    engine.step()
    for bad in ([], [1, 100000], [7] * 100):
        with pytest.raises(InvalidRequestError):
            engine.add_request(bad, params)
    b = engine.add_request([6, 7, 8, 9], params)
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request([1], params, request_id=a)
    tokens = {a: [], b: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    assert [tokens[a], tokens[b]] == expected
    engine.check_integrity()


def test_abort_frees_blocks(llm):
    engine = llm.engine
    rid = engine.add_request([1] * 40, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.block_pool.usage() > 0
    assert engine.abort_request(rid) and not engine.abort_request(rid)
    engine.check_integrity()
    assert engine.block_pool.usage() == 0.0
