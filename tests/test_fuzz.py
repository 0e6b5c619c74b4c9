"""Fuzz the public request schemas against a real cluster (redis-server, router, workers as processes): any
input gets an answer (OK, or a 4xx / INVALID_ARGUMENT-class status naming what is wrong) within a bounded
time, never INTERNAL, a hang or a dead worker, and every block returns to its pool (issue 15).

The CI profile is derandomized (same inputs every run); a longer random run for benchmarks/RESULTS.md:
    pytest tests/test_fuzz.py -s --hypothesis-profile=fuzz-soak
prints what was tried and what came back.
"""

from __future__ import annotations

import json
from collections import Counter

import grpc
import httpx
import pytest
from cluster_helpers import alive, wait_idle, worker_components
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy.local_cluster import ClusterConfig, LocalCluster
from duet.v1 import generation_pb2 as pb
from duet.v1 import generation_pb2_grpc as pb_grpc
from engine.ports import pick_free_ports

# 60 derandomized inputs per schema in CI; the fuzz-soak profile's (tests/conftest.py) when it is loaded
SOAK = settings.get_profile("fuzz-soak")
CI = SOAK if settings.default.max_examples == SOAK.max_examples else settings(
    max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
CALL_TIMEOUT_S = 30.0  # a bound, not a target: a tiny-model request answers in well under a second
MESSAGES_READ = 4  # then the stream is cancelled: cancellation is part of what is fuzzed

# what a client may get back for a request it made up; anything else (INTERNAL, UNKNOWN, UNAVAILABLE from a
# dead worker, a hang) is a bug
GRPC_ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
HTTP_ANSWERS = {200, 400, 404, 405, 413, 429}

int64 = st.integers(-2**63, 2**63 - 1)
texts = st.text(max_size=200)
tiny = st.sampled_from([1e-300, 5e-324, 1e-45, 1e-37, 1e-6])  # valid, and each crashed a worker once
# Valid values, edges included: most requests should get past validation and run.
VALID_SAMPLING = {
    "max_tokens": st.integers(1, 24),
    "temperature": st.one_of(tiny, st.floats(0, 2), st.sampled_from([0.0, 1e6])),
    "top_p": st.one_of(tiny, st.floats(0, 1, exclude_min=True)),
    "min_p": st.one_of(tiny, st.floats(0, 1)),
    "repetition_penalty": st.one_of(tiny, st.floats(0, 10, exclude_min=True), st.just(1e300)),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "top_k": st.one_of(st.sampled_from([-1, 0]), st.integers(1, 600)),
    "min_tokens": st.integers(0, 8),
    "logprobs": st.integers(0, 20),
    "seed": st.integers(0, 2**64 - 1),
}
# Anything the wire can carry: past each range's ends is where the other findings were.
WILD_SAMPLING = {
    **{name: st.floats() for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                      "frequency_penalty")},
    **{name: st.one_of(st.sampled_from([-1, 0, 2047, 2048, 10**9]), int64) for name in ("max_tokens", "top_k",
                                                                                         "logprobs", "min_tokens")},
}
SAMPLING_FIELDS = sorted(VALID_SAMPLING)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    (http_port,) = pick_free_ports(1)
    config = ClusterConfig(model_dir=str(tiny_llama_dir),
                           worker_args=["--num-kv-blocks", "160", "--max-model-len", "2048"],
                           router_args=["--max-model-len", "2048", "--http-port", str(http_port)])
    with LocalCluster(config).start() as c:
        c.http_base = f"http://127.0.0.1:{http_port}"
        c.pids_at_start = {w.name: w.pid for w in worker_components(c)}
        yield c


@pytest.fixture(scope="module")
def outcomes():
    seen: dict[str, Counter] = {"grpc": Counter(), "grpc-bytes": Counter(), "http": Counter(), "http-bytes": Counter()}
    yield seen
    for kind, counts in seen.items():
        print(f"\nfuzz {kind}: {sum(counts.values())} inputs: {dict(counts.most_common())}")


