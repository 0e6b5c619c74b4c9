"""cluster/registry.py against a real redis-server."""

import json
import logging
import time

import pytest
from redis.crc import key_slot

from cluster.registry import Heartbeat, WorkerInfo, WorkerLoad, WorkerRegistry
from deploy.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer(password="s3cret") as server:
        yield server


@pytest.fixture
def registry(redis_server):
    reg = WorkerRegistry.from_url(redis_server.url, ttl_s=6.0)
    reg.client.flushall()
    yield reg
    reg.client.close()


def _info(worker_id="prefill-0", role="prefill", model_id="tiny", port=5000, **kw) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{port}", model_id=model_id,
                      block_size=16, num_kv_blocks=512, **kw)


def _wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def test_register_then_list_returns_exact_fields(registry):
    info = WorkerInfo(worker_id="decode-ab12cd34", role="decode", address="10.0.0.7:6001", model_id="llama-3-8b",
                      block_size=32, num_kv_blocks=4096, tp_size=2, kv_address="10.0.0.7:7001", kv_layout="9f3a")
    load = WorkerLoad(num_waiting=3, num_running=5, num_free_blocks=100, num_waiting_tokens=777)
    registry.register(info, load)
    [live] = registry.list_workers("llama-3-8b")
    got_info, got_load, age_s = live.info, live.load, live.load_age_s
    assert got_info == info
    assert got_load == load
    assert 0.0 <= age_s < 0.5
    assert registry.list_models() == ["llama-3-8b"]


def test_stored_values_are_plain_json(registry):
    info = _info()
    registry.register(info, WorkerLoad(num_waiting=1))
    stored = registry.client.hgetall("duet:{tiny}:worker:prefill-0")
    assert set(stored) == {b"info", b"load", b"ttl_ms", b"reported_at"}
    assert json.loads(stored[b"info"]) == {
        "worker_id": "prefill-0", "role": "prefill", "address": "127.0.0.1:5000", "model_id": "tiny",
        "block_size": 16, "num_kv_blocks": 512, "tp_size": 1, "kv_address": "", "kv_layout": ""}
    assert json.loads(stored[b"load"]) == {"num_waiting": 1, "num_running": 0, "num_free_blocks": 0,
                                           "num_waiting_tokens": 0, "prefill_tokens_per_s": 0.0}
    assert stored[b"ttl_ms"] == b"6000"
    assert 5000 < registry.client.pttl("duet:{tiny}:worker:prefill-0") <= 6000


def test_roles_and_models_are_separated(registry):
    p0 = _info("prefill-0", "prefill", "m1", 1)
    p1 = _info("prefill-1", "prefill", "m1", 2)
    d0 = _info("decode-0", "decode", "m1", 3)
    other = _info("decode-9", "decode", "m2", 4)
    for info in (p1, d0, other, p0):
        registry.register(info, WorkerLoad())
    assert [w.info for w in registry.list_workers("m1")] == [d0, p0, p1]  # sorted by worker_id
    assert [w.info for w in registry.list_workers("m1", role="prefill")] == [p0, p1]
    assert [w.info for w in registry.list_workers("m1", role="decode")] == [d0]
    assert [w.info for w in registry.list_workers("m2")] == [other]
    assert registry.list_workers("m2", role="prefill") == []
    assert registry.list_workers("nope") == []
    assert registry.list_models() == ["m1", "m2"]


def test_keys_are_hash_tagged_by_model(registry):
    registry.register(_info("prefill-0", model_id="org/model-a"), WorkerLoad())
    registry.register(_info("decode-0", role="decode", model_id="org/model-a"), WorkerLoad())
    registry.register(_info("decode-1", role="decode", model_id="model-b"), WorkerLoad())
    keys = sorted(k.decode() for k in registry.client.keys("*"))
    assert keys == [
        "duet:models",
        "duet:{model-b}:worker:decode-1",
        "duet:{model-b}:workers",
        "duet:{org/model-a}:worker:decode-0",
        "duet:{org/model-a}:worker:prefill-0",
        "duet:{org/model-a}:workers",
    ]
    slots_a = {key_slot(k.encode()) for k in keys if "{org/model-a}" in k}
    assert slots_a == {key_slot(b"org/model-a")}
    assert {key_slot(k.encode()) for k in keys if "{model-b}" in k} == {key_slot(b"model-b")}


def test_ttl_expiry_removes_worker(redis_server):
    registry = WorkerRegistry.from_url(redis_server.url, ttl_s=1.0)
    registry.client.flushall()
    alive, dead = _info("prefill-alive"), _info("prefill-dead")
    registry.register(alive, WorkerLoad())
    registry.register(dead, WorkerLoad())
    time.sleep(0.6)
    registry.heartbeat(alive, WorkerLoad(num_running=1))
    time.sleep(0.6)  # dead expired 0.2 s ago, alive expires in 0.4 s
    assert [w.info for w in registry.list_workers("tiny")] == [alive]
    time.sleep(0.6)
    assert registry.list_workers("tiny") == []
    assert registry.list_models() == []


def test_heartbeat_updates_load_and_age(registry):
    info = _info()
    registry.register(info, WorkerLoad(num_waiting=1))
    time.sleep(0.3)
    [live] = registry.list_workers("tiny")
    load, age_s = live.load, live.load_age_s
    assert load == WorkerLoad(num_waiting=1)
    assert 0.25 <= age_s < 1.0
    registry.heartbeat(info, WorkerLoad(num_waiting=0, num_running=2, num_free_blocks=7, num_waiting_tokens=0))
    [live] = registry.list_workers("tiny")
    load, age_s = live.load, live.load_age_s
    assert load == WorkerLoad(num_running=2, num_free_blocks=7)
    assert age_s < 0.2


