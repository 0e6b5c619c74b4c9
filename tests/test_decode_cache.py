"""Multi-turn serving over the decode side's prefix cache (issue 20 parts 1 and 3), on a real cluster (redis-server,
router, 1 prefill and 2 decode workers as processes, KV over TCP): each turn goes to the decode worker holding
the conversation so far, only the blocks it lacks cross the wire (exact counts in Usage), and the tokens are the
offline engine's. Runs with 64 blocks of 16 tokens per worker and a 2 s heartbeat TTL (the purge test)."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import pytest
import redis
from cluster_helpers import internal_channel, wait_idle, worker_components
from prometheus_client.parser import text_string_to_metric_families
from test_engine_vs_hf import prompts_for

from cluster.cluster_secret import load_cluster_secret
from cluster.prefix_index import PrefixIndex
from cluster.proto_convert import sampling_to_proto
from cluster.registry import WorkerRegistry
from deploy.local_cluster import ClusterConfig, LocalCluster
from duet.client import Client, stream_to_record
from duet.internal.v1 import workers_pb2 as wpb
from duet.internal.v1 import workers_pb2_grpc as wpb_grpc
from engine import LLM, SamplingParams
from engine.hashing import prompt_block_hashes

BLOCK = 16
NUM_BLOCKS = 64
WORKER_ARGS = ["--num-kv-blocks", str(NUM_BLOCKS), "--max-num-batched-tokens", "32", "--max-model-len", "1024",
               "--heartbeat-ttl", "2"]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    config = ClusterConfig(model_dir=str(tiny_llama_dir), num_prefill=1, num_decode=2, worker_args=WORKER_ARGS,
                           router_args=["--max-model-len", "1024"], http_port=0, metrics_port=0)
    with LocalCluster(config).start() as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.router_address) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(tiny_llama_dir, num_kv_blocks=NUM_BLOCKS, max_model_len=1024)


@pytest.fixture(scope="module")
def index(cluster, offline):
    return PrefixIndex(redis.Redis.from_url(cluster.redis_url), offline.engine.model_id)


def run(client, prompt, salt, params=PARAMS):
    return stream_to_record(client.generate(prompt, params, timeout_s=60, cache_salt=salt))


def expected_tokens(offline, prompt, params=PARAMS):
    return offline.generate([prompt], params)[0].outputs[0].token_ids


def wait_indexed(index, model_id, worker_id, token_ids, salt, num_blocks, timeout_s=10.0):
    """Until the index says `worker_id` holds the first `num_blocks` blocks of `token_ids` (its KV events are
    published off the request's path)."""
    hashes = prompt_block_hashes(token_ids, BLOCK, model_id, salt)[:num_blocks]
    deadline = time.monotonic() + timeout_s
    while index.lookup(hashes, [worker_id]).get(worker_id, 0) < num_blocks:
        assert time.monotonic() < deadline, f"{worker_id} not indexed with {num_blocks} blocks after {timeout_s} s"
        time.sleep(0.05)


def decode_address(cluster, model_id, worker_id):
    registry = WorkerRegistry.from_url(cluster.redis_url, cluster_secret=load_cluster_secret())
    return next(w.info.address for w in registry.list_workers(model_id, "decode") if w.worker_id == worker_id)


def router_counter(cluster, sample_name: str) -> float:
    """One sample of the router's /metrics, e.g. "duet_router_kv_transferred_tokens_total"."""
    text = urllib.request.urlopen(cluster.metrics_url, timeout=5).read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == sample_name)


def router_counters(cluster) -> tuple[float, float]:
    return (router_counter(cluster, "duet_router_decode_cached_tokens_total"),
            router_counter(cluster, "duet_router_kv_transferred_tokens_total"))