@pytest.fixture(scope="module")
def stub(cluster):
    with grpc.insecure_channel(cluster.router_address) as channel:
        yield pb_grpc.GenerationStub(channel), channel


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(request_id=draw(st.one_of(st.just(""), texts)) if draw(st.booleans()) else "",
                             cache_salt=draw(texts))
    kind = draw(st.sampled_from(["text", "ids", "chat", "none"]))  # "none": no prompt
    if kind == "text":
        msg.text = draw(st.one_of(texts, st.text(min_size=1, max_size=20000)))
    elif kind == "ids":
        msg.token_ids.ids.extend(draw(st.one_of(st.lists(st.integers(0, 511), max_size=64),
                                                st.lists(st.one_of(st.integers(0, 600), int64), max_size=8))))
    elif kind == "chat":
        for role, content in draw(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool", "x"]),
                                                      texts), max_size=4)):
            msg.chat.messages.add(role=role, content=content)
        if draw(st.booleans()):
            msg.chat.add_generation_prompt = draw(st.booleans())
    for name in draw(st.lists(st.sampled_from(SAMPLING_FIELDS), unique=True)):
        setattr(msg.sampling, name, draw(VALID_SAMPLING[name]))
    if draw(st.integers(0, 3)) == 0:  # one field out of range or of any value the wire carries
        name = draw(st.sampled_from(sorted(WILD_SAMPLING)))
        setattr(msg.sampling, name, draw(WILD_SAMPLING[name]))
    msg.sampling.stop.extend(draw(st.lists(st.one_of(texts.filter(bool), texts), max_size=2)))
    msg.sampling.stop_token_ids.extend(draw(st.lists(st.integers(0, 511), max_size=2)))
    if draw(st.integers(0, 5)) == 0:
        msg.sampling.stop_token_ids.append(draw(int64))
    if draw(st.integers(0, 3)) == 0:  # ids past the vocabulary (512) and biases past +-100 included
        msg.sampling.logit_bias.update(draw(st.dictionaries(st.one_of(st.integers(0, 600), int64),
                                                            st.one_of(st.floats(-100, 100), st.floats()), max_size=3)))
    msg.sampling.ignore_eos = draw(st.booleans())
    return msg


def _grpc_outcome(call) -> grpc.StatusCode:
    try:
        for i, _ in enumerate(call):
            if i + 1 >= MESSAGES_READ:
                call.cancel()
                break
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@given(msg=generate_requests())
@CI
def test_any_grpc_request_gets_an_answer(cluster, stub, outcomes, msg):
    code = _grpc_outcome(stub[0].Generate(msg, timeout=CALL_TIMEOUT_S))
    outcomes["grpc"][code.name] += 1
    assert code in GRPC_ANSWERS, f"{code.name} for {msg}"


@given(raw=st.one_of(st.binary(max_size=300), generate_requests().map(
    lambda m: m.SerializeToString() + b"\x12\x03\xff\xfe\xfd")))  # the last: text = invalid UTF-8
