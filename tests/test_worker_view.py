"""router/worker_view.py: a worker's reported load corrected by what this router started and ended there since
the report, on a real redis-server (the report's age is Redis's)."""

from __future__ import annotations

import time

from cluster.prefix_index import PrefixIndex
from cluster.registry import WorkerInfo, WorkerLoad, WorkerRegistry
from deploy.redis_server import RedisServer
from router import worker_view
from router.load_policy import Candidate
from router.metrics import RouterMetrics

GAP_S = 0.05  # between a request's start or end and a heartbeat: Redis ages reports in milliseconds


def test_num_requests_is_the_report_plus_starts_minus_ends_since_and_at_least_the_routers_own():
    assert Candidate("w", num_waiting=1, num_running=2, num_free_blocks=9, num_waiting_tokens=0,
                     inflight=1, since_report=-1).num_requests() == 2
    assert Candidate("w", 0, 1, 9, 0, inflight=0, since_report=-1).num_requests() == 0
    assert Candidate("w", 0, 0, 9, 0, inflight=2, since_report=1).num_requests() == 2  # a report before both


def test_a_request_that_ended_after_the_report_no_longer_counts():
    with RedisServer() as server:
        registry = WorkerRegistry.from_url(server.url)
        view = worker_view.WorkerView(registry, PrefixIndex(registry.client, "m"), "m", RouterMetrics("m"))
        registry.register(WorkerInfo("prefill-a", "prefill", "127.0.0.1:7001", "m", block_size=16, num_kv_blocks=64),
                          WorkerLoad())  # the view needs a worker of each role
        info = WorkerInfo("decode-a", "decode", "127.0.0.1:7002", "m", block_size=16, num_kv_blocks=64)

        def num_requests() -> int:
            time.sleep(worker_view.REGISTRY_CACHE_S + GAP_S)  # the view lists the registry again
            _, decodes = view.workers()
            [candidate] = view.candidates(decodes)
            return candidate.num_requests()

        view.track_requests("decode-a", +1)  # a chat turn starts
        time.sleep(GAP_S)
        registry.heartbeat(info, WorkerLoad(num_running=1))  # the worker reports it running
        time.sleep(GAP_S)
        assert num_requests() == 1
        view.track_requests("decode-a", -1)  # it ends: the report still says running
        assert num_requests() == 0  # was 1 (report) + 0 (in flight), which sent the next turn elsewhere
        view.track_requests("decode-a", +1)  # the next turn starts before the next heartbeat
        assert num_requests() == 1
        registry.heartbeat(info, WorkerLoad(num_running=1))
        time.sleep(GAP_S)
        view.track_requests("decode-a", -1)
        registry.heartbeat(info, WorkerLoad(num_running=0))  # a report after the end: nothing to correct
        assert num_requests() == 0
        registry.heartbeat(info, WorkerLoad(num_running=2))  # another router's requests: counted as reported
        assert num_requests() == 2
