"""The disaggregated cluster end to end: real redis-server, router and workers as processes, real gRPC,
KV over TCP. Its output is compared token for token with the offline engine (itself held to HF)."""

from __future__ import annotations

import json
import threading

import grpc
import pytest
import redis
from cluster_helpers import internal_channel, rpc_error, wait_idle, worker_components
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from test_engine_vs_hf import assert_matches_hf, hf_model, prompts_for

from cluster.kv_event_publisher import stream_key
from cluster.registry import WorkerRegistry
from deploy.local_cluster import ClusterConfig, LocalCluster
from duet.client import Client, stream_to_record
from engine import LLM, SamplingParams

ENGINE = dict(num_kv_blocks=160, max_num_batched_tokens=32, max_model_len=2048)
WORKER_ARGS = ["--num-kv-blocks", "160", "--max-num-batched-tokens", "32", "--max-model-len", "2048"]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    config = ClusterConfig(model_dir=str(tiny_llama_dir), worker_args=WORKER_ARGS,
                           router_args=["--max-model-len", "2048"])
    with LocalCluster(config).start() as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.router_address) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(tiny_llama_dir, **ENGINE)


@pytest.fixture(autouse=True)
def idle_after(cluster):
    yield
    wait_idle(cluster)  # every test leaves every block back in its pool, integrity checked on each worker


def run(client, prompt, params, **kw):
    return stream_to_record(client.generate(prompt, params, timeout_s=60, **kw))


def test_greedy_matches_offline_engine_and_hf(cluster, client, offline, tiny_llama_dir):
    vocab = offline.engine.model_config.vocab_size
    prompts = prompts_for(vocab, [1, 5, 16, 17, 40, 100], seed=3)  # 40 and 100 span several 32-token chunks
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    hf = hf_model(tiny_llama_dir)
    for prompt, out in zip(prompts, offline.generate(prompts, params)):
        ref = out.outputs[0]
        got = run(client, prompt, params)
        assert got["token_ids"] == ref.token_ids
        assert got["text"] == ref.text
        assert got["finish_reason"] == "length" and got["prompt_tokens"] == len(prompt)
        for lp, ref_lp in zip(got["logprobs"], ref.logprobs, strict=True):
            # the offline API's shape (vLLM's): {sampled id: (logprob, rank)}, then the top-k with ranks 1..k
            want = {lp["token_id"]: (lp["rank"], lp["logprob"])}
            want.update({t: (rank, logprob) for rank, (t, logprob) in enumerate(lp["top"], start=1)})
            assert list(ref_lp) == list(want)
            assert all(ref_lp[t].rank == rank and abs(ref_lp[t].logprob - logprob) < 1e-5
                       for t, (rank, logprob) in want.items())
        assert_matches_hf(hf, prompt, got["token_ids"])


def test_prefix_cache_hit_gives_the_same_tokens(client, offline):
    shared = prompts_for(offline.engine.model_config.vocab_size, [64], seed=11)[0]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = run(client, shared + [7, 8, 9], params)
    second = run(client, shared + [10, 11], params)
    assert second["cached_tokens"] == 64  # 4 full blocks of the shared prefix were reused
    assert first["token_ids"] == offline.generate([shared + [7, 8, 9]], params)[0].outputs[0].token_ids
    assert second["token_ids"] == offline.generate([shared + [10, 11]], params)[0].outputs[0].token_ids


def test_seeded_sampling_matches_offline_engine(client, offline):
    prompts = prompts_for(offline.engine.model_config.vocab_size, [9, 33], seed=5)
    cases = [
        SamplingParams(max_tokens=20, temperature=0.9, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.3, top_k=20, top_p=0.9, seed=2**63 + 5, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.7, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5,
                       frequency_penalty=0.3, seed=42, ignore_eos=True),
    ]
    for params in cases:
        for prompt in prompts:
            [ref] = offline.generate([prompt], params)
            assert run(client, prompt, params)["token_ids"] == ref.outputs[0].token_ids


def test_stop_strings_and_stop_tokens_end_like_offline(client, offline):
    text = "Hello there, how are you today?"
    [greedy] = offline.generate([text], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs
    stop_str = greedy.text[5:8]
    for params in (
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop_str]),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop_str], include_stop_str_in_output=True),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[greedy.token_ids[3]]),
        SamplingParams(max_tokens=1, temperature=0),
        SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[greedy.token_ids[0]]),  # ends at token 1
    ):
        ref = offline.generate([text], params)[0].outputs[0]
        got = run(client, text, params)
        assert (got["token_ids"], got["text"], got["finish_reason"], got["stop_reason"]) == (
            ref.token_ids, ref.text, ref.finish_reason, ref.stop_reason), params