def test_four_turn_chat_sends_only_the_blocks_the_decode_worker_lacks(cluster, client, offline, index):
    vocab, model_id = offline.engine.model_config.vocab_size, offline.engine.model_id
    counters_before = router_counters(cluster)
    questions = prompts_for(vocab, [40, 10, 13, 7], seed=21)
    prompt, held_tokens, decode_worker, usage = [], 0, None, []
    for turn, question in enumerate(questions):
        prompt = prompt + question
        record = run(client, prompt, salt="chat-4")
        assert record["token_ids"] == expected_tokens(offline, prompt), f"turn {turn + 1}"
        usage.append((len(prompt), record["decode_cached_tokens"], record["kv_transferred_tokens"]))
        # the decode worker holds the full blocks of the last turn's prompt + answer but its last token (whose
        # KV was never computed), up to the block before this prompt's last token (always computed again)
        num_cached_blocks = min(held_tokens // BLOCK, (len(prompt) - 1) // BLOCK)
        assert usage[-1] == (len(prompt), num_cached_blocks * BLOCK, len(prompt) - num_cached_blocks * BLOCK)
        if decode_worker is not None:
            assert record["decode_worker"] == decode_worker  # chosen for the conversation it holds
        decode_worker = record["decode_worker"]
        prompt = prompt + record["token_ids"]
        held_tokens = len(prompt) - 1
        wait_indexed(index, model_id, decode_worker, prompt, "chat-4", held_tokens // BLOCK)
    # (prompt tokens, held by the decode worker, sent): from turn 2 on only the new blocks travel
    assert usage == [(40, 0, 40), (58, 32, 26), (79, 64, 15), (94, 80, 14)]
    # and the router's counters add them up
    after = router_counters(cluster)
    assert (after[0] - counters_before[0], after[1] - counters_before[1]) == (0 + 32 + 64 + 80, 40 + 26 + 15 + 14)


def test_evicted_decode_blocks_cost_transfer_not_correctness(cluster, client, offline, index):
    """The index still says (or said a moment ago) the decode worker holds the conversation, but an allocation
    evicted it: Reserve holds only what is really cached, the rest is sent, the tokens stay the offline engine's."""
    vocab, model_id = offline.engine.model_config.vocab_size, offline.engine.model_id
    prompt = prompts_for(vocab, [40], seed=31)[0]
    first = run(client, prompt, salt="evicted")
    decode_worker = first["decode_worker"]
    conversation = prompt + first["token_ids"]  # 48 tokens, 47 with KV: blocks 0, 1 cached on decode_worker
    wait_indexed(index, model_id, decode_worker, conversation, "evicted", 2)
    # a reservation of all blocks but one takes the whole free queue but its tail: the conversation's block 0,
    # freed last (a table is freed last block first), survives; block 1 is evicted
    filler = prompts_for(vocab, [(NUM_BLOCKS - 1) * BLOCK], seed=32)[0]
    with internal_channel(decode_address(cluster, model_id, decode_worker)) as ch:
        d = wpb_grpc.DecodeWorkerStub(ch)
        reserved = d.Reserve(wpb.ReserveRequest(request_id="filler", prompt_token_ids=filler,
                                                sampling=sampling_to_proto(SamplingParams(max_tokens=1))), timeout=10)
        assert reserved.num_blocks == NUM_BLOCKS - 1 and reserved.num_cached_blocks == 0
        assert d.Release(wpb.ReleaseRequest(reservation_id=reserved.reservation_id), timeout=10).found
    next_prompt = conversation + prompts_for(vocab, [10], seed=33)[0]  # 58 tokens
    record = run(client, next_prompt, salt="evicted")
    assert record["token_ids"] == expected_tokens(offline, next_prompt)
    assert record["decode_worker"] == decode_worker  # it still holds the most of it
    assert record["decode_cached_tokens"] == BLOCK and record["kv_transferred_tokens"] == 58 - BLOCK


def test_openai_cached_tokens_count_the_decode_cache(cluster, offline, index):
    """`prompt_tokens_details.cached_tokens`: the longer of the two caches' prefixes, here the decode worker's
    (2 blocks of prompt + answer) over the prefill worker's (1 block of the first prompt): never their sum."""
    import openai

    vocab, model_id = offline.engine.model_config.vocab_size, offline.engine.model_id
    prompt = prompts_for(vocab, [30], seed=41)[0]
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="none", max_retries=0, timeout=60) as api:
        first = api.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True, "cache_salt": "openai"})
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        conversation = prompt + expected_tokens(offline, prompt)  # 38 tokens, 37 with KV: 2 blocks
        registry = WorkerRegistry.from_url(cluster.redis_url, cluster_secret=load_cluster_secret())
        decodes = [w.worker_id for w in registry.list_workers(model_id, "decode")]
        hashes = prompt_block_hashes(conversation, BLOCK, model_id, "openai")[:2]
        deadline = time.monotonic() + 10
        while max(index.lookup(hashes, decodes).values(), default=0) < 2:
            assert time.monotonic() < deadline, "no decode worker indexed with the conversation after 10 s"
            time.sleep(0.05)
        second = api.completions.create(model=model_id, prompt=conversation + prompts_for(vocab, [10], seed=42)[0],
                                        max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "cache_salt": "openai"})
    assert second.usage.prompt_tokens_details.cached_tokens == 2 * BLOCK


def test_a_dead_decode_workers_index_entries_are_purged(cluster, client, offline, index):
    """Runs last: it kills a decode worker. Its entries go once its heartbeat expires (2 s here) and the router
    lists the workers again (it purges every few seconds while serving)."""
    vocab, model_id = offline.engine.model_config.vocab_size, offline.engine.model_id
    prompt = prompts_for(vocab, [40], seed=51)[0]
    record = run(client, prompt, salt="purge")
    victim = record["decode_worker"]
    wait_indexed(index, model_id, victim, prompt + record["token_ids"], "purge", 2)
    victim_proc = next(c for c in worker_components(cluster)
                       if c.address == decode_address(cluster, model_id, victim))
    os.kill(victim_proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while victim in index.workers():
        assert time.monotonic() < deadline, f"{victim}'s index entries outlived it by 20 s"
        run(client, prompts_for(vocab, [5], seed=52)[0], salt="purge-poll")  # the router purges as it serves
        time.sleep(0.2)
    assert index.lookup(prompt_block_hashes(prompt, BLOCK, model_id, "purge"), [victim]) == {}
    wait_idle(cluster, skip=(victim_proc.name,))
