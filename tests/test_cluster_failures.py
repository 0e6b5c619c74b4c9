"""Workers dying mid-request, on a cluster of 2 prefill + 2 decode workers moving KV over torch.distributed
(gloo): the client gets UNAVAILABLE promptly, never a hang, and the cluster goes on serving."""

from __future__ import annotations

import os
import signal
import time

import pytest
from cluster_helpers import wait_idle, worker_components, worker_stats

from deploy.local_cluster import ClusterConfig, LocalCluster
from duet.client import Client, stream_to_record
from engine import LLM, SamplingParams

KILLED: set[str] = set()  # components this module has killed (their processes linger as zombies until stop)
WORKER_ARGS = ["--num-kv-blocks", "400", "--max-num-batched-tokens", "16", "--max-model-len", "4096",
               "--kv-transport", "torch"]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    config = ClusterConfig(model_dir=str(tiny_llama_dir), num_prefill=2, num_decode=2, worker_args=WORKER_ARGS,
                           router_args=["--max-model-len", "4096"])
    with LocalCluster(config).start() as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.router_address) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(tiny_llama_dir, num_kv_blocks=400, max_num_batched_tokens=16, max_model_len=4096)


def component_of_worker(cluster, worker_id: str):
    for c in worker_components(cluster):
        if worker_stats(c.address, c.name.split("-")[0], check=False).worker_id == worker_id:
            return c
    raise AssertionError(f"no component runs {worker_id}")


def check_serving(client, offline, n: int = 6) -> None:
    prompts = [[3 + i, 40, 41, 42 + i, 7] * (1 + i) for i in range(n)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for prompt, ref in zip(prompts, offline.generate(prompts, params)):
        assert stream_to_record(client.generate(prompt, params, timeout_s=60))["token_ids"] == ref.outputs[0].token_ids


def test_greedy_over_gloo_transport_matches_offline(client, offline):
    check_serving(client, offline)


def test_decode_worker_killed_mid_request_migrates(cluster, client, offline):
    """The stream goes on on the other decode worker with exactly the tokens of an undisturbed run."""
    params = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)
    stream = client.generate([5, 6, 7, 8], params, timeout_s=120)
    first = next(stream)
    victim = component_of_worker(cluster, first.decode_worker)
    second = next(stream)
    os.kill(victim.pid, signal.SIGKILL)
    KILLED.add(victim.name)
    rest = list(stream)
    tokens = [t for m in [first, second, *rest] for t in m.token_ids]
    assert tokens == offline.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    assert rest[-1].finish_reason == "length"
    check_serving(client, offline)  # the other decode worker takes every new request
    wait_idle(cluster, skip=tuple(KILLED))


def test_prefill_worker_killed_mid_request_is_prefilled_again_elsewhere(cluster, client, offline):
    """Nothing reached the client yet: the router releases the reservation and starts the hand-off again on
    the other prefill worker; the client gets exactly the undisturbed tokens."""
    prompt = [(7 * i) % 500 + 2 for i in range(4000)]  # 250 chunks of 16 tokens: the prefill takes a while
    params = SamplingParams(max_tokens=4, temperature=0)
    stream = client.generate(prompt, params, timeout_s=120)
    busy = None
    deadline = time.monotonic() + 30
    while busy is None and time.monotonic() < deadline:
        for c in worker_components(cluster):
            if c.name.startswith("prefill"):
                s = worker_stats(c.address, "prefill", check=False)
                if s.num_running or s.num_waiting:
                    busy, busy_id = c, s.worker_id
        time.sleep(0.005)
    assert busy is not None, "the prefill never showed up as running"
    os.kill(busy.pid, signal.SIGKILL)
    KILLED.add(busy.name)
    messages = list(stream)
    assert [t for m in messages for t in m.token_ids] == offline.generate([prompt], params)[0].outputs[0].token_ids
    assert messages[0].prefill_worker != busy_id
    check_serving(client, offline)
    wait_idle(cluster, skip=tuple(KILLED))  # the decode worker's reservation for the failed request is released