def test_chat_prompt_uses_the_chat_template(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = run(client, messages, params)
    ref = offline.chat(messages, params)[0]
    assert got["token_ids"] == ref.outputs[0].token_ids and got["prompt_tokens"] == len(ref.prompt_token_ids)


def test_32_concurrent_streams_all_complete_correctly(client, offline):
    prompts = prompts_for(offline.engine.model_config.vocab_size, [3 + 2 * i for i in range(32)], seed=21)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    refs = offline.generate(prompts, params)
    results: dict[int, dict] = {}

    def one(i):
        results[i] = run(client, prompts[i], params)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == list(range(32))
    for i, ref in enumerate(refs):
        assert results[i]["token_ids"] == ref.outputs[0].token_ids, i


def test_client_cancel_and_deadline_release_every_block(cluster, client):
    long = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)
    stream = client.generate(list(range(2, 300)), long, timeout_s=60)
    received = 0
    for msg in stream:
        received += len(msg.token_ids)
        if received >= 5:
            break
    stream.cancel()
    err = rpc_error(lambda: list(client.generate(list(range(2, 300)), long, timeout_s=0.5)))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(cluster)


def test_abort_by_request_id_ends_the_stream(cluster, client):
    stream = client.generate([5, 6, 7], SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True),
                             request_id="abort-me", timeout_s=60)
    first = next(stream)
    assert first.request_id == "abort-me"
    assert client.abort("abort-me") is True
    last = list(stream)[-1]
    assert last.finish_reason == "abort"
    assert client.abort("abort-me") is False


BAD = [
    (dict(text=""), "text"),
    (dict(ids=[1, 512]), "token_ids.ids[1]"),
    (dict(ids=[-1]), "token_ids.ids[0]"),
    (dict(ids=[5] * 2100), "max_model_len=2048"),
    (dict(ids=[1], max_tokens=0), "sampling.max_tokens"),
    (dict(ids=[1], temperature=-0.5), "sampling.temperature"),
    (dict(ids=[1], top_p=0.0), "sampling.top_p"),
    (dict(ids=[1], top_p=1.5), "sampling.top_p"),
    (dict(ids=[1], min_tokens=-1), "sampling.min_tokens"),
    (dict(ids=[1], top_k=-2), "sampling.top_k"),
    (dict(ids=[1], min_p=1.5), "sampling.min_p"),
    (dict(ids=[1], stop_token_ids=[600]), "stop_token_ids[0]"),
    (dict(ids=[1], logprobs=21), "logprobs"),
    (dict(), "prompt"),
    (dict(chat=[("robot", "hi")]), "chat.messages[0].role"),
]


