"""Issue 16: Redis SIGKILLed under load and restarted by `duet up`'s supervisor (LocalCluster.wait) loses no
request: streams in flight go on, requests sent while Redis is away or empty are routed to the workers the
router last saw, and the workers re-register in the new Redis. Real redis-server, router and workers."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from cluster_helpers import supervised, wait_idle

from cluster.cluster_secret import load_cluster_secret
from cluster.registry import WorkerRegistry
from deploy.local_cluster import ClusterConfig
from duet.client import Client
from engine import LLM, SamplingParams

ENGINE_ARGS = ["--num-kv-blocks", "200", "--max-model-len", "1024", "--max-num-batched-tokens", "64"]


@pytest.fixture
def supervised_cluster(tiny_llama_dir):
    config = ClusterConfig(model_dir=str(tiny_llama_dir), num_prefill=1, num_decode=2, worker_args=ENGINE_ARGS,
                           router_args=["--max-model-len", "1024"])
    with supervised(config) as (cluster, printed):
        yield cluster, printed


def test_redis_killed_under_load_is_restarted_and_no_request_is_lost(supervised_cluster, tiny_llama_dir):
    cluster, printed = supervised_cluster
    streams = [([7 + i, 40, 301, 12 + i] * (10 + i), SamplingParams(
        max_tokens=160, ignore_eos=True, **(dict(temperature=0) if i % 2 else dict(temperature=0.8, seed=i))))
        for i in range(4)]
    short = ([9, 8, 7, 6, 5, 4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    offline = LLM(tiny_llama_dir, num_kv_blocks=200, max_model_len=1024)
    expected = [o.outputs[0].token_ids for o in offline.generate([p for p, _ in streams] + [short[0]],
                                                      [s for _, s in streams] + [short[1]])]

    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    started = threading.Barrier(len(streams) + 1)
    redis_back = threading.Event()

    def stream(i: int) -> None:
        try:
            with Client(cluster.router_address) as client:
                tokens: list[int] = []
                for message in client.generate(*streams[i], timeout_s=120):
                    if not tokens:
                        started.wait(60)
                    tokens += message.token_ids
                results[i] = tokens
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    short_results: list[list[int]] = []

    def keep_sending() -> None:  # new requests while Redis is away, empty, and back
        try:
            with Client(cluster.router_address) as client:
                while not redis_back.is_set() or len(short_results) < 3:
                    short_results.append([t for m in client.generate(*short, timeout_s=60) for t in m.token_ids])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    started.wait(60)
    redis = cluster.components[0]
    os.kill(redis.pid, signal.SIGKILL)
    sender = threading.Thread(target=keep_sending)
    sender.start()
    deadline = time.monotonic() + 30
    while not any(line.startswith("duet: redis restarted") for line in printed):
        assert time.monotonic() < deadline, printed
        time.sleep(0.05)
    redis_back.set()
    for t in [*threads, sender]:
        t.join(120)
    assert not errors, errors
    assert [results[i] for i in range(len(streams))] == expected[:-1]
    assert short_results and all(r == expected[-1] for r in short_results)
    assert printed[0].startswith("duet: component redis was killed by SIGKILL")
    assert printed[0].splitlines()[-1] == "duet: restarting redis in 1 s (restart 1 within 300 s)"

    # every worker is back in the new Redis, and none holds anything
    registry = WorkerRegistry.from_url(cluster.redis_url, cluster_secret=load_cluster_secret())
    deadline = time.monotonic() + 15
    while len(registry.list_workers(Path(tiny_llama_dir).name)) < 3:
        assert time.monotonic() < deadline, "the workers did not re-register"
        time.sleep(0.1)
    wait_idle(cluster)


def test_the_router_keeps_the_workers_it_saw_while_they_re_register_in_a_restarted_redis(monkeypatch):
    """The view behind routing, on a real redis-server restarted empty: the workers seen before stay routable
    for REJOIN_GRACE_S (here shortened) while only some have re-registered; after it, only those listed."""
    from cluster.prefix_index import PrefixIndex
    from cluster.registry import WorkerInfo, WorkerLoad
    from deploy.redis_server import RedisServer
    from router import worker_view
    from router.metrics import RouterMetrics

    monkeypatch.setattr(worker_view, "REJOIN_GRACE_S", 1.5)
    infos = [WorkerInfo(f"{role}-{n}", role, f"127.0.0.1:{6000 + n}", "m", block_size=16, num_kv_blocks=64)
             for n, role in enumerate(["prefill", "decode", "decode"])]

    def seen(view) -> list[str]:
        time.sleep(worker_view.REGISTRY_CACHE_S + 0.05)
        prefills, decodes = view.workers()
        return sorted(w.worker_id for w in prefills + decodes)

    with RedisServer(password="pw") as server:
        registry = WorkerRegistry.from_url(server.url)
        for info in infos:
            registry.register(info, WorkerLoad())
        view = worker_view.WorkerView(registry, PrefixIndex(registry.client, "m"), "m", RouterMetrics("m"))
        assert seen(view) == ["decode-1", "decode-2", "prefill-0"]

        os.kill(server.pid, signal.SIGKILL)
        while server.returncode() is None:
            time.sleep(0.01)
        server.restart()
        registry.register(infos[1], WorkerLoad(num_running=3))  # one worker is back so far
        assert seen(view) == ["decode-1", "decode-2", "prefill-0"]  # the others are kept while they rejoin
        time.sleep(1.5)
        with pytest.raises(worker_view.NoWorkers, match="no prefill worker is up"):
            seen(view)  # past the grace: the registry's word again
        registry.register(infos[0], WorkerLoad())
        assert seen(view) == ["decode-1", "prefill-0"]


def test_a_worker_registered_again_at_its_address_under_a_new_id_counts_as_a_restart():
    from cluster.prefix_index import PrefixIndex
    from cluster.registry import WorkerInfo, WorkerLoad
    from deploy.redis_server import RedisServer
    from router import worker_view
    from router.metrics import RouterMetrics

    def restarts(metrics: RouterMetrics) -> dict[str, float]:
        return {s.labels["role"]: s.value for s in metrics.worker_restarts.collect()[0].samples
                if s.name.endswith("_total")}

    with RedisServer() as server:
        registry = WorkerRegistry.from_url(server.url)
        metrics = RouterMetrics("m")
        view = worker_view.WorkerView(registry, PrefixIndex(registry.client, "m"), "m", metrics)
        first = [WorkerInfo("prefill-a", "prefill", "127.0.0.1:7001", "m", block_size=16, num_kv_blocks=64),
                 WorkerInfo("decode-a", "decode", "127.0.0.1:7002", "m", block_size=16, num_kv_blocks=64)]
        for info in first:
            registry.register(info, WorkerLoad())
        view.workers()
        time.sleep(worker_view.REGISTRY_CACHE_S + 0.05)
        view.workers()  # the same ids again: nothing restarted
        assert restarts(metrics) == {}
        registry.deregister(first[1])
        registry.register(WorkerInfo("decode-b", "decode", "127.0.0.1:7002", "m", block_size=16, num_kv_blocks=64),
                          WorkerLoad())  # the decode worker's next process, on its port
        time.sleep(worker_view.REGISTRY_CACHE_S + 0.05)
        view.workers()
        assert restarts(metrics) == {"decode": 1.0}
