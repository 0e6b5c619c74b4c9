"""Tensor parallelism in the disaggregated cluster: prefill and decode workers at TP=2 (each one process per
rank, gloo between ranks), KV moved rank to rank, real redis-server / router / gRPC. Output is held to the
TP=1 offline engine and to Hugging Face; a TP mismatch is refused with a message; killing one rank takes its
worker down cleanly."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from cluster_helpers import alive, children, internal_channel, rpc_error, wait_idle, worker_components
from test_engine_vs_hf import assert_matches_hf, hf_model, prompts_for

from deploy.local_cluster import ClusterConfig, LocalCluster
from duet.client import Client, stream_to_record
from duet.internal.v1 import workers_pb2 as wpb
from duet.internal.v1 import workers_pb2_grpc as wpb_grpc
from engine import LLM, SamplingParams

ENGINE = dict(num_kv_blocks=96, max_num_batched_tokens=32, max_model_len=512)
WORKER_ARGS = ["--num-kv-blocks", "96", "--max-num-batched-tokens", "32", "--max-model-len", "512",
               "--layer-group-size", "1"]


def run(client, prompt, params):
    return stream_to_record(client.generate(prompt, params, timeout_s=60))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_cluster_matches_tp1_offline_and_hf(arch, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    transport = "tcp" if arch == "llama" else "torch"  # torch: gloo pair groups between the ranks' KV endpoints
    # tcp under internal TLS: each follower rank's KV sender and receiver take the material rank 0 was given
    config = ClusterConfig(model_dir=str(model_dir), router_args=["--max-model-len", "512"],
                           worker_args=[*WORKER_ARGS, "--tp", "2", "--kv-transport", transport],
                           internal_tls=transport == "tcp")
    offline = LLM(model_dir, **ENGINE)
    vocab = offline.engine.model_config.vocab_size
    prompts = prompts_for(vocab, [1, 17, 40, 100], seed=5)  # 40 and 100 take several 32-token chunks
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    hf = hf_model(model_dir)
    with LocalCluster(config).start() as cluster, Client(cluster.router_address) as client:
        workers = worker_components(cluster)
        assert all(len(children(c.pid)) == 1 for c in workers)  # rank 1 of each worker
        for prompt, out in zip(prompts, offline.generate(prompts, params)):
            ref = out.outputs[0]
            got = run(client, prompt, params)
            assert got["token_ids"] == ref.token_ids and got["finish_reason"] == "length"
            for lp, ref_lp in zip(got["logprobs"], ref.logprobs, strict=True):  # {sampled id: Logprob, top-k}
                assert next(iter(ref_lp)) == lp["token_id"]
                assert abs(lp["logprob"] - ref_lp[lp["token_id"]].logprob) < 1e-4
                assert set(ref_lp) == {lp["token_id"], *(t for t, _ in lp["top"])}
            assert_matches_hf(hf, prompt, got["token_ids"])
        # a prefix-cache hit on the prefill worker: the cached blocks' shards ship from every rank
        shared = prompts_for(vocab, [64], seed=12)[0]
        short = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        first = run(client, shared + [3, 4], short)
        second = run(client, shared + [5], short)
        assert second["cached_tokens"] == 64
        # and on the decode worker's own prefix cache (issue 20): it still holds the first request's 4 shared blocks
        # on both ranks, so only the new token's KV crosses, and the tokens stay the offline engine's
        assert (second["decode_cached_tokens"], second["kv_transferred_tokens"]) == (64, 1)
        for got, prompt in [(first, shared + [3, 4]), (second, shared + [5])]:
            assert got["token_ids"] == offline.generate([prompt], short)[0].outputs[0].token_ids
        stats = wait_idle(cluster)  # every block back in rank 0's pool (followers hold none), integrity checked
        assert all(s.num_free_blocks == 96 for s in stats.values())


@pytest.fixture(scope="module")
def mixed_cluster(tiny_llama_dir):
    """Prefill at TP=1, decode at TP=2: no pair can exchange KV."""
    # --worker-wait-s 1: the decode worker killed below is not restarted; the router waits 1 s for it, not 20
    config = ClusterConfig(model_dir=str(tiny_llama_dir), worker_args=WORKER_ARGS, decode_args=["--tp", "2"],
                           router_args=["--max-model-len", "512", "--worker-wait-s", "1"])
    with LocalCluster(config).start() as c:
        yield c


def test_tp_mismatch_is_refused_with_a_message(mixed_cluster):
    with Client(mixed_cluster.router_address) as client:
        e = rpc_error(lambda: run(client, [1, 2, 3], SamplingParams(max_tokens=4)))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "need the same --tp" in e.details() and "tp_size=2" in e.details() and "tp_size [1]" in e.details()
    # straight to the workers, past the router's check: the prefill worker refuses the 2-rank target
    prefill, decode = (next(c for c in worker_components(mixed_cluster) if c.name.startswith(r))
                       for r in ("prefill", "decode"))
    with internal_channel(decode.address) as dch, internal_channel(prefill.address) as pch:
        reserved = wpb_grpc.DecodeWorkerStub(dch).Reserve(
            wpb.ReserveRequest(request_id="x", prompt_token_ids=[1, 2, 3]), timeout=10)
        assert len(reserved.kv_addresses) == 2 and reserved.kv_addresses[0] == reserved.kv_address
        target = wpb.KVTarget(kv_address=reserved.kv_address, reservation_id=reserved.reservation_id,
                              kv_addresses=reserved.kv_addresses)
        e = rpc_error(lambda: wpb_grpc.PrefillWorkerStub(pch).Prefill(
            wpb.PrefillRequest(request_id="x", prompt_token_ids=[1, 2, 3], target=target), timeout=10))
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.details().startswith("TP sizes differ: this prefill worker runs tp_size=1, the decode worker gave "
                                      "2 KV endpoint(s)")
        # the same target without the rank list reaches the KV handshake, which refuses it too
        target = wpb.KVTarget(kv_address=reserved.kv_address, reservation_id=reserved.reservation_id)
        e = rpc_error(lambda: wpb_grpc.PrefillWorkerStub(pch).Prefill(
            wpb.PrefillRequest(request_id="y", prompt_token_ids=[1, 2, 3], target=target), timeout=10))
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "TP sizes differ (sender tp_size=1, receiver tp_size=2)" in e.details()
        assert wpb_grpc.DecodeWorkerStub(dch).Release(
            wpb.ReleaseRequest(reservation_id=reserved.reservation_id), timeout=10).found
    wait_idle(mixed_cluster)


def test_killing_a_rank_takes_its_worker_down(mixed_cluster):
    decode = next(c for c in worker_components(mixed_cluster) if c.name.startswith("decode"))
    (rank1,) = children(decode.pid)
    os.kill(rank1, signal.SIGKILL)
    proc = next(p for p in mixed_cluster._grpc_processes() if p.name == decode.name)
    deadline = time.monotonic() + 30
    while proc.popen.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.popen.returncode == 1  # stopped on its own: no hang
    assert not alive(rank1) and children(decode.pid) == []
    with Client(mixed_cluster.router_address) as client:  # deregistered: the router knows no decode worker
        deadline = time.monotonic() + 15
        while True:
            e = rpc_error(lambda: run(client, [1, 2, 3], SamplingParams(max_tokens=4)))
            if e.code() == grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert e.code() == grpc.StatusCode.UNAVAILABLE and "decode" in e.details()
