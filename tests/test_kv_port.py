"""`duet decode --kv-port`: the KV receiver listens on a declared port (so a Kubernetes NetworkPolicy can name it),
tensor-parallel rank r on kv_port + r; 0 keeps a free port. Real workers, real Redis."""

from __future__ import annotations

import re
import socket

import pytest

from deploy.redis_server import RedisServer
from engine.engine_config import EngineConfig
from engine.ports import pick_free_ports
from worker.process import WorkerConfig

# a worker started and stopped at once leaves no thread dying on the way out (the KV event publisher once resynced
# from an engine already stopped)
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


def decode_worker(redis_url: str, model_dir, kv_port: int, tp_size: int = 1):
    from decode_worker.server import DecodeWorker

    engine = EngineConfig(num_kv_blocks=16, tp_size=tp_size)
    return DecodeWorker(WorkerConfig(role="decode", redis_url=redis_url, model_dir=model_dir, engine=engine,
                                     kv_port=kv_port))


def assert_listening(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass


@pytest.mark.parametrize("tp_size", [1, 2])
def test_the_kv_receiver_listens_on_the_declared_port(redis_url, tiny_llama_dir, tp_size):
    kv_port = pick_free_ports(1)[0]
    worker = decode_worker(redis_url, tiny_llama_dir, kv_port, tp_size)
    try:
        worker.start()
        assert worker.receiver.port == kv_port
        assert worker.info().kv_address == f"127.0.0.1:{kv_port}"  # what the registry tells prefill workers
        assert worker.rank_kv_addresses == [f"127.0.0.1:{kv_port + r}" for r in range(1, tp_size)]
        for rank in range(tp_size):
            assert_listening(kv_port + rank)
    finally:
        worker.stop()


def test_port_zero_is_a_free_port(redis_url, tiny_llama_dir):
    worker = decode_worker(redis_url, tiny_llama_dir, 0)
    try:
        worker.start()
        assert worker.receiver.port > 0 and worker.info().kv_address == f"127.0.0.1:{worker.receiver.port}"
        assert_listening(worker.receiver.port)
    finally:
        worker.stop()


@pytest.mark.parametrize(("role", "kv_port", "tp_size", "message"), [
    ("decode", 65535, 2, "kv_port=65535 is invalid: must be 0 (a free port) or 1..65535, and with tp_size=2 rank r "
                         "listens on kv_port + r (last: 65536)"),
    ("decode", -1, 1, "kv_port=-1 is invalid"),
    ("prefill", 9000, 1, "kv_port=9000 is invalid for a prefill worker: only decode workers listen for KV"),
])
def test_bad_kv_ports_are_refused(role, kv_port, tp_size, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        WorkerConfig(role=role, redis_url="redis://x", engine=EngineConfig(tp_size=tp_size), kv_port=kv_port)


def test_only_decode_has_the_flag():
    from duet.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["decode", "--redis-url", "redis://r", "--kv-port", "7000"])
    assert args.kv_port == 7000
    with pytest.raises(SystemExit):
        parser.parse_args(["prefill", "--redis-url", "redis://r", "--kv-port", "7000"])
