"""Conditional disaggregation (issue 20 part 2) on a real cluster (redis-server, router with
--local-prefill-tokens 32, 1 prefill and 2 decode workers as processes): a prompt whose part not cached on the
chosen decode worker is shorter than 32 tokens is prefilled by that decode worker itself (no prefill worker, no
KV transfer: kv_transferred_tokens 0) and gives the same tokens as the disaggregated path and the offline
engine; cancels free every block; a full decode worker still refuses with RESOURCE_EXHAUSTED; a locally
prefilled request whose decode worker dies mid-stream migrates with the undisturbed tokens."""

from __future__ import annotations

import os
import signal

import grpc
import pytest
import redis
from cluster_helpers import internal_channel, rpc_error, wait_idle, worker_components
from test_decode_cache import expected_tokens, router_counter, run, wait_indexed
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

BLOCK = 16
NUM_BLOCKS = 64
LOCAL_PREFILL_TOKENS = 32
WORKER_ARGS = ["--num-kv-blocks", str(NUM_BLOCKS), "--max-num-batched-tokens", "32", "--max-model-len", "1024"]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    config = ClusterConfig(model_dir=str(tiny_llama_dir), num_prefill=1, num_decode=2, worker_args=WORKER_ARGS,
                           router_args=["--max-model-len", "1024",
                                        "--local-prefill-tokens", str(LOCAL_PREFILL_TOKENS)], metrics_port=0)
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


def first_message(client, prompt, salt, params=PARAMS):
    stream = client.generate(prompt, params, timeout_s=60, cache_salt=salt)
    return stream, next(stream)


def decode_addresses(cluster, model_id):
    registry = WorkerRegistry.from_url(cluster.redis_url, cluster_secret=load_cluster_secret())
    return {w.worker_id: w.info.address for w in registry.list_workers(model_id, "decode")}


def test_conditional_local_prefill_gives_the_same_tokens_as_the_disaggregated_path(cluster, client, offline, index):
    vocab, model_id = offline.engine.model_config.vocab_size, offline.engine.model_id
    question, follow_up, short = prompts_for(vocab, [40, 10, 20], seed=61)
    local_before = router_counter(cluster, "duet_router_local_prefills_total")
    # turn 1: 40 uncached tokens (>= 32): through the prefill worker, all 40 sent
    turn1 = run(client, question, salt="lp")
    assert turn1["token_ids"] == expected_tokens(offline, question)
    assert (turn1["decode_cached_tokens"], turn1["kv_transferred_tokens"]) == (0, 40)
    assert turn1["prefill_worker"] != ""
    decode_worker = turn1["decode_worker"]
    conversation = question + turn1["token_ids"]  # 48 tokens, 47 with KV: 2 blocks cached on decode_worker
    wait_indexed(index, model_id, decode_worker, conversation, "lp", 2)
    # turn 2: 58 tokens, 32 cached on decode_worker, 26 uncached (< 32): prefilled there, nothing sent
    prompt = conversation + follow_up
    local = run(client, prompt, salt="lp")
    assert (local["decode_worker"], local["prefill_worker"]) == (decode_worker, "")
    assert (local["prompt_tokens"], local["decode_cached_tokens"], local["kv_transferred_tokens"]) == (58, 32, 0)
    assert local["cached_tokens"] == 0  # no prefill worker's cache was used
    # the same prompt under another salt: nothing cached anywhere, 58 uncached: the disaggregated path
    disaggregated = run(client, prompt, salt="lp-other")
    assert disaggregated["prefill_worker"] != ""
    assert (disaggregated["decode_cached_tokens"], disaggregated["kv_transferred_tokens"]) == (0, 58)
    assert local["token_ids"] == disaggregated["token_ids"] == expected_tokens(offline, prompt)
    # a short fresh prompt (20 uncached tokens): prefilled on a decode worker from scratch
    fresh = run(client, short, salt="lp-short")
    assert (fresh["prefill_worker"], fresh["decode_cached_tokens"], fresh["kv_transferred_tokens"]) == ("", 0, 0)
    assert fresh["token_ids"] == expected_tokens(offline, short)
    # max_tokens=1: the locally sampled token 0 ends the request
    one = run(client, short, salt="lp-one", params=SamplingParams(max_tokens=1, temperature=0))
    assert one["token_ids"] == expected_tokens(offline, short)[:1] and one["finish_reason"] == "length"
    # turn 2, the short prompt and max_tokens=1 were prefilled on a decode worker
    assert router_counter(cluster, "duet_router_local_prefills_total") - local_before == 3
    wait_idle(cluster)


def test_a_cancelled_local_prefill_frees_every_block(cluster, client, offline):
    vocab = offline.engine.model_config.vocab_size
    prompt = prompts_for(vocab, [20], seed=71)[0]
    stream, first = first_message(client, prompt, "lp-cancel", SamplingParams(max_tokens=500, ignore_eos=True))
    assert first.prefill_worker == "" and len(first.token_ids) >= 1
    stream.cancel()
    wait_idle(cluster)  # no block, request or reservation left; every pool's check_integrity passes


def test_a_full_decode_worker_still_refuses_a_local_prefill(cluster, client, offline):
    """Admission is Reserve's, as on the disaggregated path: with every block of both decode workers reserved,
    a request short enough to prefill locally gets RESOURCE_EXHAUSTED with a retry hint."""
    vocab, model_id = offline.engine.model_config.vocab_size, offline.engine.model_id
    filler = prompts_for(vocab, [(NUM_BLOCKS - 1) * BLOCK], seed=81)[0]
    held = []
    try:
        for address in decode_addresses(cluster, model_id).values():
            ch = internal_channel(address)
            d = wpb_grpc.DecodeWorkerStub(ch)
            reserved = d.Reserve(wpb.ReserveRequest(request_id=f"filler-{address}", prompt_token_ids=filler,
                                                    sampling=sampling_to_proto(SamplingParams(max_tokens=1))),
                                 timeout=10)
            held.append((ch, d, reserved.reservation_id))
        error = rpc_error(lambda: run(client, prompts_for(vocab, [10], seed=82)[0], salt="lp-full"))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(error.trailing_metadata())["grpc-retry-pushback-ms"] == "200"
    finally:
        for ch, d, reservation_id in held:
            assert d.Release(wpb.ReleaseRequest(reservation_id=reservation_id), timeout=10).found
            ch.close()
    wait_idle(cluster)


def test_a_locally_prefilled_request_migrates_when_its_decode_worker_dies(cluster, client, offline):
    """Runs last: it kills a decode worker mid-stream. The stream goes on through a prefill worker (a migration
    never prefills locally) with exactly the offline engine's tokens."""
    vocab, model_id = offline.engine.model_config.vocab_size, offline.engine.model_id
    prompt = prompts_for(vocab, [20], seed=91)[0]
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    stream, first = first_message(client, prompt, "lp-migrate", params)
    assert first.prefill_worker == ""
    victim = first.decode_worker
    victim_proc = next(c for c in worker_components(cluster)
                       if c.address == decode_addresses(cluster, model_id)[victim])
    os.kill(victim_proc.pid, signal.SIGKILL)
    rest = stream_to_record(stream)
    assert [*first.token_ids, *rest["token_ids"]] == expected_tokens(offline, prompt, params)
    assert rest["kv_transferred_tokens"] > 0  # the migration's prefill sent the prompt and the tokens so far
    wait_idle(cluster, skip=(victim_proc.name,))
