"""Issue 16 (part): a decode worker SIGKILLed mid-stream costs its requests a pause, not an error. The router
reserves on another decode worker for the prompt plus the tokens already sent, has them prefilled (the
sampling state continued) and resumes: every client gets exactly the tokens of an undisturbed run, greedy
and seeded. Real redis-server, router and workers as processes."""

from __future__ import annotations

import os
import queue
import signal
import threading
from pathlib import Path

import pytest
from cluster_helpers import wait_idle

from cluster.cluster_secret import load_cluster_secret
from cluster.registry import WorkerRegistry
from deploy.local_cluster import ClusterConfig, LocalCluster
from duet.client import Client
from engine import LLM, SamplingParams

ENGINE_ARGS = ["--num-kv-blocks", "200", "--max-model-len", "1024", "--max-num-batched-tokens", "64"]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    config = ClusterConfig(model_dir=str(tiny_llama_dir), num_prefill=1, num_decode=2, worker_args=ENGINE_ARGS,
                           router_args=["--max-model-len", "1024"])
    with LocalCluster(config).start() as c:
        yield c


def test_requests_on_a_killed_decode_worker_finish_with_the_undisturbed_tokens(cluster, tiny_llama_dir):
    prompts = [[3 + i, 17, 99 + i, 4, 250 - i] * (i + 1) for i in range(6)]
    params = [SamplingParams(max_tokens=400, ignore_eos=True, **(dict(temperature=0) if i % 2 == 0 else
                                                                dict(temperature=0.9, top_p=0.95, seed=100 + i,
                                                                     repetition_penalty=1.1)))
              for i in range(6)]
    offline = LLM(tiny_llama_dir, num_kv_blocks=200, max_model_len=1024)
    expected = [o.token_ids for o in offline.generate(prompts, params)]

    first_messages: queue.Queue = queue.Queue()
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    release = threading.Event()

    def run(i: int) -> None:
        try:
            with Client(cluster.router_address) as client:
                tokens = []
                for n, message in enumerate(client.generate(prompts[i], params[i], timeout_s=120)):
                    if n == 0:
                        first_messages.put((i, message.decode_worker))
                    tokens += message.token_ids
                    if len(tokens) >= 10:
                        release.wait(60)  # hold every stream mid-way until the kill
                results[i] = tokens
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    # the victim: the decode worker of whichever stream answered first, killed at once, so at least that
    # stream is still decoding there however slowly the machine runs
    first_stream, victim = first_messages.get(timeout=60)
    registry = WorkerRegistry.from_url(cluster.redis_url, cluster_secret=load_cluster_secret())
    address = next(w.info.address for w in registry.list_workers(Path(tiny_llama_dir).name, "decode")
                   if w.worker_id == victim)
    victim_proc = next(c for c in cluster.components if c.address == address)
    os.kill(victim_proc.pid, signal.SIGKILL)
    release.set()
    decode_ids = dict([(first_stream, victim)] + [first_messages.get(timeout=60) for _ in prompts[1:]])
    for t in threads:
        t.join(180)
    assert not errors, errors
    for i in range(len(prompts)):  # name the first difference, should there be one
        diverged = next((k for k, (a, b) in enumerate(zip(results[i], expected[i])) if a != b), None)
        assert results[i] == expected[i], (f"stream {i} ({'greedy' if i % 2 == 0 else 'seeded'}, decode "
                                           f"{decode_ids[i]}, victim {victim}): {len(results[i])} tokens, first "
                                           f"difference at {diverged}")
    router_log = Path(next(c for c in cluster.components if c.name == "router").log_path).read_text()
    migrated = router_log.count(f"event=migrating reason=decode_lost from={victim}")
    assert 1 <= migrated <= sum(d == victim for d in decode_ids.values())  # it was killed with requests mid-stream
    wait_idle(cluster, skip=(victim_proc.name,))
