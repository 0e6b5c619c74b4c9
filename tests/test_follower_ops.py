"""Typed tensor-parallel follower operations: every op round-trips through its JSON exactly; anything else is
refused with an error naming what is wrong; over real gloo processes, each follower runs the one method its
hooks name for the op's class and rank 0 learns every rank's status, in rank order, while the ranks go on."""

from __future__ import annotations

import json
import multiprocessing
import queue
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from decode_worker.tp_ops import CommitReservation, ReleaseReservation, ReserveBlocks
from engine.follower_ops import (
    MAX_OP_BYTES,
    CallResult,
    CallStatus,
    FollowerHooks,
    OpDecodeError,
    UnknownOp,
    decode_op,
    encode_op,
)
from prefill_worker.follower_acks import ShardSent
from prefill_worker.tp_ops import ForgetRequest, KVSendEntry, KVSends

ALL_OPS = (KVSends, ForgetRequest, ReserveBlocks, ReleaseReservation, CommitReservation, ShardSent)
ids = st.integers(min_value=0, max_value=2**62)
texts = st.text(max_size=40)
entries = st.builds(KVSendEntry, request_id=texts, endpoints=st.lists(texts, max_size=4).map(tuple),
                    reservation_id=ids, first_block=ids,
                    block_ids=st.lists(ids, min_size=1, max_size=16).map(tuple), last=st.booleans())
ops = st.one_of(
    st.builds(KVSends, entries=st.lists(entries, max_size=5).map(tuple)),
    st.builds(ForgetRequest, request_id=texts),
    st.builds(ReserveBlocks, reservation_id=ids, request_id=texts,
              block_ids=st.lists(ids, max_size=16).map(tuple), num_tokens=ids,
              ttl_s=st.floats(allow_nan=False, allow_infinity=False)),
    st.builds(ReleaseReservation, reservation_id=ids),
    st.builds(CommitReservation, reservation_id=ids),
    st.builds(ShardSent, request_id=texts, rank=ids, error_kind=st.none() | texts, message=texts),
)


@given(ops)
def test_every_op_round_trips_exactly(op):
    body = encode_op(op)
    back = decode_op(body, ALL_OPS)
    assert back == op and type(back) is type(op)
    assert json.loads(body)["op"] == type(op).__name__


def test_only_the_named_classes_decode():
    body = encode_op(ForgetRequest("r1"))
    with pytest.raises(UnknownOp, match=r"op='ForgetRequest' is unknown here: this rank runs \['CommitReservation'"):
        decode_op(body, (CommitReservation, ReserveBlocks))
    with pytest.raises(UnknownOp, match="op='Pickle' is unknown"):
        decode_op(b'{"op":"Pickle","fields":{}}', ALL_OPS)


@pytest.mark.parametrize("body, message", [
    (b"\x80not json", "must be UTF-8 JSON"),
    (b'{"op":"ForgetRequest","fields":{"request_id":"r"}', "must be UTF-8 JSON"),  # cut short
    (b'["ForgetRequest"]', "keys 'op' and 'fields'"),
    (b'{"op":"ForgetRequest","fields":{"request_id":"r"},"x":1}', "keys 'op' and 'fields'"),
    (b'{"op":"ForgetRequest","fields":{}}', r"fields \[\] differ from ForgetRequest's \['request_id'\]"),
    (b'{"op":"ReleaseReservation","fields":{"reservation_id":1,"x":2}}', "differ from ReleaseReservation's"),
    (b'{"op":"ReleaseReservation","fields":{"reservation_id":"1"}}', "reservation_id: expected int, got str"),
    (b'{"op":"ReleaseReservation","fields":{"reservation_id":true}}', "reservation_id: expected int, got bool"),
    (b'{"op":"ReleaseReservation","fields":{"reservation_id":1.5}}', "reservation_id: expected int, got float"),
    (b'{"op":"ReserveBlocks","fields":{"reservation_id":1,"request_id":"r","block_ids":[1,"2"],'
     b'"num_tokens":3,"ttl_s":1.0}}', r"block_ids\[1\]: expected int, got str"),
    (b'{"op":"ReserveBlocks","fields":{"reservation_id":1,"request_id":"r","block_ids":[1],'
     b'"num_tokens":3,"ttl_s":NaN}}', "NaN is not a number an op may carry"),
    (b'{"op":"KVSends","fields":{"entries":{}}}', "KVSends.entries: expected a list, got dict"),
    (b'{"op":"KVSends","fields":{"entries":[{"request_id":"r","endpoints":["a"],"reservation_id":1,'
     b'"first_block":0,"block_ids":[],"last":true}]}}', r"entries\[0\]: request r: first_block=0 .* 0 block ids"),
])
def test_malformed_ops_are_refused_with_the_reason(body, message):
    with pytest.raises(OpDecodeError, match=message):
        decode_op(body, ALL_OPS)


def test_encode_refuses_what_is_not_a_frozen_op():
    @dataclass
    class Mutable:
        x: int

    with pytest.raises(TypeError, match="must be an instance of a frozen dataclass"):
        encode_op(Mutable(1))
    with pytest.raises(TypeError, match="not an operation"):
        encode_op({"op": "sends"})
    with pytest.raises(ValueError, match="Out of range float values"):
        encode_op(ReserveBlocks(1, "r", (1,), 3, float("inf")))
    big = ForgetRequest("x" * MAX_OP_BYTES)
    with pytest.raises(ValueError, match=f"op ForgetRequest encodes to {MAX_OP_BYTES + 49} bytes: must be <= "):
        encode_op(big)


