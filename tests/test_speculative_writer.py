"""The routing decision's Redis cost, and the speculative writer that keeps its second write off the request's
path. Real redis-server; round trips are counted at the connection, per thread."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from cluster.prefix_index import PrefixIndex
from cluster.registry import LiveWorker, WorkerInfo, WorkerLoad
from deploy.redis_server import RedisServer
from engine.hashing import hash_blocks, root_hash
from router.metrics import RouterMetrics
from router.prefill_chooser import PrefillChooser
from router.speculative_writer import SpeculativeWriter

MODEL = "tiny"
BLOCK = 16


class CountingConnection(redis.Connection):
    """A real connection that records which thread sent each request (a pipeline or script call is one)."""

    sent: list[str] = []
    lock = threading.Lock()

    def send_packed_command(self, command, check_health: bool = True) -> None:
        with CountingConnection.lock:
            CountingConnection.sent.append(threading.current_thread().name)
        super().send_packed_command(command, check_health)


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def counted(redis_server):
    pool = redis.ConnectionPool.from_url(redis_server.url, connection_class=CountingConnection)
    client = redis.Redis(connection_pool=pool)
    client.flushall()
    CountingConnection.sent.clear()
    yield client
    client.close()


def live(worker_id: str) -> LiveWorker:
    info = WorkerInfo(worker_id=worker_id, address=f"127.0.0.1:{len(worker_id)}", role="prefill", model_id=MODEL,
                      block_size=BLOCK, num_kv_blocks=64)
    return LiveWorker(info, WorkerLoad(), 0.0)


def test_a_routing_decision_costs_one_redis_round_trip(counted):
    index = PrefixIndex(counted, MODEL)
    metrics = RouterMetrics(MODEL)
    writer = SpeculativeWriter(index)
    chooser = PrefillChooser(index, MODEL, metrics, writer)
    workers = [live("prefill-a"), live("prefill-b")]
    prompt = list(range(2, 2 + 4 * BLOCK))
    try:
        first = chooser.choose(prompt, "", workers, {})  # loads the lookup script into Redis once
        assert writer.flush(5.0)
        CountingConnection.sent.clear()

        again = chooser.choose(prompt, "", workers, {})
        on_request_path = [t for t in CountingConnection.sent if t == threading.current_thread().name]
        assert len(on_request_path) == 1  # the lookup; the speculative write is the writer thread's
        assert writer.flush(5.0)
        assert CountingConnection.sent.count("speculative-writer") == 1
        # the first choice's speculative entry made the second a prefix hit on the same worker
        assert again.worker.worker_id == first.worker.worker_id and again.decision.branch == "prefix"
        assert again.predicted_cached_tokens == 4 * BLOCK
        hashes = hash_blocks(prompt, BLOCK, root_hash(MODEL, ""))
        assert index.lookup(hashes) == {first.worker.worker_id: 4}
        assert writer.num_written == 2 and writer.num_dropped == 0 and writer.num_failed == 0
    finally:
        writer.close()


def test_explain_writes_nothing(counted):
    index = PrefixIndex(counted, MODEL)
    writer = SpeculativeWriter(index)
    chooser = PrefillChooser(index, MODEL, RouterMetrics(MODEL), writer)
    prompt = list(range(2, 2 + 2 * BLOCK))
    try:
        chooser.choose(prompt, "", [live("prefill-a")], {}, speculate=False)
        assert writer.flush(5.0) and writer.num_written == 0
        assert index.lookup(hash_blocks(prompt, BLOCK, root_hash(MODEL, ""))) == {}
    finally:
        writer.close()


class BlockedIndex(PrefixIndex):
    """A real index whose speculative writes wait until released: a Redis that is slow to answer."""

    def __init__(self, client: redis.Redis, model_id: str):
        super().__init__(client, model_id)
        self.go = threading.Event()
        self.entered = threading.Event()

    def add_speculative(self, worker_id: str, block_hashes) -> None:
        self.entered.set()
        self.go.wait(10)
        super().add_speculative(worker_id, block_hashes)


def test_a_full_queue_drops_instead_of_blocking(counted):
    index = BlockedIndex(counted, MODEL)
    metrics = RouterMetrics(MODEL)
    writer = SpeculativeWriter(index, max_pending=2, on_drop=metrics.speculative_dropped.inc)
    try:
        assert writer.submit("w", [1])
        assert index.entered.wait(5)  # the thread holds the first entry, waiting on "Redis"
        started_s = time.monotonic()
        accepted = [writer.submit("w", [i + 2]) for i in range(3)]
        assert time.monotonic() - started_s < 0.5  # never blocks the caller
        assert accepted == [True, True, False]  # two fill the queue, the third is dropped
        assert not writer.flush(0.2)  # still blocked
        assert writer.num_dropped == 1 and metrics.speculative_dropped._value.get() == 1
        index.go.set()
        assert writer.flush(5.0)
        assert writer.num_written == 3 and writer.num_failed == 0
    finally:
        index.go.set()
        writer.close()


def test_redis_down_is_logged_not_raised(caplog):
    client = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)  # nothing listens on port 1
    writer = SpeculativeWriter(PrefixIndex(client, MODEL))
    try:
        with caplog.at_level("INFO", logger="duet.router"):
            assert writer.submit("w", [1, 2])
            assert writer.flush(5.0)
        assert writer.num_failed == 1 and writer.num_written == 0
        assert any("event=speculative_failed worker=w" in r.getMessage() for r in caplog.records)
        assert writer.submit("w", [3])  # the thread lives on
        assert writer.flush(5.0) and writer.num_failed == 2
    finally:
        writer.close()


def test_the_queue_estimate_counts_the_routers_inflight_work_once(counted):
    """A worker's load report already counts this router's in-flight prefills: the queue estimate is the larger
    of the two (the report drained at the worker's speed for its age), not their sum (prefix_policy's
    `work_ahead_tokens`, as admission's). Real index, nothing cached: the choice is by queued work alone."""
    index = PrefixIndex(counted, MODEL)
    writer = SpeculativeWriter(index)
    chooser = PrefillChooser(index, MODEL, RouterMetrics(MODEL), writer)
    a, b = live("prefill-a"), live("prefill-b")
    reported = LiveWorker(a.info, WorkerLoad(num_waiting_tokens=1_000, prefill_tokens_per_s=10_000.0), 0.05)
    other = LiveWorker(b.info, WorkerLoad(prefill_tokens_per_s=10_000.0), 0.0)
    try:
        choice = chooser.choose(list(range(2, 2 + BLOCK)), "", [reported, other], {"prefill-a": 300, "prefill-b": 600},
                                speculate=False)
        queued = {e.worker_id: e.queued_tokens for e in choice.decision.estimates}
        assert queued == {"prefill-a": 500, "prefill-b": 600}  # a: 1000 reported - 0.05 s x 10k/s; b: its in-flight
        assert choice.worker.worker_id == "prefill-a"
    finally:
        writer.close()
