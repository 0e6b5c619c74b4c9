"""Structured outputs (issue 17 part 3): llguidance grammars mask the logits on the prefill worker's first token
and on every decode step, the grammar state survives the hand-off and a migration, and the OpenAI API's
response_format / tools / tool_choice map onto them. Real cluster (redis-server, router, workers as processes,
gRPC on loopback), the official `openai` client, a random tiny model; the real default model in one slow test."""

from __future__ import annotations

import json
import math
import os
import re
import signal

import grpc
import httpx
import jsonschema
import openai
import pytest
import torch
from cluster_helpers import rpc_error, wait_idle, worker_components, worker_stats

from deploy.local_cluster import ClusterConfig, LocalCluster
from duet.client import Client, stream_to_record
from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.grammar_mask import GrammarDeadEnd, apply_grammar_masks, unpack_bitmask
from engine.ports import pick_free_ports
from engine.sampler import Sampler, SamplingRow
from engine.structured_output import StructuredOutput
from router.tool_calls import parse_hermes_calls

ENGINE_ARGS = ["--num-kv-blocks", "400", "--max-model-len", "1024", "--max-num-batched-tokens", "32"]
SCHEMA = {"type": "object",
          "properties": {"city": {"enum": ["Paris", "Berlin", "Rome"]}, "sunny": {"type": "boolean"},
                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "sunny", "days"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
# position-dependent: a grammar state lost or restarted mid-answer would put letters where digits belong
MIGRATION_REGEX = "([a-z]{3}[0-9]{2} )+"


def greedy(spec: StructuredOutput, max_tokens: int = 48, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, structured_output=spec, **kw)


CASES = {
    "regex": StructuredOutput(regex="[a-c]{3}-[0-9]{2,4}"),
    "choice": StructuredOutput(choice=("yes", "no", "maybe")),
    "json_schema": StructuredOutput(json_schema=json.dumps(SCHEMA)),
}


# --- the engine alone --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(tiny_llama_dir, num_kv_blocks=400, max_model_len=1024, max_num_batched_tokens=32)


def test_each_kind_is_enforced_offline_and_ends_at_eos(offline):
    out = {name: offline.generate(["Hello there"], greedy(spec))[0].outputs[0] for name, spec in CASES.items()}
    assert re.fullmatch("[a-c]{3}-[0-9]{2,4}", out["regex"].text)
    assert out["choice"].text in ("yes", "no", "maybe")
    jsonschema.validate(json.loads(out["json_schema"].text), SCHEMA)
    for o in out.values():  # complete, then only an end of sequence was allowed
        assert o.finish_reason == "stop" and o.token_ids[-1] in offline.tokenizer.eos_token_ids


def test_logprobs_stay_those_of_the_raw_distribution(offline):
    """vLLM's default: the mask shapes the draw, not the reported logprobs."""
    spec = CASES["choice"]
    constrained = offline.generate(["Hello there"], greedy(spec, logprobs=2))[0].outputs[0]
    raw = offline.generate(["Hello there"], SamplingParams(max_tokens=1, temperature=0, logprobs=2))[0].outputs[0]
    def top2(entry):  # vLLM's shape: token id -> Logprob, the sampled token and the top 2
        return {t: lp.logprob for t, lp in entry.items() if lp.rank <= 2}

    assert top2(constrained.logprobs[0]) == top2(raw.logprobs[0])  # the same top-2 as without a grammar
    assert constrained.token_ids[0] != raw.token_ids[0]  # although the grammar drew another token


def test_bad_specs_name_the_field():
    cases = [(dict(json_schema='{"type": "strin"}'), "structured_output.json_schema"),
             (dict(json_schema="{not json"), "structured_output.json_schema"),
             (dict(regex="[a-"), "structured_output.regex"),
             (dict(choice=()), "structured_output.choice"),
             (dict(grammar="start: foo"), "structured_output.grammar"),
             (dict(regex="a", choice=("a",)), "structured_output"),
             (dict(), "structured_output")]
    for kwargs, field in cases:
        with pytest.raises(InvalidRequestError) as e:
            StructuredOutput(**kwargs)
        assert e.value.field == field, kwargs


def test_lark_grammar_is_served(offline):
    spec = StructuredOutput(grammar='start: "x" NUM\nNUM: /[0-9]{3}/')
    assert re.fullmatch("x[0-9]{3}", offline.generate(["Hi"], greedy(spec))[0].outputs[0].text)


# --- the mask, as pure logic -------------------------------------------------------------------------------

class Allow:
    """A fake grammar allowing a fixed set of token ids (pure-logic test of the mask)."""

    def __init__(self, vocab: int, allowed: list[int]):
        self.num_words = -(-vocab // 32)
        self.allowed = allowed

    def fill_bitmask(self, row: torch.Tensor) -> None:
        for t in self.allowed:
            row[t // 32] |= -(1 << 31) if t % 32 == 31 else 1 << (t % 32)


def test_mask_sets_exactly_the_disallowed_logits_to_minus_inf_and_leaves_the_input_alone():
    logits = torch.arange(2 * 70, dtype=torch.float32).reshape(2, 70)
    before = logits.clone()
    out = apply_grammar_masks(logits, [None, Allow(70, [0, 31, 32, 69])])
    assert torch.equal(logits, before) and torch.equal(out[0], before[0])
    assert [i for i in range(70) if out[1, i] != -math.inf] == [0, 31, 32, 69]
    assert unpack_bitmask(torch.tensor([[-1]], dtype=torch.int32), 40).tolist() == [[True] * 32 + [False] * 8]


def test_a_dead_end_fails_its_row_alone():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(SamplingParams(temperature=0), [1], [], grammar=g)
            for g in (Allow(64, [5]), Allow(64, []), None)]
    out = Sampler(seed=0).sample(logits, rows)
    assert out[0].token_ids == [5]
    assert out[1].token_ids == [] and "dead end" in out[1].error
    assert out[2].token_ids == [int(logits[2].argmax())]
    with pytest.raises(GrammarDeadEnd):
        apply_grammar_masks(logits, [Allow(64, [])])


# --- a disaggregated cluster: gRPC ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    (http_port,) = pick_free_ports(1)
    config = ClusterConfig(model_dir=str(tiny_llama_dir), num_prefill=1, num_decode=2, worker_args=ENGINE_ARGS,
                           router_args=["--max-model-len", "1024", "--http-port", str(http_port)])
    with LocalCluster(config).start() as c:
        c.http_base = f"http://127.0.0.1:{http_port}"
        c.killed = set()
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.router_address) as c:
        yield c


@pytest.fixture(scope="module")
def http(cluster):
    return openai.OpenAI(base_url=cluster.http_base + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(http):
    return http.models.list().data[0].id  # the served id: any other name is a 404


@pytest.mark.parametrize("name", list(CASES))
def test_cluster_gives_the_offline_tokens_under_each_grammar(client, offline, cluster, name):
    """The prefill worker masks the first token, the decode worker rebuilds the state from it and masks the
    rest: exactly the offline engine's tokens."""
    params = greedy(CASES[name])
    record = stream_to_record(client.generate("Hello there", params, timeout_s=60))
    expected = offline.generate(["Hello there"], params)[0].outputs[0]
    assert record["token_ids"] == expected.token_ids and record["text"] == expected.text
    assert len(record["token_ids"]) > 1  # past the hand-off
    if name == "json_schema":
        jsonschema.validate(json.loads(record["text"]), SCHEMA)
    wait_idle(cluster, skip=tuple(cluster.killed))


def test_bad_grpc_specs_are_invalid_argument_naming_the_field(client):
    for spec, field in [('{"type": "strin"}', "sampling.structured_output.json_schema"),
                        ("[a-", "sampling.structured_output.regex")]:
        request = client.request("Hi", SamplingParams(max_tokens=4))
        if field.endswith("regex"):
            request.sampling.structured_output.regex = spec
        else:
            request.sampling.structured_output.json_schema = spec
        e = rpc_error(lambda r=request: list(client.stub.Generate(r, timeout=30)))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith(field + "="), e.details()


def test_grammar_state_survives_a_migration_mid_stream(cluster, client, offline):
    """The decode worker dies mid-answer; the router re-sends the tokens generated so far, the new workers
    replay them into a fresh grammar state, and the answer goes on exactly as undisturbed."""
    params = greedy(StructuredOutput(regex=MIGRATION_REGEX), max_tokens=400)
    stream = client.generate([5, 6, 7, 8], params, timeout_s=120)
    first = next(stream)
    victim = next(c for c in worker_components(cluster) if c.name.startswith("decode")
                  and worker_stats(c.address, "decode", check=False).worker_id == first.decode_worker)
    second = next(stream)
    os.kill(victim.pid, signal.SIGKILL)
    cluster.killed.add(victim.name)
    rest = list(stream)
    tokens = [t for m in [first, second, *rest] for t in m.token_ids]
    expected = offline.generate([[5, 6, 7, 8]], params)[0].outputs[0]
    assert tokens == expected.token_ids and rest[-1].finish_reason == "length"
    assert re.fullmatch("([a-z]{3}[0-9]{2} )*[a-z0-9 ]*", expected.text)
    assert len(expected.text) > 40
    wait_idle(cluster, skip=tuple(cluster.killed))


# --- the OpenAI HTTP API, official client ---------------------------------------------------------------

def test_http_json_schema_parses_validates_and_equals_offline(http, model, offline):
    answer = http.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather?"}], max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA,
                                                                 "strict": True}})
    text = answer.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    prompt = offline.tokenizer.apply_chat_template_ids([{"role": "user", "content": "Weather?"}])
    assert text == offline.generate([prompt], greedy(CASES["json_schema"]))[0].outputs[0].text
    assert answer.choices[0].finish_reason == "stop"


