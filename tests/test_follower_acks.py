"""Tensor-parallel prefill followers' reports reach rank 0 pushed over a loopback connection: a request's future
resolves once every rank reported, fails with the lowest failing rank's error (the class it failed with), times
out, fails when a rank's connection closes, and a report nobody waits for (an aborted request) leaves nothing
behind, in particular no key in the worker's TCPStore."""

from __future__ import annotations

import time
from concurrent.futures import Future
from datetime import timedelta

import pytest
import torch.distributed as dist

from engine.follower_ops import decode_op, encode_op
from kvtransfer.errors import ChecksumMismatch, PeerGone, TransferError, TransferTimeout
from kvtransfer.layout import KVLayout, LayerShape
from prefill_worker.follower_acks import ACK_ADDRESS_KEY, AckReporter, FollowerAcks
from prefill_worker.tp_ops import ForgetRequest, KVSendEntry, KVSends
from prefill_worker.tp_rank import PrefillRankHooks


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield master


def reporter(store, rank: int) -> AckReporter:
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    return AckReporter(client, rank, timeout_s=10)


@pytest.fixture
def acks(store):
    acks = FollowerAcks(store, [1, 2])
    yield acks
    acks.close()


def test_resolves_once_every_rank_reported(store, acks):
    assert store.get(ACK_ADDRESS_KEY).decode() == acks.address
    r1, r2 = reporter(store, 1), reporter(store, 2)
    a, b = acks.expect("a"), acks.expect("b")
    r2.report("a", None)
    r1.report("b", None)
    r1.report("a", None)
    assert a.result(timeout=5) is None
    assert not b.done()
    r2.report("b", None)
    assert b.result(timeout=5) is None
    assert acks.num_pending == 0


def test_fails_with_the_lowest_failing_ranks_error_once_all_reported(store, acks):
    r1, r2 = reporter(store, 1), reporter(store, 2)
    both, second, odd = acks.expect("both"), acks.expect("second"), acks.expect("odd")
    r2.report("both", ChecksumMismatch("payload changed"))
    r2.report("second", ChecksumMismatch("payload changed"))
    r1.report("second", None)
    with pytest.raises(ChecksumMismatch, match=r"^TP rank 2: payload changed$"):
        second.result(timeout=5)
    assert not both.done()  # rank 1 has not reported yet
    r1.report("both", PeerGone("decode rank 1 went away"))
    with pytest.raises(PeerGone, match=r"^TP rank 1: decode rank 1 went away$"):
        both.result(timeout=5)
    r1.report("odd", ValueError("boom"))  # not a transfer error: a TransferError naming its class, as before
    r2.report("odd", None)
    with pytest.raises(TransferError, match=r"^ValueError: TP rank 1: boom$") as e:
        odd.result(timeout=5)
    assert type(e.value) is TransferError


def test_a_report_nobody_waits_for_is_dropped_and_the_store_keeps_nothing(store):
    acks = FollowerAcks(store, [1])
    r1 = reporter(store, 1)
    keys = store.num_keys()
    aborted, later = acks.expect("aborted"), acks.expect("later")
    acks.forget("aborted")  # the request was aborted after its last send: its report is on the way
    r1.report("aborted", None)
    r1.report("never-expected", None)
    r1.report("later", None)  # same connection, in order: the two before it were read and dropped
    assert later.result(timeout=5) is None
    assert not aborted.done() and acks.num_pending == 0
    assert store.num_keys() == keys
    acks.close()


def test_times_out_without_polling(store):
    acks = FollowerAcks(store, [1], timeout_s=0.3)
    start = time.monotonic()
    future = acks.expect("slow")
    with pytest.raises(TransferTimeout, match=r"^request slow: a TP follower rank did not report its KV shard sent "
                                              r"in 0.3 s$"):
        future.result(timeout=5)
    assert 0.3 <= time.monotonic() - start < 2.0
    late = reporter(store, 1)
    late.report("slow", None)  # arrives after the deadline: dropped
    fresh = acks.expect("fresh")
    late.report("fresh", None)
    assert fresh.result(timeout=5) is None
    acks.close()


def test_a_rank_whose_connection_closes_fails_what_waits_for_it(store, acks):
    r1, r2 = reporter(store, 1), reporter(store, 2)
    r1.report("hello", None)  # connected (a report nobody waits for)
    waiting_on_1 = acks.expect("w")
    r1.close()
    with pytest.raises(PeerGone, match=r"^request w: TP rank 1's report connection closed$"):
        waiting_on_1.result(timeout=5)
    r2.report("w", None)  # rank 2 is unaffected
    assert acks.num_pending == 0