def test_heartbeat_recreates_expired_entry(redis_server):
    registry = WorkerRegistry.from_url(redis_server.url, ttl_s=0.2)
    registry.client.flushall()
    info = _info()
    registry.register(info, WorkerLoad())
    time.sleep(0.3)
    assert registry.list_workers("tiny") == []
    registry.heartbeat(info, WorkerLoad(num_running=4))
    assert [(w.info, w.load) for w in registry.list_workers("tiny")] == [(info, WorkerLoad(num_running=4))]


def test_deregister(registry):
    a, b = _info("prefill-a"), _info("prefill-b")
    registry.register(a, WorkerLoad())
    registry.register(b, WorkerLoad())
    registry.deregister(a)
    assert [w.info for w in registry.list_workers("tiny")] == [b]
    assert registry.client.zrange("duet:{tiny}:workers", 0, -1) == [b"prefill-b"]
    assert not registry.client.exists("duet:{tiny}:worker:prefill-a")
    registry.deregister(a)  # idempotent


def test_index_members_long_dead_are_pruned(registry):
    registry.register(_info("prefill-live"), WorkerLoad())
    registry.client.zadd("duet:{tiny}:workers", {"prefill-ghost": time.time() - 3600})
    assert [w.worker_id for w in registry.list_workers("tiny")] == ["prefill-live"]
    assert registry.client.zrange("duet:{tiny}:workers", 0, -1) == [b"prefill-live"]


def test_unreadable_entry_is_skipped(registry):
    registry.register(_info("prefill-good"), WorkerLoad())
    registry.register(_info("prefill-bad"), WorkerLoad())
    registry.client.hset("duet:{tiny}:worker:prefill-bad", "info", "not json")
    assert [w.worker_id for w in registry.list_workers("tiny")] == ["prefill-good"]


def test_unknown_json_fields_are_ignored(registry):
    registry.register(_info(), WorkerLoad())
    stored = json.loads(registry.client.hget("duet:{tiny}:worker:prefill-0", "info"))
    registry.client.hset("duet:{tiny}:worker:prefill-0", "info", json.dumps({**stored, "added_later": 1}))
    assert [w.info for w in registry.list_workers("tiny")] == [_info()]


def test_invalid_worker_info_is_rejected():
    with pytest.raises(ValueError, match=r"role='mixed' is invalid"):
        _info(role="mixed")
    with pytest.raises(ValueError, match=r"block_size=0 is invalid"):
        WorkerInfo("w", "decode", "h:1", "m", block_size=0, num_kv_blocks=1)
    with pytest.raises(ValueError, match=r"model_id is empty"):
        _info(model_id="")
    with pytest.raises(ValueError, match=r"num_waiting=-1 is invalid"):
        WorkerLoad(num_waiting=-1)


def test_heartbeat_thread_registers_reports_load_and_deregisters(registry):
    registry = WorkerRegistry(registry.client, ttl_s=0.6)
    loads = iter(WorkerLoad(num_waiting=n) for n in range(1000))
    hb = Heartbeat(registry, _info(), lambda: next(loads))
    assert hb.interval_s == pytest.approx(0.2)
    hb.start()
    assert hb.wait_registered(2.0)
    _wait_until(lambda: registry.list_workers("tiny")[0].load.num_waiting >= 2, 2.0, "two heartbeats")
    hb.stop()
    assert registry.list_workers("tiny") == []
    hb.stop()  # idempotent


def test_heartbeat_thread_survives_redis_restart(caplog):
    caplog.set_level(logging.INFO, logger="cluster.registry")
    server = RedisServer().start()
    port = server.port
    registry = WorkerRegistry.from_url(server.url, ttl_s=0.6, timeout_s=0.5)
    info = _info()
    hb = Heartbeat(registry, info, lambda: WorkerLoad(num_running=1))
    hb.start()
    try:
        assert hb.wait_registered(2.0)
        server.stop()
        time.sleep(1.0)  # several failed heartbeats
        server = RedisServer(port=port).start()  # same port, empty dataset
        _wait_until(lambda: [w.info for w in registry.list_workers("tiny")] == [info], 3.0, "re-registration")
    finally:
        hb.stop()
        server.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("Redis unreachable" in m for m in messages) == 1, messages
    assert sum("Redis reachable again" in m for m in messages) == 1, messages


def test_heartbeat_thread_keeps_going_when_load_fn_fails(registry, caplog):
    registry = WorkerRegistry(registry.client, ttl_s=0.3)
    calls = []

    def load_fn():
        calls.append(1)
        if len(calls) == 1:
            return WorkerLoad(num_running=3)
        raise ValueError("engine busy")

    hb = Heartbeat(registry, _info(), load_fn)
    hb.start()
    try:
        _wait_until(lambda: len(calls) >= 5, 3.0, "five heartbeats")
        [live] = registry.list_workers("tiny")
        load, age_s = live.load, live.load_age_s
        assert load == WorkerLoad(num_running=3)
        assert age_s < 0.3
    finally:
        hb.stop()
    assert sum("load_fn" in r.getMessage() for r in caplog.records) == 1