def test_call_result_names_each_failing_rank():
    result = CallResult("KVSends", (CallStatus.DONE, CallStatus.UNKNOWN_OP, CallStatus.DONE, CallStatus.REFUSED))
    assert not result.ok and result.failures() == "rank 1: unknown_op, rank 3: refused"
    assert CallResult("KVSends", (CallStatus.DONE, CallStatus.DONE)).ok


# -- over gloo: rank 0 and two followers, real processes ----------------------------------------------------

@dataclass(frozen=True)
class Echo:
    value: int


@dataclass(frozen=True)
class NobodyRunsThis:
    value: int


class EchoHooks(FollowerHooks):
    def __init__(self):
        self.seen: list[int] = []

    def handlers(self):
        return {Echo: self.echo}

    def echo(self, op: Echo) -> bool:
        if op.value == 13:
            raise ValueError("13 is unlucky")
        self.seen.append(op.value)
        return op.value > 0


def _rank(rank: int, size: int, init_method: str, results) -> None:
    import torch

    from engine import tp_runner

    group = tp_runner.init_group(rank, size, init_method, timeout_s=60)
    try:
        if rank == 0:
            statuses = [tp_runner.call_followers(op, group).statuses
                        for op in (Echo(1), Echo(0), Echo(13), NobodyRunsThis(1), Echo(2))]
            stop = torch.tensor([tp_runner.STOP] + [0] * (tp_runner._HEADER - 1), dtype=torch.int64)
            torch.distributed.broadcast(stop, src=0, group=group)
            results.put((0, statuses))
            return
        hooks = EchoHooks() if rank == 1 else FollowerHooks()  # rank 2 runs no operations at all
        while True:
            header = torch.empty(tp_runner._HEADER, dtype=torch.int64)
            torch.distributed.broadcast(header, src=0, group=group)
            if int(header[0]) == tp_runner.STOP:
                break
            assert int(header[0]) == tp_runner.CALL
            tp_runner._run_call(hooks, header, group)
        results.put((rank, getattr(hooks, "seen", None)))
    finally:
        torch.distributed.destroy_process_group()


def test_each_rank_runs_its_method_and_rank_0_learns_every_status():
    from engine.ports import pick_free_port

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{pick_free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, 3, init_method, results)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in procs)
    except queue.Empty:
        pytest.fail("a rank did not finish")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    D, R, F, U = CallStatus.DONE, CallStatus.REFUSED, CallStatus.FAILED, CallStatus.UNKNOWN_OP
    assert got[0] == [(D, D, U), (D, R, U), (D, F, U), (D, U, U), (D, D, U)]  # the ranks went on after each failure
    assert got[1] == [1, 0, 2]  # Echo(13) raised before recording; NobodyRunsThis never reached a method
    assert got[2] is None
    assert [p.exitcode for p in procs] == [0, 0, 0]


# -- a decode follower rank's hooks, with a real KVReceiver and a real sender ----------------------------------

def test_decode_rank_mirrors_reservations_and_commits_only_a_complete_shard():
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from decode_worker.tp_rank import FOLLOWER_TTL_MARGIN_S, DecodeRankHooks, kv_address_key
    from kvtransfer import KVLayout, KVSender
    from kvtransfer.reservation import COMMIT_LEASE_S

    def caches(seed: int):
        g = torch.Generator().manual_seed(seed)
        return [tuple(torch.randn(2, 16, 4, 8, generator=g) for _ in range(2)) for _ in range(3)]

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    recv_caches, send_caches = caches(1), caches(2)
    hooks = DecodeRankHooks.build(1, KVLayout.for_caches("tiny", recv_caches), recv_caches, store, "127.0.0.1",
                                  "127.0.0.1")
    sender = KVSender(KVLayout.for_caches("tiny", send_caches), send_caches)
    table = hooks.reservations

    def run(op) -> bool:
        decoded = decode_op(encode_op(op), hooks.handlers())
        return hooks.handlers()[type(decoded)](decoded)

    try:
        endpoint = store.get(kv_address_key(1)).decode()
        assert endpoint == f"127.0.0.1:{hooks.receiver.port}"
        assert run(ReserveBlocks(41, "r1", (11, 2, 7), 10, 30.0))
        assert run(ReserveBlocks(42, "r2", (5,), 3, 30.0))
        assert run(ReserveBlocks(43, "r3", (6, 9), 8, 30.0))
        assert len(table) == 3
        sender.send(endpoint, 41, 0, 3, 0, [3, 8, 1]).result(timeout=10)
        complete = table.wait_complete(41, timeout_s=5)
        assert complete.block_ids == [11, 2, 7] and complete.num_tokens == 10
        assert COMMIT_LEASE_S + FOLLOWER_TTL_MARGIN_S - 5 < complete.expires_at_s - time.monotonic()
        assert run(CommitReservation(41))
        for layer in range(3):
            for kv in range(2):
                assert torch.equal(recv_caches[layer][kv][:, [11, 2, 7]], send_caches[layer][kv][:, [3, 8, 1]])
        assert not run(CommitReservation(42))  # no KV arrived here: refused, and gone
        assert run(ReleaseReservation(43))
        assert len(table) == 0
        assert not run(CommitReservation(43))  # released: nothing to commit
        with pytest.raises(UnknownOp, match=r"op='ForgetRequest' is unknown here: this rank runs "
                                            r"\['CommitReservation', 'ReleaseReservation', 'ReserveBlocks'\]"):
            decode_op(encode_op(ForgetRequest("r1")), hooks.handlers())
    finally:
        sender.close()
        hooks.close()
