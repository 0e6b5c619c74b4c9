"""Issue 16: a storm of cancels and deadlines leaves nothing behind. Dozens of concurrent streams on a real
cluster (redis-server, router, 1 prefill + 2 decode workers as processes, tiny model) end at points a seeded
RNG picks: the client cancels after k messages (k = 0: while the router reserves or prefills), a 10-50 ms
deadline, a deadline that expires mid-stream, the router's Abort after k messages, an OpenAI HTTP stream
closed after k chunks or given a 10-50 ms timeout; a few run to the end beside them, over both APIs.

Each stream ends with exactly the status its ending implies and, whatever it received, a prefix of the tokens
of an undisturbed run. Afterwards every worker holds zero blocks and zero reservations and passes its
integrity check, no worker was blamed (a client's cancel or deadline is never a worker's fault) or restarted,
and a normal request still gets exactly the undisturbed tokens."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from cluster_helpers import wait_idle, worker_components
from prometheus_client.parser import text_string_to_metric_families

from deploy.local_cluster import ClusterConfig, LocalCluster
from duet.client import Client, stream_to_record
from engine import LLM, SamplingParams
from engine.ports import pick_free_ports

SEED = 16
NUM_REQUESTS = 48  # 6 of each kind
MAX_MODEL_LEN = 4096
MID_DEADLINE_MAX_TOKENS = 4000  # seconds of decoding on the tiny model: its deadline (0.1-0.6 s) comes first
# Enough KV for every stream at once (42 of them hold at most 64 prompt + 300 output tokens, 23 blocks; the 6
# mid-stream deadlines end well before 1000 tokens; 2 decode workers): the storm never meets a full worker, so
# every status below is the request's own ending, never RESOURCE_EXHAUSTED.
ENGINE_ARGS = ["--num-kv-blocks", "1024", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "64"]
KINDS = ("grpc_cancel", "grpc_tiny_deadline", "grpc_mid_deadline", "grpc_abort", "grpc_complete",
         "http_cancel", "http_tiny_deadline", "http_complete")


@dataclass(frozen=True)
class StormRequest:
    """One stream of the storm and where it is made to end."""

    request_id: str
    kind: str  # one of KINDS
    prompt: list[int]
    params: SamplingParams
    start_delay_s: float  # after the storm starts: the endings land on every stage of other requests
    stop_after_messages: int = 0  # cancel / Abort / close after this many messages (0: before the first)
    cancel_delay_s: float = 0.0  # grpc_cancel with stop_after_messages 0: how long after the call starts
    timeout_s: float | None = None  # the request's deadline


@dataclass
class StormOutcome:
    status: str  # a gRPC status name; HTTP: "OK", "CLOSED" (we closed it), or the error's code
    token_ids: list[int] = field(default_factory=list)  # gRPC only: HTTP streams carry text
    text: str = ""
    messages: int = 0
    finish_reason: str | None = None
    abort_found: bool | None = None  # grpc_abort: what the router's Abort answered


def storm_requests() -> list[StormRequest]:
    rng = random.Random(SEED)
    out = []
    for i in range(NUM_REQUESTS):
        kind = KINDS[i % len(KINDS)]
        # greedy and seeded alternate: both must continue (or stop) on exactly the undisturbed tokens
        sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.9, top_p=0.95, seed=1000 + i)
        long = kind == "grpc_mid_deadline"
        max_tokens = rng.randint(8, 32) if kind.endswith("complete") else MID_DEADLINE_MAX_TOKENS if long else 300
        prompt = [rng.randrange(4, 512) for _ in range(rng.randint(4, 64))]
        common = dict(request_id=f"storm-{i}-{kind}", kind=kind, prompt=prompt,
                      params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
                      start_delay_s=rng.uniform(0.0, 1.5))
        if kind == "grpc_cancel":  # k = 0..5 in turn: k = 0 lands while the router reserves or prefills
            k = i // len(KINDS) % 6
            out.append(StormRequest(**common, stop_after_messages=k, cancel_delay_s=rng.uniform(0.0, 0.03)))
        elif kind in ("grpc_abort", "http_cancel"):
            out.append(StormRequest(**common, stop_after_messages=rng.randint(1, 5)))
        elif kind.endswith("tiny_deadline"):
            out.append(StormRequest(**common, timeout_s=rng.uniform(0.01, 0.05)))
        elif long:
            out.append(StormRequest(**common, timeout_s=rng.uniform(0.1, 0.6)))
        else:
            out.append(StormRequest(**common))
    return out


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    (http_port,) = pick_free_ports(1)
    config = ClusterConfig(model_dir=str(tiny_llama_dir), num_prefill=1, num_decode=2, worker_args=ENGINE_ARGS,
                           router_args=["--max-model-len", str(MAX_MODEL_LEN), "--http-port", str(http_port)])
    with LocalCluster(config).start() as c:
        c.http_base = f"http://127.0.0.1:{http_port}"
        yield c


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(tiny_llama_dir, num_kv_blocks=1024, max_model_len=MAX_MODEL_LEN)


def run_grpc(client: Client, req: StormRequest) -> StormOutcome:
    call = client.generate(req.prompt, req.params, request_id=req.request_id, timeout_s=req.timeout_s)
    out = StormOutcome("OK")
    if req.kind == "grpc_cancel" and req.stop_after_messages == 0:
        time.sleep(req.cancel_delay_s)
        call.cancel()
    try:
        for message in call:
            out.messages += 1
            out.token_ids += message.token_ids
            out.finish_reason = message.finish_reason or None
            if out.messages == req.stop_after_messages:
                if req.kind == "grpc_cancel":
                    call.cancel()
                elif req.kind == "grpc_abort":
                    out.abort_found = client.abort(req.request_id)
    except grpc.RpcError as e:
        out.status = e.code().name
    return out


def run_http(http: openai.OpenAI, model: str, req: StormRequest) -> StormOutcome:
    p = req.params
    extra = {"ignore_eos": True, "request_id": req.request_id}
    if req.timeout_s is not None:
        extra["timeout"] = req.timeout_s  # duet's field: the request's deadline on the router
    out = StormOutcome("OK")
    try:
        stream = http.completions.create(model=model, prompt=req.prompt, max_tokens=p.max_tokens,
                                         temperature=p.temperature, top_p=p.top_p, seed=p.seed, stream=True,
                                         extra_body=extra)
        for chunk in stream:
            out.messages += 1
            out.text += chunk.choices[0].text
            out.finish_reason = chunk.choices[0].finish_reason
            if req.kind == "http_cancel" and out.messages == req.stop_after_messages:
                stream.close()  # the connection goes: the router must cancel the request on every worker
                out.status = "CLOSED"
                break
    except openai.APIStatusError as e:  # an error before the first chunk: the HTTP status says which
        out.status = {504: "DEADLINE_EXCEEDED"}.get(e.status_code, f"HTTP {e.status_code}")
    except openai.APIError as e:  # an `error` event after some chunks: its code is the gRPC status name
        out.status = e.body.get("code", "?") if isinstance(e.body, dict) else f"APIError {e.message}"
    return out


def run_storm(cluster, requests: list[StormRequest]) -> dict[str, StormOutcome]:
    outcomes: dict[str, StormOutcome] = {}
    errors: list[BaseException] = []
    start = threading.Event()
    http = openai.OpenAI(base_url=cluster.http_base + "/v1", api_key="none", max_retries=0, timeout=60)
    model = http.models.list().data[0].id  # the served id: any other name is a 404

    with Client(cluster.router_address) as client:
        def one(req: StormRequest) -> None:
            start.wait()
            time.sleep(req.start_delay_s)
            try:
                outcomes[req.request_id] = (run_http(http, model, req) if req.kind.startswith("http")
                                            else run_grpc(client, req))
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

        threads = [threading.Thread(target=one, args=(r,)) for r in requests]
        for t in threads:
            t.start()
        start.set()
        for t in threads:
            t.join(60)
    http.close()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a storm stream hung"
    return outcomes


def undisturbed(offline: LLM, reqs: list[StormRequest], lengths: list[int]) -> list[list[int]]:
    """The first `lengths[i]` tokens an undisturbed run gives request i (ignore_eos: a shorter max_tokens
    changes nothing before it, so only what the storm received is computed)."""
    params = [dataclasses.replace(r.params, max_tokens=n) for r, n in zip(reqs, lengths)]
    return [o.outputs[0].token_ids for o in offline.generate([r.prompt for r in reqs], params)]


def router_counters(cluster, name: str) -> dict[str, float]:
    text = httpx.get(cluster.http_base + "/metrics", timeout=10).text
    return {next(v for k, v in s.labels.items() if k != "model_name"): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == name}


def test_a_storm_of_cancels_and_deadlines_leaves_every_worker_idle_and_intact(cluster, offline):
    pids = {c.name: c.pid for c in worker_components(cluster)}
    requests = storm_requests()
    outcomes = run_storm(cluster, requests)

    # every stream ended exactly as its ending implies
    for req in requests:
        out = outcomes[req.request_id]
        where = f"{req.request_id}: {out}"
        if req.kind == "grpc_cancel":
            assert out.status == "CANCELLED" and out.messages == req.stop_after_messages, where
        elif req.kind in ("grpc_tiny_deadline", "grpc_mid_deadline", "http_tiny_deadline"):
            assert out.status == "DEADLINE_EXCEEDED", where
        elif req.kind == "grpc_abort":
            assert out.abort_found is True and out.status == "OK" and out.finish_reason == "abort", where
            assert out.messages > req.stop_after_messages, where  # the abort's own last message came
        elif req.kind == "http_cancel":
            assert out.status == "CLOSED" and out.messages == req.stop_after_messages, where
        else:
            assert out.status == "OK" and out.finish_reason == "length", where
    # the mid-stream deadlines are meant to land after tokens went out: the storm did hit that stage
    mid = [outcomes[r.request_id] for r in requests if r.kind == "grpc_mid_deadline"]
    assert any(o.token_ids for o in mid), mid

    # whatever a gRPC stream received is a prefix of its undisturbed tokens (a run to the end: all of them)
    grpc_reqs = [r for r in requests if r.kind.startswith("grpc") and outcomes[r.request_id].token_ids]
    expected = undisturbed(offline, grpc_reqs, [len(outcomes[r.request_id].token_ids) for r in grpc_reqs])
    for req, tokens in zip(grpc_reqs, expected):
        assert outcomes[req.request_id].token_ids == tokens, req.request_id
    for req in requests:
        if req.kind == "grpc_complete":
            assert len(outcomes[req.request_id].token_ids) == req.params.max_tokens, req.request_id
    http_done = [r for r in requests if r.kind == "http_complete"]
    for req, ref in zip(http_done, offline.generate([r.prompt for r in http_done], [r.params for r in http_done])):
        assert outcomes[req.request_id].text == ref.outputs[0].text, req.request_id

    # nothing is left behind: zero blocks in use, zero reservations, integrity intact, on every worker
    stats = wait_idle(cluster, timeout_s=20.0)
    assert sorted(stats) == sorted(pids)
    assert {c.name: c.pid for c in worker_components(cluster)} == pids and cluster.poll() is None
    # a client's cancel or deadline is never the worker's fault: none was avoided, nothing migrated
    statuses = router_counters(cluster, "duet_router_requests_total")
    assert set(statuses) <= {"OK", "CANCELLED", "DEADLINE_EXCEEDED"}, statuses
    assert router_counters(cluster, "duet_router_migrations_total") == {}
    router_log = Path(next(c for c in cluster.components if c.name == "router").log_path).read_text()
    assert "event=suspect" not in router_log and "event=migrating" not in router_log

    # and the cluster serves on, exactly
    prompt = [7, 19, 250, 3 + SEED, 88] * 3
    for params in (SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)):
        with Client(cluster.router_address) as client:
            record = stream_to_record(client.generate(prompt, params, timeout_s=60))
        assert record["token_ids"] == offline.generate([prompt], params)[0].outputs[0].token_ids
    wait_idle(cluster, timeout_s=10.0)
