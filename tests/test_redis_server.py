"""deploy/redis_server.py against the real redis-server binary."""

import os

import pytest
import redis

from deploy import redis_server
from deploy.redis_server import RedisServer


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_ping_stop_removes_everything():
    server = RedisServer().start()
    pid, data_dir = server.pid, server.data_dir
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    assert redis.Redis.from_url(server.url).ping() is True
    assert (data_dir / "redis.conf").exists() and _alive(pid)
    server.stop()
    assert not _alive(pid)
    assert not data_dir.exists()
    assert server.data_dir is None
    server.stop()  # idempotent


def test_config_has_no_persistence_and_memory_limit():
    with RedisServer(maxmemory="64mb", maxmemory_policy="allkeys-lru") as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert client.config_get("maxmemory") == {"maxmemory": str(64 * 1024 * 1024)}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert client.config_get("bind") == {"bind": "127.0.0.1"}


def test_password_is_enforced_and_url_carries_it():
    password = 'p@ss w"rd:/#'  # characters that must be quoted in the URL and in redis.conf
    with RedisServer(password=password) as server:
        assert "p%40ss" in server.url
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port, retry=None).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port, password="wrong", retry=None).ping()
        assert redis.Redis(host="127.0.0.1", port=server.port, password=password).ping() is True
        assert redis.Redis.from_url(server.url).ping() is True


def test_missing_executable_says_how_to_install():
    server = RedisServer(executable="/nonexistent/redis-server")
    with pytest.raises(RuntimeError, match=r"redis-server not found.*apt-get install -y redis-server"):
        server.start()
    assert server.data_dir is None


def test_bad_config_shows_log_tail_and_cleans_up():
    server = RedisServer(maxmemory_policy="bogus")
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 1.*maxmemory-policy bogus"):
        server.start()
    assert server.data_dir is None


def test_fixed_port_taken_is_an_error_not_someone_elses_server():
    with RedisServer() as first:
        with pytest.raises(RuntimeError, match=f"(?s)port {first.port}.*Address already in use"):
            RedisServer(port=first.port).start()
        assert redis.Redis.from_url(first.url).ping() is True


def test_free_port_race_retries_with_another_port(monkeypatch):
    with RedisServer() as squatter:
        ports = iter([squatter.port])
        real_pick = redis_server.pick_free_port
        monkeypatch.setattr(redis_server, "pick_free_port", lambda: next(ports, None) or real_pick())
        with RedisServer() as server:
            assert server.port != squatter.port
            assert redis.Redis.from_url(server.url).ping() is True


def test_restart_on_same_port():
    first = RedisServer().start()
    port = first.port
    redis.Redis.from_url(first.url).set("k", "v")
    first.stop()
    with RedisServer(port=port) as second:
        client = redis.Redis.from_url(second.url)
        assert client.ping() is True
        assert client.get("k") is None  # nothing persisted
