"""Issue 15's findings, each against a real cluster (redis-server, router and workers as processes, gRPC on
loopback): no request can break a worker or its batch-mates, bad input gets a clear status, deadlines and
cancels release what they held at once, and the router's work before admission is bounded."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from pathlib import Path

import grpc
import pytest
from cluster_helpers import internal_channel, rpc_error, wait_idle, worker_components, worker_stats

from deploy.local_cluster import ClusterConfig, LocalCluster
from duet.client import Client, stream_to_record
from duet.v1 import generation_pb2 as pb
from engine import LLM, SamplingParams

# decode KV for 64 blocks of 16 tokens under a 2048-token context: a 1100-token prompt fits the model, never
# the decode worker
WORKER_ARGS = ["--max-model-len", "2048", "--max-num-batched-tokens", "64"]
DECODE_BLOCKS = 64


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    config = ClusterConfig(model_dir=str(tiny_llama_dir), worker_args=WORKER_ARGS,
                           prefill_args=["--num-kv-blocks", "160"], decode_args=["--num-kv-blocks", str(DECODE_BLOCKS)],
                           router_args=["--max-model-len", "2048"])
    with LocalCluster(config).start() as c:
        c.worker_pids = {w.name: w.pid for w in worker_components(c)}
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.router_address) as c:
        yield c


@pytest.fixture(autouse=True)
def idle_after(cluster):
    yield
    wait_idle(cluster)  # every block back in its pool, integrity checked on each worker
    assert {w.name: w.pid for w in worker_components(cluster)} == cluster.worker_pids  # nobody died
    assert cluster.poll() is None


def router_log(cluster) -> str:
    return Path(next(c for c in cluster.components if c.name == "router").log_path).read_text()


def run(client, prompt, params, **kw):
    return stream_to_record(client.generate(prompt, params, timeout_s=60, **kw))


EXTREME = [dict(temperature=1e-37), dict(temperature=1e-300), dict(top_p=1e-300), dict(repetition_penalty=1e-300),
           dict(repetition_penalty=1e300, temperature=5.0), dict(min_p=1e-300, top_k=1)]


def test_extreme_sampling_values_next_to_batch_mates(client, tiny_llama_dir):
    """Each of these once killed the decode worker (temperature 1e-37: NaN weights, a sampled id == vocab
    size) or failed its whole prefill batch (top_p 1e-300): now each samples valid tokens, and its batch-mates
    get exactly the tokens they get alone."""
    prompts = [[3 + i, 40 + i, 7, 99, 12 + i] for i in range(6)]
    normal = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, max_model_len=2048).generate(prompts, normal)]
    with cf.ThreadPoolExecutor(len(prompts) + len(EXTREME)) as pool:
        mates = [pool.submit(run, client, p, normal) for p in prompts]
        extremes = [pool.submit(run, client, prompts[0], SamplingParams(max_tokens=12, ignore_eos=True, **kw))
                    for kw in EXTREME]
        assert [m.result()["token_ids"] for m in mates] == alone
        for e in extremes:
            record = e.result()
            assert record["finish_reason"] == "length" and all(0 <= t < 512 for t in record["token_ids"])
    assert extremes[0].result()["token_ids"] == alone[0]  # a temperature below 1e-5 is greedy


def test_max_tokens_past_the_context_is_invalid_argument(client):
    err = rpc_error(lambda: run(client, [1, 2, 3], SamplingParams(max_tokens=10**9)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == ("max_tokens=1000000000 is invalid: must be at most 2045: this model's maximum context "
                             "length is 2048 tokens and the prompt holds 3")
    assert run(client, [1, 2, 3], SamplingParams(max_tokens=20, temperature=0))["finish_reason"] in ("stop", "length")


def test_a_prompt_no_decode_worker_can_hold_is_failed_precondition_without_a_retry_hint(cluster, client):
    prompt = [5 + i % 400 for i in range(1100)]  # fits the router's 2048-token context, not the 64 blocks
    err = rpc_error(lambda: run(client, prompt, SamplingParams(max_tokens=4)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details().startswith("no decode worker can ever hold 1100 prompt tokens: decode worker decode-")
    assert err.details().endswith("prompt='1100 tokens' is invalid: must be at most max_model_len=1024 tokens")
    assert "grpc-retry-pushback-ms" not in dict(err.trailing_metadata() or ())


def test_a_huge_prompt_is_refused_before_tokenizing_and_a_canary_goes_through(cluster, client):
    """A 3.9 MiB text was once tokenized in full (2M tokens) before its length was checked: seconds of
    router time while other requests waited, and gigabytes of router memory."""
    router_pid = next(c.pid for c in cluster.components if c.name == "router")
    rss_before_kb = _rss_kb(router_pid)
    huge = "word " * (39 * 1024 * 1024 // 50)
    with cf.ThreadPoolExecutor(2) as pool:
        refused = pool.submit(lambda: rpc_error(lambda: run(client, huge, SamplingParams(max_tokens=1))))
        canary = pool.submit(run, client, "Hi", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        err, record = refused.result(), canary.result()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(f"text='{len(huge)} bytes' is invalid: must be at most 34816 bytes")
    assert record["finish_reason"] == "length" and len(record["token_ids"]) == 4
    assert _rss_kb(router_pid) - rss_before_kb < 100 * 1024  # the message itself, not a 2M-token list


def _rss_kb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


def test_short_deadlines_release_their_reservations_at_once_and_blame_no_worker(cluster, client):
    """20 ms deadlines once left reservations holding decode blocks until their TTL (60 s), and marked the
    healthy workers suspect."""
    suspects_before = router_log(cluster).count("event=suspect")
    codes = []
    for i in range(30):
        try:
            list(client.generate([7, 8, 9 + i], SamplingParams(max_tokens=200, ignore_eos=True), timeout_s=0.02))
            codes.append("OK")
        except grpc.RpcError as e:
            codes.append(e.code().name)
    assert set(codes) <= {"DEADLINE_EXCEEDED", "OK"} and "DEADLINE_EXCEEDED" in codes
    wait_idle(cluster, timeout_s=3.0)  # released at once: far under the 60 s reservation TTL
    assert router_log(cluster).count("event=suspect") == suspects_before


def test_invalid_utf8_is_invalid_argument_and_the_router_keeps_serving(cluster, client):
    generate = client.channel.unary_stream("/duet.v1.Generation/Generate", request_serializer=None,
                                           response_deserializer=pb.GenerateResponse.FromString)
    raw = pb.GenerateRequest(text="x").SerializeToString()[:-1] + b"\xff"  # text = "\xff"
    err = rpc_error(lambda: list(generate(raw, timeout=10)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not decode" in err.details() and "UTF-8" in err.details()
    for w in worker_components(cluster):  # the internal services answer the same
        with internal_channel(w.address) as ch:
            service = "PrefillWorker" if w.name.startswith("prefill") else "DecodeWorker"
            stats = ch.unary_unary(f"/duet.internal.v1.{service}/Stats", request_serializer=None,
                                   response_deserializer=None)
            truncated = b"\x0a\x05"  # field 1, 5 bytes long, then nothing
            assert rpc_error(lambda s=stats, b=truncated: s(b, timeout=10)).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert run(client, [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))["finish_reason"] == "length"



# --- the OpenAI HTTP API -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http(cluster, tiny_llama_dir):
    """A router with the HTTP API, in this process, over the module's workers; 2 s head and body timeouts."""
    from router import openai_http
    from router.server import RouterConfig, RouterServer

    head_timeout_s, openai_http.HEAD_TIMEOUT_S = openai_http.HEAD_TIMEOUT_S, 2.0
    server = RouterServer(RouterConfig(redis_url=cluster.redis_url, model_dir=tiny_llama_dir, port=0, http_port=0,
                                       max_model_len=2048))
    server.http.body_limits.read_timeout_s = 2.0
    server.start()
    server.base = f"http://127.0.0.1:{server.http.port}"
    assert openai_http.READ_TIMEOUT_S > 2.0
    yield server
    server.stop()
    openai_http.HEAD_TIMEOUT_S = head_timeout_s


