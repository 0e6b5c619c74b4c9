"""The OpenAI API as clients use it (issue 17): the official `openai` client against a real cluster started the way
`duet up` starts it (redis, router with HTTP, a prefill and a decode worker), every answer pinned against the
offline engine on the same tiny checkpoint (greedy or seeded: exact text, exact token counts, logprobs to float
precision), and every parameter duet does not implement refused with a 400 that names it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from cluster_helpers import wait_idle
from prometheus_client.parser import text_string_to_metric_families

from deploy.local_cluster import ClusterConfig, LocalCluster
from duet.client import Client, stream_to_record
from engine import LLM, SamplingParams

MAX_MODEL_LEN = 96
BLOCK_SIZE = 16
PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog runs far away into the"


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(tiny_llama_dir, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    config = ClusterConfig(model_dir=str(tiny_llama_dir),
                           worker_args=["--num-kv-blocks", "96", "--max-model-len", str(MAX_MODEL_LEN)],
                           router_args=["--max-model-len", str(MAX_MODEL_LEN)], http_port=0)
    with LocalCluster(config).start() as c:
        c.http_base = c.http_url
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.http_base + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client, tiny_llama_dir):
    served = [m.id for m in client.models.list().data]
    assert served == [tiny_llama_dir.name]
    return served[0]


@pytest.fixture(autouse=True)
def nothing_leaks(cluster):
    yield
    wait_idle(cluster)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **kwargs)


def http_responses(cluster, handler: str, status: str) -> float:
    text = httpx.get(cluster.http_base + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "duet_router_http_requests_total" and s.labels["handler"] == handler
               and s.labels["status"] == status)


def test_models_and_an_unknown_model_is_404_and_counted(cluster, client, model):
    before = {key: http_responses(cluster, *key) for key in (("/v1/completions", "404"), ("/v1/models/{model}", "404"),
                                                               ("/v1/completions", "400"), ("other", "404"))}
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    assert err.value.body["param"] == "model" and "gpt-4o" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", suffix="y")
    assert httpx.get(cluster.http_base + "/no/such/route", timeout=10).status_code == 404
    # every refusal is counted by route and status, the ones no Generate call saw included
    assert {key: http_responses(cluster, *key) - n for key, n in before.items()} == {
        ("/v1/completions", "404"): 1, ("/v1/models/{model}", "404"): 1, ("/v1/completions", "400"): 1,
        ("other", "404"): 1}


def test_default_max_tokens_is_the_rest_of_the_context(client, model, offline):
    ref = offline.generate([PROMPT], greedy(max_tokens=MAX_MODEL_LEN - len(offline.tokenizer.encode(PROMPT))))[0]
    out = client.completions.create(model=model, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == MAX_MODEL_LEN - out.usage.prompt_tokens == len(ref.outputs[0].token_ids)
    assert out.choices[0].text == ref.outputs[0].text and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == MAX_MODEL_LEN  # not 16


def test_n_samples_share_one_prefill_and_seed_plus_i_reproduces_each(cluster, client, model, offline):
    def cached_tokens_reported() -> float:
        text = httpx.get(cluster.http_base + "/metrics", timeout=10).text
        return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == "duet_router_actual_cached_tokens_total")

    before = cached_tokens_reported()
    out = client.completions.create(model=model, prompt=PROMPT, n=3, max_tokens=8, temperature=1.0, seed=42,
                                    extra_body={"ignore_eos": True, "cache_salt": "n-test"})
    assert [c.index for c in out.choices] == [0, 1, 2]
    refs = [offline.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.0, seed=42 + i,
                                                      ignore_eos=True))[0] for i in range(3)]
    assert [c.text for c in out.choices] == [r.outputs[0].text for r in refs]
    assert len({c.text for c in out.choices}) > 1  # distinct seeds, distinct samples
    assert out.usage.prompt_tokens == len(refs[0].prompt_token_ids)  # the prompt counted once
    assert out.usage.completion_tokens == 3 * 8
    # sample 0 computed the prompt (a fresh cache salt); samples 1 and 2 reused its full blocks
    full_blocks_tokens = (len(refs[0].prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    assert cached_tokens_reported() - before == 2 * full_blocks_tokens > 0


def test_chat_logprobs_and_top_logprobs_match_the_engine(client, model, offline):
    messages = [{"role": "user", "content": "Say something."}]
    ref = offline.chat(messages, greedy(max_tokens=5, logprobs=3))[0].outputs[0]
    out = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5 == out.usage.completion_tokens
    for entry, token_id, lp in zip(content, ref.token_ids, ref.logprobs, strict=True):  # lp: {sampled id, top 3}
        assert entry.token == lp[token_id].decoded_token == offline.tokenizer.decode([token_id],
                                                                                   skip_special_tokens=False)
        assert entry.logprob == pytest.approx(lp[token_id].logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        best = sorted((v.logprob for v in lp.values()), reverse=True)[:3]  # greedy: the sampled token is the top 1
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best, abs=1e-4)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_echo_and_stop_arrays(client, model, offline):
    ref = offline.generate([PROMPT], greedy(max_tokens=6, logprobs=2))[0].outputs[0]
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text == ref.text
    assert lp.token_logprobs == pytest.approx([p[t].logprob for t, p in zip(ref.token_ids, ref.logprobs)], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for tokens_top, token, ref_lp in zip(lp.top_logprobs, lp.tokens, ref.logprobs, strict=True):
        # the sampled token and the top 2, keyed by text (as vLLM: tokens with the same text share a key)
        texts = {v.decoded_token for v in ref_lp.values()} | {token}
        assert token in tokens_top and set(tokens_top) == texts
        assert max(tokens_top.values()) == pytest.approx(max(v.logprob for v in ref_lp.values()), abs=1e-4)

    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == PROMPT + ref.text

    stop = [ref.text[3:5], "zzzz"]
    ref_stop = offline.generate([PROMPT], greedy(max_tokens=6, stop=stop))[0].outputs[0]
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, stop=stop,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == ref_stop.text == ref.text[: ref.text.index(stop[0])]
    assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["stop_reason"] == stop[0]


def test_logit_bias_bans_the_greedy_token_over_http_and_grpc(cluster, client, model, offline):
    ref = offline.generate([PROMPT], greedy(max_tokens=6))[0].outputs[0]
    banned = ref.token_ids[0]
    ref_banned = offline.generate([PROMPT], greedy(max_tokens=6, logit_bias={banned: -100.0}))[0].outputs[0]
    assert banned not in ref_banned.token_ids and ref_banned.text != ref.text
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                    logit_bias={str(banned): -100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == ref_banned.text
    with Client(cluster.router_address) as grpc_client:
        record = stream_to_record(grpc_client.generate(PROMPT, greedy(max_tokens=6, logit_bias={banned: -100.0})))
    assert record["token_ids"] == ref_banned.token_ids
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, logit_bias={"99999": 5})
    assert "logit_bias" in err.value.body["message"] and "99999" in err.value.body["message"]


def test_min_tokens_holds_back_a_stop_token(client, model, offline):
    ref = offline.generate([PROMPT], greedy(max_tokens=8))[0].outputs[0]
    stop_id = ref.token_ids[1]
    stopped = offline.generate([PROMPT], greedy(max_tokens=8, stop_token_ids=[stop_id]))[0].outputs[0]
    held = offline.generate([PROMPT], greedy(max_tokens=8, stop_token_ids=[stop_id], min_tokens=4))[0].outputs[0]
    assert len(stopped.token_ids) == 2 and len(held.token_ids) > 4 and stop_id not in held.token_ids[:4]
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [stop_id], "min_tokens": 4})
    assert out.choices[0].text == held.text and out.usage.completion_tokens == len(held.token_ids)


def test_chat_stream_has_the_role_first_and_a_usage_chunk(client, model, offline):
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": None},
                {"role": "user", "content": "Go on."}]
    flat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"},
            {"role": "assistant", "content": ""}, {"role": "user", "content": "Go on."}]
    ref = offline.chat(flat, greedy(max_tokens=6))[0]
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    # the SDK's stream helper ends with the role and the usage (both were None before issue 17)
    with client.chat.completions.stream(model=model, messages=messages, max_tokens=6, temperature=0,
                                        stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True}) as stream:
        for _ in stream:
            pass
        final = stream.current_completion_snapshot  # get_final_completion() refuses finish_reason "length"
    assert final.choices[0].message.role == "assistant" and final.choices[0].message.content == ref.outputs[0].text
    assert final.usage.completion_tokens == 6


def test_a_list_of_prompts_text_or_token_ids_with_n(client, model, offline):
    prompts = ["Hello there", "A different prompt"]
    refs = offline.generate(prompts, greedy(max_tokens=4))
    out = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    want = [r.outputs[0].text for r in refs]
    assert [c.text for c in out.choices] == [want[0]] * 2 + [want[1]] * 2  # greedy: n equal samples
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    by_ids = client.completions.create(model=model, prompt=[r.prompt_token_ids for r in refs], max_tokens=4,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in by_ids.choices] == [r.outputs[0].text for r in refs]
    streamed = client.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [r.outputs[0].text for r in refs]


@pytest.mark.parametrize("create, param", [
    (lambda c, m: c.completions.create(model=m, prompt="x", suffix="y"), "suffix"),
    (lambda c, m: c.completions.create(model=m, prompt="x", best_of=3), None),
    (lambda c, m: c.completions.create(model=m, prompt="x", echo=True, logprobs=1), None),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "x"}],
                                            audio={"voice": "alloy", "format": "wav"}), "audio"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "x"}],
                                            top_logprobs=2), None),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), "messages[0].content"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": None}]), None),
    (lambda c, m: c.completions.create(model=m, prompt="x", extra_body={"frobnicate": 1}), "frobnicate"),
    (lambda c, m: c.completions.create(model=m, prompt="x", top_p=0), "top_p"),
    (lambda c, m: c.completions.create(model=m, prompt="x", n=2, seed=2**64 - 1), None),  # seed + 1 overflows
])
def test_what_duet_does_not_implement_is_a_400_naming_it(client, model, create, param):
    with pytest.raises(openai.BadRequestError) as err:
        create(client, model)
    body = err.value.body
    if param is not None:
        assert body["param"] is not None and body["param"].startswith(param), body
    assert body["message"]


def test_user_is_accepted(client, model):
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                         user="end-user-7")
    assert out.usage.completion_tokens == 1


def test_tokenize_detokenize_version_and_head_health(cluster, offline):
    base = cluster.http_base
    prompt = httpx.post(base + "/tokenize", json={"prompt": PROMPT}, timeout=10).json()
    ids = offline.tokenizer.encode(PROMPT)
    assert prompt == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
    bare = httpx.post(base + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False,
                                                "return_token_strs": True}, timeout=10).json()
    assert bare["tokens"] == offline.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert bare["token_strs"] == offline.tokenizer.convert_ids_to_tokens(bare["tokens"])
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(base + "/tokenize", json={"messages": messages}, timeout=10).json()
    assert chat["tokens"] == offline.tokenizer.apply_chat_template_ids(messages, add_generation_prompt=True)
    detok = httpx.post(base + "/detokenize", json={"tokens": ids}, timeout=10).json()
    assert detok == {"prompt": offline.tokenizer.decode(ids, skip_special_tokens=False)}
    bad = httpx.post(base + "/detokenize", json={"tokens": [1, 99999]}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
    assert httpx.post(base + "/tokenize", json={}, timeout=10).status_code == 400
    assert httpx.get(base + "/version", timeout=10).json()["version"]
    head = httpx.head(base + "/health", timeout=10)
    assert head.status_code == 200 and head.content == b""
    assert json.loads(httpx.get(base + "/health", timeout=10).content) == {"status": "ok"}