@CI
def test_any_bytes_on_the_wire_get_an_answer(cluster, stub, outcomes, raw):
    generate = stub[1].unary_stream("/duet.v1.Generation/Generate", request_serializer=None,
                                    response_deserializer=pb.GenerateResponse.FromString)
    code = _grpc_outcome(generate(raw, timeout=CALL_TIMEOUT_S))
    outcomes["grpc-bytes"][code.name] += 1
    assert code in GRPC_ANSWERS, f"{code.name} for {raw!r}"


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), int64, st.integers(), st.floats(allow_nan=False), texts),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)), max_leaves=12)
VALID_BODY = {
    **VALID_SAMPLING,
    "stop": st.one_of(texts.filter(bool), st.lists(texts.filter(bool), max_size=3)),
    "stream": st.booleans(),
    "timeout": st.floats(0.5, 60),
    "ignore_eos": st.booleans(),
    "request_id": texts,
    "n": st.integers(1, 3),
    "logit_bias": st.dictionaries(st.integers(0, 600).map(str), st.floats(-100, 100), max_size=3),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": texts,
}
token_ids = st.lists(st.integers(0, 511), min_size=1, max_size=16)
PROMPTS = {"/v1/completions": ("prompt", st.one_of(texts.filter(bool), token_ids,
                                                   st.lists(texts.filter(bool), min_size=1, max_size=3),
                                                   st.lists(token_ids, min_size=1, max_size=3))),
           "/v1/chat/completions": ("messages", st.lists(st.fixed_dictionaries(
               {"role": st.sampled_from(["user", "system", "assistant", "developer"]),
                "content": st.one_of(texts, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                                                     max_size=2))}), min_size=1, max_size=3))}
ENDPOINT_BODY = {"/v1/completions": {"echo": st.booleans(), "logprobs": st.integers(0, 5)},
                 "/v1/chat/completions": {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
                                          "max_completion_tokens": st.integers(1, 24)}}


@st.composite
def http_bodies(draw, path: str) -> dict:
    """A valid body, then (often) one field replaced by any JSON value or dropped."""
    prompt_field, prompt = PROMPTS[path]
    body = {prompt_field: draw(prompt)}
    valid = {**VALID_BODY, **ENDPOINT_BODY[path]}
    for name in draw(st.lists(st.sampled_from(sorted(valid)), unique=True)):
        body[name] = draw(valid[name])
    if draw(st.integers(0, 2)) == 0:
        name = draw(st.sampled_from(sorted([*valid, prompt_field])))
        if draw(st.booleans()):
            body[name] = draw(json_values)
        else:
            body.pop(name, None)
    return body


def _http_outcome(base: str, path: str, content: bytes, headers: dict) -> int:
    with httpx.Client(base_url=base, timeout=CALL_TIMEOUT_S) as http:
        with http.stream("POST", path, content=content, headers=headers) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i + 1 >= MESSAGES_READ:
                    break  # leaving the block closes the connection: the server sees a disconnect
            return response.status_code


@given(data=st.data(), path=st.sampled_from(sorted(PROMPTS)))
@CI
def test_any_http_body_gets_a_4xx_or_an_answer(cluster, outcomes, data, path):
    body = data.draw(http_bodies(path))
    status = _http_outcome(cluster.http_base, path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    outcomes["http"][status] += 1
    assert status in HTTP_ANSWERS, f"{status} for {path} {body}"


@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/nope"]),
       raw=st.binary(max_size=300), content_type=st.sampled_from(["application/json", "text/plain", "\u00e9"]))
@CI
def test_any_http_bytes_get_a_4xx(cluster, outcomes, path, raw, content_type):
    status = _http_outcome(cluster.http_base, path, raw, {"Content-Type": content_type.encode()})
    outcomes["http-bytes"][status] += 1
    assert status in HTTP_ANSWERS, f"{status} for {path} {raw!r}"


def test_after_the_fuzz_every_worker_is_alive_idle_and_whole(cluster):
    """Runs last in this module: the same worker processes serve, and every block is back in its pool."""
    assert {w.name: w.pid for w in worker_components(cluster)} == cluster.pids_at_start
    assert all(alive(pid) for pid in cluster.pids_at_start.values())
    assert cluster.poll() is None
    wait_idle(cluster)
    with grpc.insecure_channel(cluster.router_address) as channel:
        msg = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        msg.token_ids.ids.extend([1, 2, 3])
        replies = list(pb_grpc.GenerationStub(channel).Generate(msg, timeout=CALL_TIMEOUT_S))
    assert sum(len(r.token_ids) for r in replies) == 3 and replies[-1].finish_reason == "length"