def test_http_completions_take_response_format_too(http, model, offline):
    answer = http.completions.create(model=model, prompt="Data:", max_tokens=48, temperature=0,
                                     extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                         "name": "weather", "schema": SCHEMA}}})
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == offline.generate(["Data:"], greedy(CASES["json_schema"]))[0].outputs[0].text
    jsonschema.validate(json.loads(answer.choices[0].text), SCHEMA)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER_TOOL], "stream": True}, "tools"),
])
def test_http_bad_structured_fields_are_400_naming_the_param(http, model, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        http.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                     extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_http_named_tool_choice_gives_an_exact_tool_call(http, model, offline):
    answer = http.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=48, temperature=0,
        tools=[WEATHER_TOOL, TIME_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = answer.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    prompt = offline.tokenizer.apply_chat_template_ids([{"role": "user", "content": "Weather in Paris?"}],
                                                       tools=[WEATHER_TOOL, TIME_TOOL])
    spec = StructuredOutput(json_schema=json.dumps(WEATHER_TOOL["function"]["parameters"]))
    assert call.function.arguments == offline.generate([prompt], greedy(spec))[0].outputs[0].text


def test_http_a_tool_result_goes_back_to_the_model(cluster, http, model, offline):
    """The second turn of tool use: the assistant's call (arguments as JSON text) and the tool's answer are shown
    to the model through its template exactly as offline (arguments parsed, as vLLM hands them to templates)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "C"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    answer = http.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=4,
                                          temperature=0, tool_choice="none", extra_body={"ignore_eos": True})
    rendered = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "unit": "C"}}}]},
                {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}]
    prompt = offline.tokenizer.apply_chat_template_ids(rendered, tools=[WEATHER_TOOL])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>' in \
        offline.tokenizer.decode(prompt, skip_special_tokens=False)
    assert answer.usage.prompt_tokens == len(prompt)
    ref = offline.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].outputs[0]
    assert answer.choices[0].message.content == ref.text
    tokenized = httpx.post(cluster.http_base + "/tokenize", json={"messages": messages, "tools": [WEATHER_TOOL]},
                           timeout=30).json()
    assert tokenized["tokens"] == prompt
    for bad, param in [
        ([{"role": "user", "content": "x", "tool_call_id": "c"}], "messages[0].tool_call_id"),
        ([{"role": "user", "content": "x"}, {**messages[1], "tool_calls": [
            {**call, "function": {"name": "get_weather", "arguments": "{oops"}}]}],
         "messages[1].tool_calls[0].function.arguments"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            http.chat.completions.create(model=model, messages=bad, tools=[WEATHER_TOOL], max_tokens=2)
        assert err.value.body["param"] == param, err.value.body
    # at most one call: held by the grammar where it can be, refused where nothing could hold the model to it
    one = http.chat.completions.create(model=model, messages=messages[:1], tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=96, temperature=0)
    assert len(one.choices[0].message.tool_calls) == 1
    with pytest.raises(openai.BadRequestError) as err:
        http.chat.completions.create(model=model, messages=messages[:1], tools=[WEATHER_TOOL],
                                     parallel_tool_calls=False, max_tokens=2)
    assert err.value.body["param"] == "parallel_tool_calls"


def test_http_required_tool_choice_gives_parsed_calls_of_the_tools(http, model):
    answer = http.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Time?"}], max_tokens=96, temperature=0,
        tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    params = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name]["function"]["parameters"])


def test_http_tool_choice_none_renders_the_tools_and_parses_nothing(http, model):
    answer = http.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        tools=[WEATHER_TOOL], tool_choice="none", extra_body={"ignore_eos": True})
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens > 60  # the tool definitions were rendered into the prompt


def test_hermes_calls_are_parsed_out_of_an_auto_answer():
    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
            '</tool_call>\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')
    content, calls = parse_hermes_calls(text, {"get_weather", "get_time"})
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris", "unit": "C"}')]
    assert content == 'Let me check. \n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
    assert parse_hermes_calls("no calls", {"f"}) == ("no calls", [])