def test_close_fails_what_is_pending_and_stops_its_threads(store):
    acks = FollowerAcks(store, [1])
    r1 = reporter(store, 1)
    r1.report("hello", None)
    pending = acks.expect("p")
    acks.close()
    with pytest.raises(TransferError, match="^prefill worker stopped$"):
        pending.result(timeout=1)
    assert not any(t.is_alive() for t in acks._threads)
    acks.close()  # idempotent


class FakeSender:
    """KVSender's surface PrefillRankHooks uses; each send's future is resolved by the test."""

    def __init__(self, num_layers: int):
        self.layout = KVLayout("tiny", "float32", 16, (LayerShape(num_layers, 2, 16),))
        self.sends: list[tuple] = []
        self.futures: list[Future] = []
        self.closed = False

    def send(self, endpoint, reservation_id, layer_start, layer_end, block_start, src_block_ids) -> Future:
        self.sends.append((endpoint, reservation_id, layer_start, layer_end, block_start, src_block_ids))
        self.futures.append(Future())
        return self.futures[-1]

    def close(self) -> None:
        self.closed = True


def run_step(hooks: PrefillRankHooks, entries: tuple[KVSendEntry, ...], num_layers: int) -> None:
    """What rank 1 does for one CALL KVSends and the STEP after it."""
    op = decode_op(encode_op(KVSends(entries)), hooks.handlers())
    assert hooks.handlers()[type(op)](op)
    on_layer_done = hooks.layer_callback()
    for layer in range(num_layers):
        on_layer_done(layer)
    hooks.after_step()


def test_prefill_rank_ships_its_shard_per_layer_group_and_reports_each_requests_outcome(store):
    acks = FollowerAcks(store, [1])
    sender = FakeSender(num_layers=4)
    hooks = PrefillRankHooks(1, sender, reporter(store, 1), layer_group_size=2)
    a, b = acks.expect("a"), acks.expect("b")
    first = KVSendEntry("a", ("d0:1", "d1:1"), 7, 0, (3, 4), last=False)
    run_step(hooks, (first, KVSendEntry("b", ("d0:2", "d1:2"), 8, 0, (5,), last=True)), 4)
    assert sender.sends == [("d1:1", 7, 0, 2, 0, [3, 4]), ("d1:2", 8, 0, 2, 0, [5]),
                            ("d1:1", 7, 2, 4, 0, [3, 4]), ("d1:2", 8, 2, 4, 0, [5])]
    assert hooks.layer_callback() is None  # the sends were for that step only
    for f in sender.futures:
        f.set_result(None)
    assert b.result(timeout=5) is None and not a.done()
    run_step(hooks, (KVSendEntry("a", ("d0:1", "d1:1"), 7, 2, (9,), last=True),), 4)
    assert sender.sends[4:] == [("d1:1", 7, 0, 2, 2, [9]), ("d1:1", 7, 2, 4, 2, [9])]
    sender.futures[4].set_result(None)
    assert not a.done()  # one of its messages is still unacknowledged
    sender.futures[5].set_exception(ChecksumMismatch("block 9 changed"))
    with pytest.raises(ChecksumMismatch, match="^TP rank 1: block 9 changed$"):
        a.result(timeout=5)
    # rank 0 aborts c mid-prompt: forgotten on both sides, so its later last step reports nothing
    c, later = acks.expect("c"), acks.expect("later")
    run_step(hooks, (KVSendEntry("c", ("d0:3", "d1:3"), 9, 0, (1,), last=False),), 4)
    acks.forget("c")
    forget = decode_op(encode_op(ForgetRequest("c")), hooks.handlers())
    assert hooks.handlers()[ForgetRequest](forget)
    assert hooks._requests == {}
    run_step(hooks, (KVSendEntry("later", ("d0:4", "d1:4"), 10, 0, (2,), last=True),), 4)
    for f in sender.futures[6:]:
        f.set_result(None)
    assert later.result(timeout=5) is None and not c.done() and acks.num_pending == 0
    hooks.close()
    assert sender.closed
    acks.close()


def test_layer_groups_never_mix_the_target_and_the_draft():
    """Groups of up to 4 layers, counted from each model's first: the target's last layers ship once its forward wrote
    them (not after the draft's first), and one message carries one cache shape."""
    from prefill_worker.tp_rank import layer_group_callback

    shipped = []
    on_layer_done = layer_group_callback([6, 5], 4, lambda start, end: shipped.append((start, end)))
    for layer in range(11):
        on_layer_done(layer)
    assert shipped == [(0, 4), (4, 6), (6, 10), (10, 11)]