def raw_http(port: int, head: bytes, body: bytes = b"", timeout_s: float = 10.0) -> tuple[int | None, bytes]:
    """Send bytes as they are (so they can be malformed); (status, response body), status None if the server
    closed the connection without an answer."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(head + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    if not data:
        return None, b""
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def post_head(path: str, body: bytes, **headers: str) -> bytes:
    fields = {"Host": "x", "Content-Type": "application/json", "Content-Length": str(len(body)),
              "Connection": "close", **headers}
    return (f"POST {path} HTTP/1.1\r\n".encode() + b"".join(f"{k}: {v}\r\n".encode() for k, v in fields.items())
            + b"\r\n")


MALFORMED = [  # (name, body, extra headers, status, the error's param)
    ("invalid UTF-8 body", b'{"prompt": "\xff\xfe", "max_tokens": 2}', {}, 400, None),
    ("a JSON array", b"[1, 2]", {}, 400, None),
    ("prompt [2**70]", json.dumps({"prompt": [2**70]}).encode(), {}, 400, "prompt[0]"),
    ("max_tokens 1e20", b'{"prompt": "x", "max_tokens": 1e20}', {}, 400, "max_tokens"),
    ("max_tokens 2**70", json.dumps({"prompt": "x", "max_tokens": 2**70}).encode(), {}, 400, "max_tokens"),
    ("seed -1", b'{"prompt": "x", "seed": -1}', {}, 400, "seed"),
    ('timeout "abc"', b'{"prompt": "x", "timeout": "abc"}', {}, 400, "timeout"),
    ("timeout -1", b'{"prompt": "x", "timeout": -1}', {}, 400, "timeout"),
    ("messages[0] without content", b'{"messages": [{"role": "user"}]}', {}, 400, "messages[0].content"),
]


@pytest.mark.parametrize("name, body, headers, status, param", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_http_bodies_get_a_400_naming_the_field(http, name, body, headers, status, param):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    got, answer = raw_http(http.http.port, post_head(path, body, **headers), body)
    assert got == status, answer
    error = json.loads(answer)["error"]
    assert error["param"] == param and error["code"] == status and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["message"].startswith(f"{param}=")


@pytest.mark.parametrize("content_length", ["abc", "-5", "1.5"])
def test_a_malformed_content_length_is_a_400_from_the_http_stack(http, content_length):
    got, _ = raw_http(http.http.port, post_head("/v1/completions", b'{"prompt": "x"}', **{
        "Content-Length": content_length}), b'{"prompt": "x"}')
    assert got == 400


def test_oversized_declared_body_is_413_without_reading_it_and_a_stalled_body_is_408(http):
    got, answer = raw_http(http.http.port, post_head("/v1/completions", b"", **{"Content-Length": str(10**9)}))
    assert got == 413 and b"exceeds the limit of 4194304" in answer
    got, answer = raw_http(http.http.port, post_head("/v1/completions", b"", **{"Content-Length": "100"}),
                           b'{"prompt":')  # 90 bytes never come
    assert got == 408 and b"did not arrive within 2 s" in answer


def test_a_connection_that_never_finishes_its_head_is_closed(http):
    import socket

    for sent in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):  # idle, and headers that never end
        with socket.create_connection(("127.0.0.1", http.http.port), timeout=10) as s:
            s.sendall(sent)
            assert s.recv(100) == b""  # closed by the server after 2 s (not answered; a 10 s timeout raises)


def test_a_request_head_over_the_limit_is_431_and_the_server_keeps_serving(http):
    from router.openai_http import MAX_HEADER_BYTES

    body = b'{"prompt": [3, 4], "max_tokens": 1}'
    for pad in ("a" * MAX_HEADER_BYTES, "a" * 4000):  # one header past the limit; many that add up past it
        fields = {"X-Pad": pad} if len(pad) > 4000 else {f"X-Pad-{i}": pad for i in range(MAX_HEADER_BYTES // 4000 + 1)}
        got, answer = raw_http(http.http.port, post_head("/v1/completions", body, **fields), body)
        assert got == 431, answer
        assert json.loads(answer)["error"]["message"] == f"request head exceeds the limit of {MAX_HEADER_BYTES} bytes"
    # a head that never ends, refused once it passes the limit (not at the head timeout)
    endless = post_head("/v1/completions", body)[:-2] + b"X-Pad: " + b"a" * MAX_HEADER_BYTES
    got, answer = raw_http(http.http.port, endless, timeout_s=1.5)
    assert got == 431, answer
    near = {f"X-Pad-{i}": "a" * 4000 for i in range(MAX_HEADER_BYTES // 4000 - 1)}  # just under: served
    got, answer = raw_http(http.http.port, post_head("/v1/completions", body, **near), body)
    assert got == 200 and json.loads(answer)["usage"]["completion_tokens"] == 1


def test_auth_wrong_method_and_unknown_route(cluster, tiny_llama_dir):
    from router.server import RouterConfig, RouterServer

    server = RouterServer(RouterConfig(redis_url=cluster.redis_url, model_dir=tiny_llama_dir, port=0, http_port=0,
                                       max_model_len=2048, auth_token="s3cret"))
    server.start()
    try:
        port, body = server.http.port, b'{"prompt": "x", "max_tokens": 1}'
        assert raw_http(port, post_head("/v1/completions", body, Authorization="Bearer \u00e9t\u00e9"), body)[0] == 401
        assert raw_http(port, post_head("/v1/completions", body), body)[0] == 401
        assert raw_http(port, post_head("/v1/completions", body, Authorization="Bearer s3cret"), body)[0] == 200
        assert raw_http(port, b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")[0] == 405
        assert raw_http(port, post_head("/nope", body), body)[0] == 404
        assert raw_http(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")[0] == 200  # probes
    finally:
        server.stop()


def test_50_stalled_connections_do_not_stop_a_normal_request(http):
    import socket

    import openai

    stalled = []
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", http.http.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        stalled.append(s)
    try:
        client = openai.OpenAI(base_url=http.base + "/v1", api_key="none", max_retries=0, timeout=30)
        model = client.models.list().data[0].id
        answer = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 3
    finally:
        for s in stalled:
            s.close()


def test_a_non_streaming_client_that_disconnects_aborts_its_request_at_once(cluster, http):
    import socket

    def ended(status: str) -> float:
        metrics = http.router.metrics
        return metrics.registry.get_sample_value("duet_router_requests_total",
                                                 {"model_name": metrics.model_name, "status": status}) or 0

    cancelled, completed = ended("CANCELLED"), ended("OK")
    body = json.dumps({"prompt": [3, 4, 5], "max_tokens": 1000, "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", http.http.port))
    s.sendall(post_head("/v1/completions", body) + body)
    decode = next(w for w in worker_components(cluster) if w.name.startswith("decode"))
    deadline = time.monotonic() + 10
    while worker_stats(decode.address, "decode").num_running == 0:  # it is generating
        assert time.monotonic() < deadline
        time.sleep(0.02)
    s.close()
    wait_idle(cluster, timeout_s=5.0)
    deadline = time.monotonic() + 5  # the router counts the request once its stream has unwound
    while ended("CANCELLED") == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (ended("CANCELLED"), ended("OK")) == (cancelled + 1, completed)  # aborted, not run to its end


# --- the internal plane ------------------------------------------------------------------------------------

def test_internal_calls_without_the_cluster_secret_are_refused_and_take_nothing(cluster):
    from cluster import grpc_plumbing
    from duet.internal.v1 import workers_pb2 as wpb
    from duet.internal.v1 import workers_pb2_grpc as wpb_grpc

    prefill, decode = (next(w for w in worker_components(cluster) if w.name.startswith(role))
                       for role in ("prefill", "decode"))
    before = worker_stats(decode.address, "decode")

    def calls(d: wpb_grpc.DecodeWorkerStub, p: wpb_grpc.PrefillWorkerStub):
        return [lambda: d.Reserve(wpb.ReserveRequest(request_id="x", prompt_token_ids=[1, 2, 3]), timeout=10),
                lambda: d.Release(wpb.ReleaseRequest(request_id="x"), timeout=10),
                lambda: list(d.Decode(wpb.DecodeRequest(reservation_id=1, first_token_id=1), timeout=10)),
                lambda: d.Stats(wpb.StatsRequest(), timeout=10),
                lambda: p.Prefill(wpb.PrefillRequest(request_id="x", prompt_token_ids=[1, 2, 3]), timeout=10)]

    for secret in (None, b"not-the-cluster-secret"):
        with grpc_plumbing.channel(decode.address, cluster_secret=secret) as dch, \
                grpc_plumbing.channel(prefill.address, cluster_secret=secret) as pch:
            for call in calls(wpb_grpc.DecodeWorkerStub(dch), wpb_grpc.PrefillWorkerStub(pch)):
                err = rpc_error(call)
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
    after = worker_stats(decode.address, "decode")
    assert (after.num_free_blocks, after.num_reservations) == (before.num_free_blocks, 0) == (DECODE_BLOCKS, 0)
    assert all(grpc_plumbing.health_check(w.address) for w in (prefill, decode))  # probes stay open


def test_a_registry_entry_written_without_the_secret_gets_no_traffic(cluster, client):
    import dataclasses

    import redis

    from cluster.cluster_secret import load_cluster_secret
    from cluster.registry import WorkerRegistry

    signed = WorkerRegistry.from_url(cluster.redis_url, cluster_secret=load_cluster_secret())
    (model_id,) = signed.list_models()
    real = signed.list_workers(model_id, "prefill")[0]
    forger = WorkerRegistry(redis.Redis.from_url(cluster.redis_url))  # Redis access, but not the cluster secret
    forged = dataclasses.replace(real.info, worker_id="prefill-forged", address="127.0.0.1:9")
    forger.register(forged, dataclasses.replace(real.load, num_waiting=0, num_running=0))
    try:
        assert "prefill-forged" in [w.worker_id for w in forger.list_workers(model_id, "prefill")]
        assert [w.worker_id for w in signed.list_workers(model_id, "prefill")] == [real.worker_id]
        prompt = [9, 8, 7, 6] * 20
        for _ in range(4):
            assert [e.worker_id for e in client.explain_route(prompt).prefill] == [real.worker_id]
            record = run(client, prompt, SamplingParams(max_tokens=2, temperature=0))
            assert record["finish_reason"] == "length"
        # the router logs the refusal when its worker list next refreshes (it may not have yet: poll)
        deadline = time.monotonic() + 10
        while "prefill-forged: its signature does not verify" not in router_log(cluster):
            assert time.monotonic() < deadline, router_log(cluster)
            time.sleep(0.1)
        assert "ignoring duet:" in router_log(cluster)
    finally:
        forger.deregister(forged)


def test_the_clusters_redis_requires_a_password_and_takes_an_acl_user(cluster):
    from urllib.parse import urlsplit

    import redis

    from cluster.cluster_secret import load_cluster_secret
    from cluster.registry import WorkerRegistry

    url = urlsplit(cluster.redis_url)
    assert url.password and url.hostname == "127.0.0.1"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=url.hostname, port=url.port).ping()
    admin = redis.Redis.from_url(cluster.redis_url)
    admin.acl_setuser("duet-reader", enabled=True, passwords=["+reader-pw"], keys=["duet*", "{duet*"],
                      commands=["+@read", "+@write", "+@connection"])
    user_url = f"redis://duet-reader:reader-pw@{url.hostname}:{url.port}/0"
    as_user = WorkerRegistry.from_url(user_url, cluster_secret=load_cluster_secret())
    (model_id,) = as_user.list_models()
    assert sorted(w.info.role for w in as_user.list_workers(model_id)) == ["decode", "prefill"]


def test_a_worker_error_marked_as_the_requests_own_is_internal_and_blames_no_worker():
    """A real gRPC server on loopback answers the way a worker does when one request's sampling failed
    (worker/process.abort_with(..., fault=REQUEST_FAULT)); the router's mapping reads the real error."""
    from concurrent import futures

    from cluster import grpc_plumbing
    from router.request_stream import downstream_code
    from worker.process import abort_with

    def handler(request, context):
        abort_with(context, grpc.StatusCode.INTERNAL, "request r1 failed: sampling failed",
                   fault=grpc_plumbing.REQUEST_FAULT)

    def plain(request, context):
        context.abort(grpc.StatusCode.INTERNAL, "the engine thread died")

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {
        "Fault": grpc.unary_unary_rpc_method_handler(handler), "Plain": grpc.unary_unary_rpc_method_handler(plain)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            fault = rpc_error(lambda: ch.unary_unary("/t.T/Fault")(b"", timeout=10))
            plain_error = rpc_error(lambda: ch.unary_unary("/t.T/Plain")(b"", timeout=10))
    finally:
        server.stop(0)
    assert grpc_plumbing.is_request_fault(fault) and not grpc_plumbing.is_request_fault(plain_error)
    assert downstream_code(fault) == grpc.StatusCode.INTERNAL  # the request's own: retrying will not help
    assert downstream_code(plain_error) == grpc.StatusCode.UNAVAILABLE  # the worker's: another may serve it
