"""Ray: the `ray up` cluster YAML against Ray's own validation, and the Ray launcher on a real local Ray cluster
(2 CPUs, custom resources duet_prefill / duet_decode as the YAML's GPU nodes offer them): correct output,
prefill pool scaled up under a burst and back down when idle, nothing left running after stop()."""

from __future__ import annotations

import copy
import itertools
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml
from cluster_helpers import children

ray = pytest.importorskip("ray")

from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

from cluster.registry import WorkerRegistry  # noqa: E402
from deploy.ray.config import PoolConfig, RayLauncherConfig  # noqa: E402
from deploy.ray.launcher import RayLauncher  # noqa: E402
from duet.client import Client, stream_to_record  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "deploy" / "ray" / "cluster.yaml"
ENGINE = dict(num_kv_blocks=512, max_num_batched_tokens=32, max_model_len=2048)
WORKER_ARGS = ["--num-kv-blocks", "512", "--max-num-batched-tokens", "32", "--max-model-len", "2048",
               "--heartbeat-ttl", "1.5"]  # a load report every 0.5 s: the burst shows up in the registry


def _validated(config: dict) -> dict:
    """What `ray up` does offline before touching a cloud: fill defaults, then check against ray-schema.json."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_cluster_yaml_passes_ray_validation():
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    prepared = _validated(config)
    types = prepared["available_node_types"]
    assert prepared["head_node_type"] == "head" and "GPU" not in types["head"]["resources"]
    assert types["prefill_gpu"]["resources"]["duet_prefill"] == 1 and types["prefill_gpu"]["resources"]["GPU"] == 1
    assert types["decode_gpu"]["resources"]["duet_decode"] == 1 and types["decode_gpu"]["resources"]["GPU"] == 1
    for name in ("prefill_gpu", "decode_gpu"):
        assert 1 <= types[name]["min_workers"] <= types[name]["max_workers"]
    (up,) = [cmd for cmd in prepared["head_start_ray_commands"] if "duet ray up --address auto" in cmd]
    assert "--gpus-per-rank 1" in up and "--redis-url" in up  # GPU workers; Redis the other nodes can reach
    # The same validation rejects a broken file, so passing it means something.
    bad = copy.deepcopy(config)
    bad["available_node_types"]["prefill_gpu"]["min_workers"] = "one"
    with pytest.raises(Exception, match="is not of type 'integer'"):
        _validated(bad)


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, resources={"duet_prefill": 2, "duet_decode": 2}, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def printed() -> list[str]:
    """What the module's launcher prints (its supervision lines)."""
    return []


@pytest.fixture(scope="module")
def launcher(ray_cluster, tiny_llama_dir, printed):
    config = RayLauncherConfig(
        model_dir=str(tiny_llama_dir), router_host="127.0.0.1", port=0, num_cpus_per_rank=0.25,
        prefill=PoolConfig(min_replicas=1, max_replicas=2, target_per_replica=64.0, scale_up_cooldown_s=0.0,
                           scale_down_cooldown_s=1.0),
        decode=PoolConfig(min_replicas=1, max_replicas=1),
        worker_args=WORKER_ARGS, router_args=["--max-model-len", "2048"], poll_interval_s=0.25,
        ready_timeout_s=120.0, internal_tls=True)
    launcher = RayLauncher(config, print_fn=printed.append).start()
    try:
        yield launcher
    finally:
        launcher.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its actor's process) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _prompt(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 500 + 5 for i in range(length)]