@pytest.mark.parametrize("fields,named", BAD, ids=[b[1] for b in BAD])
def test_bad_input_is_invalid_argument_naming_the_field(client, fields, named):
    from duet.v1 import generation_pb2 as pb

    msg = pb.GenerateRequest()
    if "text" in fields:
        msg.text = fields["text"]
    if "ids" in fields:
        msg.token_ids.ids.extend(fields["ids"])
    for role, content in fields.get("chat", []):
        msg.chat.messages.add(role=role, content=content)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "logprobs", "min_tokens"):
        if name in fields:
            setattr(msg.sampling, name, fields[name])
    msg.sampling.stop_token_ids.extend(fields.get("stop_token_ids", []))
    err = rpc_error(lambda: list(client.stub.Generate(msg, timeout=10)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in err.details()


def test_oversized_message_is_refused_and_the_router_keeps_serving(client):
    err = rpc_error(lambda: list(client.generate("x" * (5 * 1024 * 1024), SamplingParams(max_tokens=1), timeout_s=10)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert run(client, [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))["finish_reason"] == "length"


def test_duplicate_live_request_id_is_refused(client):
    params = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)
    stream = client.generate([5, 6], params, request_id="dup", timeout_s=60)
    next(stream)
    err = rpc_error(lambda: list(client.generate([5, 6], params, request_id="dup", timeout_s=10)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.details()
    stream.cancel()


def test_no_room_on_the_decode_worker_is_resource_exhausted_with_retry_hint(cluster, client):
    # 160 blocks of 16 tokens: a 1600-token prompt takes 100, so a second one cannot be admitted
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    hold = client.generate([i % 500 + 2 for i in range(1600)], params, timeout_s=120)
    next(hold)
    err = rpc_error(lambda: list(client.generate([i % 400 + 3 for i in range(1600)], SamplingParams(max_tokens=4),
                                                 timeout_s=30)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(err.trailing_metadata())
    assert int(trailers["grpc-retry-pushback-ms"]) > 0
    hold.cancel()


def test_reserve_carries_the_request_and_decode_attaches_by_ticket(cluster, offline):
    """The internal hand-off without the router: the prompt goes to the decode worker once, in Reserve;
    Decode names only the ticket and the first token; the tokens are the offline engine's."""
    from cluster.proto_convert import sampling_to_proto
    from duet.internal.v1 import workers_pb2 as wpb
    from duet.internal.v1 import workers_pb2_grpc as wpb_grpc

    prefill, decode = (next(c for c in worker_components(cluster) if c.name.startswith(r))
                       for r in ("prefill", "decode"))
    prompt = prompts_for(offline.engine.model_config.vocab_size, [37], seed=5)[0]
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    sampling = sampling_to_proto(params)
    with internal_channel(decode.address) as dch, internal_channel(prefill.address) as pch:
        d, p = wpb_grpc.DecodeWorkerStub(dch), wpb_grpc.PrefillWorkerStub(pch)
        reserved = d.Reserve(wpb.ReserveRequest(request_id="direct-1", prompt_token_ids=prompt, sampling=sampling),
                             timeout=10)
        assert reserved.num_blocks == 3  # 37 tokens in 16-token blocks
        first = p.Prefill(wpb.PrefillRequest(
            request_id="direct-1", prompt_token_ids=prompt, sampling=sampling,
            target=wpb.KVTarget(kv_address=reserved.kv_address, reservation_id=reserved.reservation_id,
                                kv_addresses=reserved.kv_addresses)), timeout=30)
        replies = list(d.Decode(wpb.DecodeRequest(reservation_id=reserved.reservation_id,
                                                  first_token_id=first.first_token_id), timeout=30))
        tokens = [first.first_token_id] + [t for r in replies for t in r.token_ids]
        assert tokens == offline.generate([prompt], params)[0].outputs[0].token_ids
        assert replies[-1].finish_reason == "length"

        # a released reservation takes its request with it: Decode finds nothing to attach to
        released = d.Reserve(wpb.ReserveRequest(request_id="direct-2", prompt_token_ids=prompt, sampling=sampling),
                             timeout=10)
        assert d.Release(wpb.ReleaseRequest(reservation_id=released.reservation_id), timeout=10).found
        e = rpc_error(lambda: list(d.Decode(wpb.DecodeRequest(reservation_id=released.reservation_id,
                                                              first_token_id=1), timeout=10)))
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION

        # what would break this worker under its own settings is refused at Reserve, naming the field; what
        # only exceeds its context is FAILED_PRECONDITION (another worker, with a longer one, may take it)
        vocab = offline.engine.model_config.vocab_size
        invalid, not_here = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
        for bad, code, named in (([1, vocab, 2], invalid, "prompt_token_ids[1]"), ([], invalid, "prompt_token_ids"),
                                 ([1] * 2048, not_here, "max_tokens=16 is invalid: must be at most 0")):
            e = rpc_error(lambda b=bad: d.Reserve(wpb.ReserveRequest(request_id="bad", prompt_token_ids=b),
                                                  timeout=10))
            assert e.code() == code and named in e.details(), (named, e.details())


def test_router_serves_health_and_reflection(cluster):
    with grpc.insecure_channel(cluster.router_address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "duet.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=5)
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert {"duet.v1.Generation", "grpc.health.v1.Health"} <= names


def test_registry_and_kv_events_in_redis(cluster, client, offline):
    run(client, list(range(10, 60)), SamplingParams(max_tokens=2, temperature=0))
    r = redis.Redis.from_url(cluster.redis_url)
    workers = WorkerRegistry(r).list_workers(offline.engine.model_id)
    by_role = {w.info.role: (w.info, w.load) for w in workers}
    assert sorted(by_role) == ["decode", "prefill"] and len(workers) == 2
    decode_info, decode_load = by_role["decode"]
    assert decode_info.block_size == 16 and decode_info.num_kv_blocks == 160 and decode_info.kv_address
    assert decode_load.num_free_blocks <= 160
    prefill_info = by_role["prefill"][0]
    entries = r.xrange(stream_key(offline.engine.model_id, prefill_info.worker_id))
    events = [json.loads(fields[b"event"]) for _, fields in entries]
    assert any(e["type"] == "stored" for e in events)
    sequences = [e["sequence"] for e in events]
    assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))  # no gap
    assert len({e["epoch"] for e in events}) == 1


def test_auth_token_on_the_public_endpoint(cluster, tiny_llama_dir):
    from router.server import RouterConfig, RouterServer

    server = RouterServer(RouterConfig(redis_url=cluster.redis_url, model_dir=tiny_llama_dir, port=0,
                                       auth_token="s3cret", max_model_len=2048))
    server.start()
    try:
        with Client(server.address) as anonymous:
            err = rpc_error(lambda: list(anonymous.generate([1, 2], SamplingParams(max_tokens=2), timeout_s=10)))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(server.address, auth_token="wrong") as wrong:
            err = rpc_error(lambda: list(wrong.generate([1, 2], SamplingParams(max_tokens=2), timeout_s=10)))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(server.address, auth_token="s3cret") as good:
            assert len(run(good, [1, 2], SamplingParams(max_tokens=2, temperature=0))["token_ids"]) == 2
    finally:
        server.stop()


def test_no_worker_of_a_role_is_unavailable(cluster, tiny_llama_dir):
    from router.server import RouterConfig, RouterServer

    server = RouterServer(RouterConfig(redis_url=cluster.redis_url, model_dir=tiny_llama_dir, model_id="other-model",
                                       port=0))
    server.start()
    try:
        with Client(server.address) as c:
            err = rpc_error(lambda: list(c.generate([1, 2], SamplingParams(max_tokens=2), timeout_s=10)))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "no prefill worker" in err.details()
    finally:
        server.stop()


def test_components_are_separate_processes(cluster):
    names = sorted(c.name for c in cluster.components)
    assert names == ["decode-0", "prefill-0", "redis", "router"]
    assert len({c.pid for c in cluster.components}) == 4
    assert len(worker_components(cluster)) == 2


def test_tls_on_the_public_endpoint(cluster, tiny_llama_dir, tmp_path):
    import subprocess

    from router.server import RouterConfig, RouterServer

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    server = RouterServer(RouterConfig(redis_url=cluster.redis_url, model_dir=tiny_llama_dir, port=0, tls_cert=cert,
                                       tls_key=key, max_model_len=2048))
    server.start()
    try:
        with Client(server.address, root_cert=cert.read_bytes()) as secure:
            assert len(run(secure, [1, 2], SamplingParams(max_tokens=2, temperature=0))["token_ids"]) == 2
        with Client(server.address) as plaintext:
            err = rpc_error(lambda: list(plaintext.generate([1, 2], SamplingParams(max_tokens=2), timeout_s=5)))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_openai_http_api(cluster, tiny_llama_dir, offline):
    import urllib.error
    import urllib.request

    from router.server import RouterConfig, RouterServer

    server = RouterServer(RouterConfig(redis_url=cluster.redis_url, model_dir=tiny_llama_dir, port=0, http_port=0,
                                       max_model_len=2048))
    server.start()
    base = f"http://127.0.0.1:{server.http.port}"

    def post(path, body):
        req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=60)

    try:
        ref = offline.generate(["Hello there"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        body = json.load(post("/v1/completions", {"prompt": "Hello there", "max_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True}))
        assert body["choices"][0]["text"] == ref.outputs[0].text and body["choices"][0]["finish_reason"] == "length"
        assert body["id"].startswith("cmpl-")
        named = json.load(post("/v1/completions", {"prompt": "Hello there", "max_tokens": 2, "request_id": "my-id"}))
        assert named["id"] == "my-id"  # one id: the response's is the request's, as the router and workers log it
        assert body["usage"]["completion_tokens"] == 6 and body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
        stream = post("/v1/completions", {"prompt": "Hello there", "max_tokens": 6, "temperature": 0,
                                          "ignore_eos": True, "stream": True}).read().decode()
        events = [line[6:] for line in stream.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == ref.outputs[0].text
        messages = [{"role": "user", "content": "Hi!"}]
        chat_ref = offline.chat(messages, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
        chat = json.load(post("/v1/chat/completions", {"messages": messages, "max_tokens": 5, "temperature": 0,
                                                       "ignore_eos": True}))
        assert chat["choices"][0]["message"] == {"role": "assistant", "content": chat_ref.outputs[0].text}
        models = json.load(urllib.request.urlopen(base + "/v1/models", timeout=10))
        assert [m["id"] for m in models["data"]] == [offline.engine.model_id]
        for bad, param in (({"prompt": "x", "temperature": -1}, "temperature"),
                           ({"prompt": 5}, "prompt"), ({"prompt": "x", "max_tokens": "ten"}, "max_tokens")):
            with pytest.raises(urllib.error.HTTPError) as err:
                post("/v1/completions", bad)
            assert err.value.code == 400
            assert param in json.load(err.value)["error"]["message"]
        assert json.load(urllib.request.urlopen(base + "/health", timeout=10)) == {"status": "ok"}
    finally:
        server.stop()
