"""Issue 16: a hand-off that breaks between its stages costs the request a pause, never an error, and the
failure is blamed on the component that failed. Real redis-server and worker processes; the router runs in
this process so that a failure can be caused at an exact stage (a decode worker SIGKILLed right after it
reserved, its reservation dropped before Decode), the way a crash or a restart would cause it."""

from __future__ import annotations

import os
import signal
import time

import pytest
from cluster_helpers import alive, wait_idle

from deploy.local_cluster import ClusterConfig, LocalCluster
from duet.client import Client
from engine import LLM, SamplingParams
from router.orchestrator import RequestOrchestrator
from router.server import RouterConfig, RouterServer

ENGINE_ARGS = ["--num-kv-blocks", "200", "--max-model-len", "1024", "--max-num-batched-tokens", "64"]
PROMPT = [5, 77, 301, 12, 9, 44] * 40  # 240 tokens: 4 prefill chunks of 64, so the KV goes over in pieces
PARAMS = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    # four decode workers: two tests kill one each, one stops one, and a request needs one left
    config = ClusterConfig(model_dir=str(tiny_llama_dir), num_prefill=1, num_decode=4, worker_args=ENGINE_ARGS,
                           router_args=["--max-model-len", "1024"])
    with LocalCluster(config).start() as c:
        yield c


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    [out] = LLM(tiny_llama_dir, num_kv_blocks=200, max_model_len=1024).generate([PROMPT], PARAMS)
    return out.outputs[0].token_ids


@pytest.fixture
def router(cluster, tiny_llama_dir):
    server = RouterServer(RouterConfig(redis_url=cluster.redis_url, model_dir=tiny_llama_dir, max_model_len=1024))
    server.start()
    yield server
    server.stop()


def component_at(cluster, address: str):
    return next(c for c in cluster.components if c.address == address)


def migrations(router: RouterServer) -> dict[str, float]:
    return {s.labels["reason"]: s.value for s in router.router.metrics.migrations.collect()[0].samples
            if s.name.endswith("_total")}


def generate(router: RouterServer) -> list[int]:
    with Client(router.address) as client:
        return [t for message in client.generate(PROMPT, PARAMS, timeout_s=120) for t in message.token_ids]


def dead(cluster) -> tuple[str, ...]:
    return tuple(c.name for c in cluster.components if not alive(c.pid))


def kill(cluster, address: str) -> str:
    """SIGKILL the component at `address` and wait until it is gone; its name."""
    victim = component_at(cluster, address)
    os.kill(victim.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(victim.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return victim.name


def test_decode_worker_killed_after_reserving_is_blamed_and_the_request_goes_elsewhere(cluster, router, expected,
                                                                                       monkeypatch):
    """The reserved decode worker dies before the prefill worker sends it the prompt's KV (killed here at
    once, so the test does not hang on this machine's speed; dying mid-transfer takes the same path, a
    PeerGone in the sender): the prefill worker reports the decode side's failure, and the router marks that
    decode worker, not the prefill worker, suspect and hands the request off again."""
    orchestrator = router.router.orchestrator
    killed: list[tuple[str, str]] = []  # (worker id, component name)
    original_plan = RequestOrchestrator.plan

    def plan_then_kill(self, request, prefills, reservation, *args, **kwargs):
        plan = original_plan(self, request, prefills, reservation, *args, **kwargs)
        if not killed:
            killed.append((reservation.decode.worker_id, kill(cluster, reservation.decode.address)))
        return plan

    monkeypatch.setattr(orchestrator, "plan", plan_then_kill.__get__(orchestrator))
    assert generate(router) == expected
    ((victim_id, _),) = killed
    prefill_ids = {w.worker_id for w in orchestrator.view.workers()[0]}
    assert victim_id in orchestrator.view.active_suspects()
    assert not prefill_ids & set(orchestrator.view.active_suspects())  # the prefill worker did nothing wrong
    assert migrations(router) == {"kv_transfer": 1}
    wait_idle(cluster, skip=dead(cluster))


def test_decode_worker_lost_between_prefill_and_decode(cluster, router, expected, monkeypatch):
    """The first token went to the client, then the decode worker holding the KV dies before Decode: the
    request migrates (KV for the prompt rebuilt elsewhere) and the client gets exactly the undisturbed tokens."""
    orchestrator = router.router.orchestrator
    killed: list[str] = []
    original_decode = RequestOrchestrator.decode

    def kill_then_decode(self, plan, *args, **kwargs):
        if not killed:
            killed.append(kill(cluster, plan.decode.address))
        yield from original_decode(self, plan, *args, **kwargs)

    monkeypatch.setattr(orchestrator, "decode", kill_then_decode.__get__(orchestrator))
    assert generate(router) == expected
    assert migrations(router) == {"decode_lost": 1}
    wait_idle(cluster, skip=dead(cluster))


def test_reservation_gone_before_decode_as_after_a_restart_migrates_and_blames_no_one(cluster, router, expected,
                                                                                     monkeypatch):
    """A decode worker that restarted between Prefill and Decode no longer knows the reservation
    (FAILED_PRECONDITION): the request migrates, and the healthy worker is not avoided for it."""
    orchestrator = router.router.orchestrator
    dropped: list[str] = []
    original_decode = RequestOrchestrator.decode

    def drop_then_decode(self, plan, *args, **kwargs):
        if not dropped:
            dropped.append(plan.decode.worker_id)
            self.release(plan.reservation)  # what a restart does to the worker's reservations
        yield from original_decode(self, plan, *args, **kwargs)

    monkeypatch.setattr(orchestrator, "decode", drop_then_decode.__get__(orchestrator))
    assert generate(router) == expected
    assert migrations(router) == {"decode_lost": 1}
    assert dropped[0] not in orchestrator.view.active_suspects()
    wait_idle(cluster, skip=dead(cluster))


def test_a_decode_worker_that_stops_answering_mid_stream_is_left_and_frees_its_blocks_when_back(
        cluster, router, tiny_llama_dir, monkeypatch):
    """SIGSTOP (a hung process, a frozen VM): no error, no FIN, the stream just stops. The channel's keepalive
    (grpc_plumbing.KEEPALIVE_*) fails the call, the request migrates and ends with the undisturbed tokens;
    the stopped worker, resumed, finds its stream gone and frees every block."""
    prompt = [11, 23, 5, 300, 41] * 8
    params = SamplingParams(max_tokens=900, temperature=0.7, seed=3, ignore_eos=True)
    [expected] = LLM(tiny_llama_dir, num_kv_blocks=200, max_model_len=1024).generate([prompt], params)[0].outputs
    expected = expected.token_ids
    addresses = {w.worker_id: w.info.address for w in router.router.orchestrator.view.workers()[1]}
    stopped = []
    tokens: list[int] = []
    try:
        with Client(router.address) as client:
            for message in client.generate(prompt, params, timeout_s=120):
                if not stopped:
                    stopped.append(component_at(cluster, addresses[message.decode_worker]))
                    os.kill(stopped[0].pid, signal.SIGSTOP)
                tokens += message.token_ids
    finally:
        for c in stopped:
            os.kill(c.pid, signal.SIGCONT)
    assert tokens == expected
    assert migrations(router) == {"decode_lost": 1}
    wait_idle(cluster, skip=dead(cluster))
