"""The decode worker's queue of local prefills (conditional disaggregation), as its load reports it to the router's
admission: DecodeLoop.num_waiting_tokens, driven step by step on a real engine (the tiny model), no gRPC. The
router side (a local prefill predicted behind that queue) is tests/test_admission_policy.py; the cluster path is
tests/test_local_prefill.py."""

from __future__ import annotations

import queue

from decode_worker.decode_loop import DecodeLoop, ReservedRequest
from engine import SamplingParams
from engine.engine_config import EngineConfig
from engine.runtime import build_runtime
from kvtransfer.reservation import ReservationTable

PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def test_local_prefills_count_their_uncached_tokens_until_their_first_token(tiny_llama_dir):
    rt = build_runtime(tiny_llama_dir, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=32, dtype="float32",
                                                    quantization="none"))
    loop = DecodeLoop(rt, ReservationTable(rt.model_config.num_layers))  # its thread never started: steps by hand
    shared = list(range(10, 42))  # two full blocks, cached after the first request
    first = ReservedRequest("r1", [*shared, 50, 51, 52], PARAMS)
    reserved = loop.reserve(first, ttl_s=30)
    assert reserved.num_cached_blocks == 0
    loop.start_local(reserved.reservation.reservation_id, queue.SimpleQueue())
    assert loop.num_waiting_tokens == 35
    loop._step()  # a 32-token chunk: 3 left (a first step: the speed meter's warm-up, not measured)
    assert loop.num_waiting_tokens == 3 and loop.local_prefill_speed.tokens_per_s == 0.0
    loop._step()  # the rest and token 0
    assert loop.num_waiting_tokens == 0
    while loop.core.has_unfinished_requests():
        loop._step()

    # a second request finds the shared blocks cached: only its own 5 tokens wait; an abort takes them back
    second = ReservedRequest("r2", [*shared, 60, 61, 62, 63, 64], PARAMS)
    reserved = loop.reserve(second, ttl_s=30)
    assert reserved.num_cached_blocks == 2
    loop.start_local(reserved.reservation.reservation_id, queue.SimpleQueue())
    assert loop.num_waiting_tokens == 5
    loop.abort("r2")
    assert loop.num_waiting_tokens == 0
    loop.check_integrity()
    assert rt.block_pool.num_free_blocks == rt.block_pool.num_blocks