def test_launcher_serves_offline_engines_greedy_tokens(launcher, tiny_llama_dir):
    assert launcher.pool_sizes() == {"prefill": 1, "decode": 1}
    pgs = [c.pg for role in ("prefill", "decode") for c in launcher.pools[role]]
    assert all(pg.bundle_count == 1 for pg in pgs)  # tp=1: one bundle per rank, STRICT_PACK
    # every component got the launcher's cluster secret (its runtime env): their entries verify with it
    registry = WorkerRegistry.from_url(launcher.redis_url, cluster_secret=launcher.cluster_secret.encode())
    roles = sorted(w.info.role for w in registry.list_workers(Path(tiny_llama_dir).name))
    assert roles == ["decode", "prefill"]
    wrong = WorkerRegistry.from_url(launcher.redis_url, cluster_secret=b"another cluster's secret")
    assert wrong.list_workers(Path(tiny_llama_dir).name) == []
    assert "@" in launcher.redis_url  # its private redis-server requires a password
    # and internal TLS: each worker answers only a client with the certificate from the launcher's CA
    from cluster.grpc_plumbing import health_check

    for worker in (*launcher.pools["prefill"], *launcher.pools["decode"]):
        assert health_check(worker.address, tls=launcher.internal_tls)
        assert not health_check(worker.address)

    prompts = [_prompt(40, 1), _prompt(5, 2)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    refs = LLM(tiny_llama_dir, **ENGINE).generate(prompts, params)
    with Client(launcher.router_address) as client:
        for prompt, ref in zip(prompts, refs):
            got = stream_to_record(client.generate(prompt, params, timeout_s=60))
            assert got["token_ids"] == ref.outputs[0].token_ids
            assert got["text"] == ref.outputs[0].text and got["finish_reason"] == "length"


def test_prefill_pool_scales_up_under_a_burst_and_back_down(launcher, tiny_llama_dir):
    registry = WorkerRegistry.from_url(launcher.redis_url)
    model_id = Path(tiny_llama_dir).name
    seen_prefill = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen_prefill.append(len(registry.list_workers(model_id, "prefill")))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    errors = []

    def send(i: int):
        try:
            with Client(launcher.router_address) as client:  # a new prompt each time: a cached one is no work
                stream_to_record(client.generate(_prompt(1000, 100 + i), params, timeout_s=120))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    try:
        deadline = time.monotonic() + 60
        for n in itertools.count():  # bursts until the second worker is up
            if 2 in seen_prefill or time.monotonic() > deadline:
                break
            burst = [threading.Thread(target=send, args=(6 * n + i,)) for i in range(6)]
            for t in burst:
                t.start()
            for t in burst:
                t.join()
        assert not errors, errors
        assert 2 in seen_prefill, f"prefill workers seen: {sorted(set(seen_prefill))}"
        assert any(role == "prefill" and replicas == 2 for _, role, replicas, _, _ in launcher.decisions)
        deadline = time.monotonic() + 30  # idle now: after the 1 s cooldown it stops one again
        while (launcher.pool_sizes()["prefill"] != 1 or len(registry.list_workers(model_id, "prefill")) != 1) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert launcher.pool_sizes() == {"prefill": 1, "decode": 1}
        assert len(registry.list_workers(model_id, "prefill")) == 1  # the stopped one deregistered
        assert launcher.decisions[-1][1:4] == ("prefill", 1, "down")
    finally:
        done.set()
        watcher.join()


def test_killed_router_and_worker_processes_are_restarted_in_their_actors_and_requests_complete(
        launcher, printed, tiny_llama_dir):
    """issue 16, as `duet up` does it (tests/test_cli_serving.py): a SIGKILLed process is started again by its
    actor on its port after the shared backoff, with the same three lines, and the cluster serves again."""
    registry = WorkerRegistry.from_url(launcher.redis_url, cluster_secret=launcher.cluster_secret.encode())
    model_id = Path(tiny_llama_dir).name
    (decode,) = launcher.pools["decode"]
    router = launcher.router
    before = {c.name: (c.pid, c.address) for c in (router, decode)}
    seen = len(printed)
    for comp in (router, decode):
        os.kill(comp.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not all(any(line.startswith(f"duet: {name} restarted") for line in printed[seen:]) for name in before):
        assert time.monotonic() < deadline, printed[seen:]
        time.sleep(0.1)
    assert launcher.router is router and launcher.pools["decode"] == [decode]  # the same actors, not new ones
    for comp in (router, decode):
        old_pid, address = before[comp.name]
        assert comp.pid != old_pid and comp.address == address
        died, restarted = [line for line in printed[seen:]
                           if line.startswith((f"duet: component {comp.name} ", f"duet: {comp.name} restarted"))]
        assert died.startswith(f"duet: component {comp.name} was killed by SIGKILL; {comp.name} log tail:\n")
        assert died.endswith(f"\nduet: restarting {comp.name} in 1 s (restart 1 within 300 s)")
        assert restarted == f"duet: {comp.name} restarted (pid {comp.pid})"
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = LLM(tiny_llama_dir, **ENGINE).generate([_prompt(20, 3)], params)[0]
    deadline = time.monotonic() + 60
    while True:  # UNAVAILABLE until the new processes have loaded and registered
        try:
            with Client(launcher.router_address) as client:
                got = stream_to_record(client.generate(_prompt(20, 3), params, timeout_s=30))
            break
        except grpc.RpcError as e:
            assert time.monotonic() < deadline, e
            time.sleep(0.5)
    assert got["token_ids"] == ref.outputs[0].token_ids
    while (addresses := [w.info.address for w in registry.list_workers(model_id, "decode")]) != [decode.address]:
        assert time.monotonic() < deadline, addresses  # the killed process's entry expires with its TTL
        time.sleep(0.2)


def test_stop_leaves_no_duet_processes(launcher):
    pids = list(launcher.child_pids)
    assert len(pids) >= 3  # router, prefill, decode (+ the scaled one)
    launcher.stop()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == []
    assert launcher.pool_sizes() == {"prefill": 0, "decode": 0} and launcher.router is None
    launcher.stop()  # idempotent


def test_a_worker_that_cannot_start_fails_start_with_its_log_and_leaves_nothing(ray_cluster, tmp_path):
    launcher = RayLauncher(RayLauncherConfig(model_dir=str(tmp_path / "no-such-model"), router_host="127.0.0.1",
                                             port=0, num_cpus_per_rank=0.25, ready_timeout_s=60.0))
    with pytest.raises(Exception, match=r"(prefill|decode)-0 exited with code [1-9]"):
        launcher.start()
    assert launcher.child_pids and [p for p in launcher.child_pids if _alive(p)] == []
    assert launcher.redis is None and launcher.pool_sizes() == {"prefill": 0, "decode": 0}


def test_duet_ray_up_flags_map_to_the_launcher_config(monkeypatch):
    import argparse

    from duet import cli_ray

    seen = {}
    monkeypatch.setattr("deploy.ray.launcher.run_ray_up", lambda config, address: seen.update(c=config, a=address) or 0)
    parser = argparse.ArgumentParser()
    cli_ray.add_ray_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["ray", "up", "--address", "local", "--model", "/m/tiny", "--prefill-min", "2",
                              "--prefill-max", "5", "--decode-max", "3", "--port", "0",
                              "--worker-args", "--num-kv-blocks 64 --max-model-len 512",
                              "--prefill-args", "--quantization none", "--decode-args", "--quantization int8",
                              "--internal-tls",
                              "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert args.func(args) == 0 and seen["a"] == "local"
    config = seen["c"]
    assert (config.prefill.min_replicas, config.prefill.max_replicas) == (2, 5)
    assert (config.decode.min_replicas, config.decode.max_replicas) == (1, 3)
    assert config.port == 0 and config.resolved_model_id == "tiny" and config.tp == 1 and config.internal_tls
    assert config.worker_args == ["--num-kv-blocks", "64", "--max-model-len", "512"] and config.router_args == []
    assert config.prefill.args == ["--quantization", "none"]
    assert config.decode.args[:1] == ["--speculative-config"] and config.decode.args[2:] == ["--quantization", "int8"]
    args = parser.parse_args(["ray", "up", "--address", "local", "--model", "/m/tiny", "--speculative-config",
                              '{"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 2}'])
    assert args.func(args) == 0
    config = seen["c"]  # a draft model's prompt KV is computed by the prefill pool and shipped
    assert config.prefill.args[:1] == config.decode.args[:1] == ["--speculative-config"]
    with pytest.raises(ValueError, match="min_replicas=2, max_replicas=1"):
        RayLauncherConfig(prefill=PoolConfig(min_replicas=2, max_replicas=1))


def test_without_a_model_the_workers_use_the_embedded_default_and_register_under_its_file_name():
    from engine.default_model import default_model_path

    config = RayLauncherConfig(redis_url="redis://127.0.0.1:6379/0")
    assert config.model_dir is None and config.resolved_model_id == default_model_path().name
    # no --model: each node resolves its own installed copy
    assert RayLauncher(config)._model_args() == ["--redis-url", "redis://127.0.0.1:6379/0"]


def test_tp2_workers_run_their_ranks_in_one_placement_group(ray_cluster, tiny_llama_dir):
    config = RayLauncherConfig(
        model_dir=str(tiny_llama_dir), router_host="127.0.0.1", port=0, num_cpus_per_rank=0.25, tp=2,
        prefill=PoolConfig(min_replicas=1, max_replicas=1), decode=PoolConfig(min_replicas=1, max_replicas=1),
        worker_args=WORKER_ARGS, router_args=["--max-model-len", "2048"], poll_interval_s=0.25,
        ready_timeout_s=120.0)
    launcher = RayLauncher(config).start()
    try:
        comps = [c for role in ("prefill", "decode") for c in launcher.pools[role]]
        assert [c.pg.bundle_count for c in comps] == [2, 2]  # rank 0 + rank 1, STRICT_PACK on one node
        ranks = [pid for c in comps for pid in children(c.pid)]
        assert len(ranks) == 2  # each worker started its rank-1 process
        prompt, params = _prompt(40, 3), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        ref = LLM(tiny_llama_dir, **ENGINE).generate([prompt], params)[0].outputs[0]
        with Client(launcher.router_address) as client:
            assert stream_to_record(client.generate(prompt, params, timeout_s=60))["token_ids"] == ref.token_ids
    finally:
        launcher.stop()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in ranks if _alive(p)] == []
