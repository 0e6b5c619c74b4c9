"""kvtransfer over real sockets and real gloo groups, with senders in this process and in child processes."""

import dataclasses
import multiprocessing as mp
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvtransfer import (
    ChecksumMismatch,
    KVLayout,
    KVReceiver,
    KVSender,
    LayerShape,
    LayoutMismatch,
    PeerGone,
    ProtocolError,
    ReservationExpired,
    ReservationTable,
    TransferError,
    TransferTimeout,
    block_copy,
)
from kvtransfer import messages as m
from kvtransfer import process_group as pgs

L, H, N, BS, HD = 3, 2, 16, 4, 8
DST = [11, 2, 7, 5]  # the receiver's reserved blocks, in block-table order
SRC = [3, 8, 1, 14]  # the same prompt's blocks in the sender's cache


def make_caches(seed: int, dtype=torch.float32, block_size: int = BS):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(H, N, block_size, HD, generator=g).to(dtype) for _ in range(2)) for _ in range(L)]


DL, DH, DHD = 2, 1, 4  # a draft model's cache: fewer layers, KV heads and a smaller head_dim than the target's


def make_draft_caches(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(DH, N, BS, DHD, generator=g).to(dtype) for _ in range(2)) for _ in range(DL)]


def snapshot(caches):
    return [tuple(t.clone() for t in pair) for pair in caches]


def assert_transferred(recv_caches, before, send_caches, dst=DST, src=SRC):
    """dst blocks hold the sender's src blocks exactly; every other receiver block is unchanged."""
    others = [b for b in range(N) if b not in dst]
    for layer in range(L):
        for kv in range(2):
            assert torch.equal(recv_caches[layer][kv][:, dst], send_caches[layer][kv][:, src])
            assert torch.equal(recv_caches[layer][kv][:, others], before[layer][kv][:, others])


@pytest.fixture
def make_receiver():
    made = []

    def make(dtype=torch.float32, **kwargs):
        caches = make_caches(100, dtype)
        layout = KVLayout.for_caches("tiny", caches)
        table = ReservationTable(L)
        receiver = KVReceiver(layout, caches, table, **kwargs)
        receiver.start()
        made.append(receiver)
        return receiver, caches, table

    yield make
    for receiver in made:
        receiver.close()


@pytest.fixture
def make_sender():
    made = []

    def make(dtype=torch.float32, seed=1, **kwargs):
        caches = make_caches(seed, dtype)
        sender = KVSender(KVLayout.for_caches("tiny", caches), caches, **kwargs)
        made.append(sender)
        return sender, caches

    yield make
    for sender in made:
        sender.close()


# -- layout ----------------------------------------------------------------------------------------------


def test_layout_fingerprint_dict_and_mismatch():
    a = KVLayout("llama", "float32", 16, (LayerShape(2, 4, 64),))
    assert KVLayout.from_dict(a.to_dict()) == a and a.fingerprint() == KVLayout.from_dict(a.to_dict()).fingerprint()
    for field, value in [("model_id", "qwen"), ("dtype", "bfloat16"), ("block_size", 32)]:
        b = dataclasses.replace(a, **{field: value})
        assert b.fingerprint() != a.fingerprint()
        assert a.mismatch(b) == f"{field}: sender {getattr(a, field)} != receiver {value}"
    for field, value in [("num_layers", 3), ("num_kv_heads", 8), ("head_dim", 128)]:
        b = KVLayout("llama", "float32", 16, (dataclasses.replace(a.shapes[0], **{field: value}),))
        assert b.fingerprint() != a.fingerprint()
        assert a.mismatch(b) == f"target {field}: sender {getattr(a.shapes[0], field)} != receiver {value}"
    tp2 = dataclasses.replace(a, tp_size=2)
    assert a.mismatch(tp2) == ("TP sizes differ (sender tp_size=1, receiver tp_size=2): KV moves rank to rank, so "
                               "prefill and decode workers need the same --tp; tp_size: sender 1 != receiver 2")
    tp2_rank1 = dataclasses.replace(a, tp_size=2, tp_rank=1)
    assert tp2.mismatch(tp2_rank1) == "tp_rank: sender 0 != receiver 1"
    assert len({a.fingerprint(), tp2.fingerprint(), tp2_rank1.fingerprint()}) == 3
    with pytest.raises(ValueError, match=r"tp_rank=2 is invalid: must be an int in \[0, 2\)"):
        KVLayout("m", "float32", 16, (LayerShape(2, 4, 64),), tp_size=2, tp_rank=2)
    c = KVLayout("llama", "bfloat16", 32, (LayerShape(2, 4, 64),))
    assert a.mismatch(c) == "dtype: sender float32 != receiver bfloat16; block_size: sender 16 != receiver 32"
    assert a.mismatch(a) is None
    assert KVLayout.for_caches("tiny", make_caches(0, torch.float16)) == \
        KVLayout("tiny", "float16", BS, (LayerShape(L, H, HD),))
    with pytest.raises(ValueError, match="dtype='int8' is invalid"):
        KVLayout("m", "int8", 16, (LayerShape(2, 4, 64),))
    with pytest.raises(ValueError, match="unknown fields \\['extra'\\]"):
        KVLayout.from_dict({**a.to_dict(), "extra": 1})
    with pytest.raises(ValueError, match="layout shapes=.* is invalid: must be a list of objects with the fields "
                                         "\\['head_dim', 'num_kv_heads', 'num_layers'\\]"):
        KVLayout.from_dict({**a.to_dict(), "shapes": [{"num_layers": 2}]})
    with pytest.raises(ValueError, match="head_dim=0 is invalid: must be an int >= 1"):
        KVLayout.from_dict({**a.to_dict(), "shapes": [{"num_layers": 2, "num_kv_heads": 4, "head_dim": 0}]})


def test_a_layout_with_a_draft_of_another_shape():
    """The draft's layers follow the target's, in their own shape: sizes per layer, a fingerprint that changes with
    the draft's shape, a dict round trip, and mismatches that name the model and the field."""
    target, draft = LayerShape(3, 2, 8), LayerShape(1, 1, 4)
    a = KVLayout("tiny", "float32", 4, (target, draft), draft="d:none")
    assert a.num_layers == 4 and a.shape_of(2) == target and a.shape_of(3) == draft
    assert [a.layer_block_bytes(i) for i in range(4)] == [2 * 4 * 8 * 4] * 3 + [1 * 4 * 4 * 4]
    assert a.payload_bytes(2, 4, 5) == 2 * 5 * (256 + 64)
    assert [tuple(v.shape) for v in a.payload_views(torch.empty(a.payload_bytes(2, 4, 5), dtype=torch.uint8), 2, 4,
                                                    5)] == [(2, 2, 5, 4, 8), (2, 1, 5, 4, 4)]
    assert KVLayout.from_dict(a.to_dict()) == a
    fingerprints = {a.fingerprint()}
    for other in [LayerShape(2, 1, 4), LayerShape(1, 2, 4), LayerShape(1, 1, 8)]:
        b = KVLayout("tiny", "float32", 4, (target, other), draft="d:none")
        fingerprints.add(b.fingerprint())
        (field,) = [f for f in ("num_layers", "num_kv_heads", "head_dim") if getattr(other, f) != getattr(draft, f)]
        assert a.mismatch(b) == f"draft {field}: sender {getattr(draft, field)} != receiver {getattr(other, field)}"
    assert len(fingerprints) == 4
    plain = KVLayout("tiny", "float32", 4, (target,))
    assert a.mismatch(plain) == ("draft models differ (sender d:none, receiver none): the draft's KV travels with the "
                                 "target's, so prefill and decode workers need the same draft_model "
                                 "--speculative-config; draft: sender d:none != receiver ; draft layers: sender 1 "
                                 "layers x 1 KV heads x head_dim 4 != receiver none")
    with pytest.raises(ValueError, match=r"shapes=.* is invalid: must be a tuple of 2 LayerShape, one per model "
                                         r"\(target and draft\)"):
        KVLayout("tiny", "float32", 4, (target,), draft="d:none")
    target_caches, draft_caches = make_caches(0), make_draft_caches(1)
    assert KVLayout.for_caches("tiny", target_caches, draft="d:none", draft_caches=draft_caches) == \
        KVLayout("tiny", "float32", BS, (LayerShape(L, H, HD), LayerShape(DL, DH, DHD)), draft="d:none")
    layout = KVLayout.for_caches("tiny", target_caches, draft="d:none", draft_caches=draft_caches)
    layout.check_caches(target_caches + draft_caches)
    with pytest.raises(ValueError, match=r"kv_caches has 3 layers: the layout has 5 \(3 target \+ 2 draft\)"):
        layout.check_caches(target_caches)
    wide = [tuple(torch.zeros(DH, N, BS, 2 * DHD) for _ in range(2)) for _ in range(DL)]
    with pytest.raises(ValueError, match="kv_caches do not match the layout: draft head_dim: caches 8 != layout 4"):
        layout.check_caches(target_caches + wide)


# -- reservation table -----------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self):
        return self.now_s


def test_reservation_ids_ranges_completion_and_pop():
    table = ReservationTable(2, clock=FakeClock())
    ids = [table.add(f"r{i}", [i], 4, 10.0).reservation_id for i in range(100)]
    assert len(set(ids)) == 100 and all(0 < i < 2**53 for i in ids)
    # unguessable: no id follows from another (a counter would give 99 differences of 1)
    assert not any(abs(a - b) < 2**20 for a, b in zip(ids, ids[1:]))
    for i in ids:
        table.pop(i)
    assert table.add("again", [0], 4, 10.0).reservation_id not in ids
    r = table.add("req", [5, 6, 7], 12, 10.0)
    writes = []
    for bad in [(0, 3, 0, 1), (1, 1, 0, 1), (0, 1, 2, 2), (0, 1, -1, 1), (0, 1, 0, 0)]:
        with pytest.raises(ValueError, match="invalid"):
            table.write(r.reservation_id, *bad, writes.append)
    assert writes == []
    table.write(r.reservation_id, 0, 2, 0, 2, writes.append)
    table.write(r.reservation_id, 0, 2, 1, 1, writes.append)  # a rewrite counts once
    table.write(r.reservation_id, 0, 1, 2, 1, writes.append)
    assert writes == [[5, 6], [6], [7]] and (r.num_received, r.complete) == (5, False)
    table.write(r.reservation_id, 1, 2, 2, 1, writes.append)
    assert r.complete and table.wait_complete(r.reservation_id, 0.1) is r
    assert table.pop(r.reservation_id) is r and table.pop(r.reservation_id) is None
    with pytest.raises(ReservationExpired, match="unknown or was released"):
        table.write(r.reservation_id, 0, 1, 0, 1, writes.append)
    with pytest.raises(ValueError, match="distinct"):
        table.add("dup", [1, 1], 4, 1.0)
    # a tensor-parallel follower rank mirrors rank 0's ids
    assert table.add("mirror", [9], 4, 1.0, reservation_id=ids[0]).reservation_id == ids[0]
    with pytest.raises(ValueError, match=f"reservation_id={ids[0]} is invalid: already in the table"):
        table.add("mirror2", [10], 4, 1.0, reservation_id=ids[0])
    with pytest.raises(ValueError, match="reservation_id=0 is invalid: must be an int >= 1"):
        table.add("zero", [10], 4, 1.0, reservation_id=0)


def test_reservation_expiry():
    clock = FakeClock()
    table = ReservationTable(1, clock=clock, complete_grace_s=10.0)
    late, done = table.add("late", [1, 2], 8, 5.0), table.add("done", [3], 4, 5.0)
    table.write(done.reservation_id, 0, 1, 0, 1, lambda ids: None)
    clock.now_s += 5.0
    with pytest.raises(ReservationExpired, match="expired"):
        table.write(late.reservation_id, 0, 1, 0, 1, lambda ids: pytest.fail("wrote into an expired reservation"))
    with pytest.raises(ReservationExpired):
        table.wait_complete(late.reservation_id, 1.0)
    assert table.pop_expired() == [late] and table.pop_expired() == []  # the complete one has its grace period
    assert len(table) == 1 and table.pop(late.reservation_id) is None
    clock.now_s += 10.0  # a commit that never comes: the complete reservation expires too, its blocks freed
    assert table.pop_expired() == [done] and len(table) == 0
    # completion turns even a long reservation into the short commit lease
    long = table.add("long", [4], 4, 600.0)
    table.write(long.reservation_id, 0, 1, 0, 1, lambda ids: None)
    assert long.expires_at_s == clock.now_s + 10.0


def test_reservation_waits_fail_and_pop_during_write():
    table = ReservationTable(1)
    r = table.add("req", [1, 2], 8, 30.0)
    started = time.monotonic()
    with pytest.raises(TransferTimeout, match="0/2"):
        table.wait_complete(r.reservation_id, 0.1)
    assert 0.1 <= time.monotonic() - started < 1.0
    in_write, release = threading.Event(), threading.Event()
    writer = threading.Thread(target=table.write,
                              args=(r.reservation_id, 0, 1, 0, 1, lambda ids: (in_write.set(), release.wait())))
    writer.start()
    in_write.wait()
    popper = threading.Thread(target=table.pop, args=(r.reservation_id,))
    popper.start()
    popper.join(0.2)
    assert popper.is_alive()  # pop waits for the write in progress: afterwards no write can land
    release.set()
    writer.join()
    popper.join(1.0)
    assert not popper.is_alive() and r.popped
    r2 = table.add("req2", [3], 4, 30.0)
    threading.Timer(0.05, table.fail, args=(r2.reservation_id, "bad bytes", ChecksumMismatch)).start()
    with pytest.raises(ChecksumMismatch, match="bad bytes"):
        table.wait_complete(r2.reservation_id, 5.0)


# -- block copies ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,block_size,head_dim", [(torch.float16, 4, 8), (torch.bfloat16, 1, 3),
                                                       (torch.float32, 3, 5)])
def test_block_copy_matches_plain_index_ops(dtype, block_size, head_dim):
    """The int64-word fast path (and its fallback for rows that are not whole words) against the reference."""
    g = torch.Generator().manual_seed(0)
    caches = [tuple(torch.randn(H, N, block_size, head_dim, generator=g).to(dtype) for _ in range(2))
              for _ in range(L)]
    ids = torch.tensor([5, 0, 9])
    out = torch.empty(2, 2, H, 3, block_size, head_dim, dtype=dtype)
    block_copy.gather(caches, 1, 3, ids, out)
    for i in range(2):
        for kv in range(2):
            assert torch.equal(out[i, kv], caches[1 + i][kv].index_select(1, ids))
    expected = snapshot(caches)
    for i in range(2):
        for kv in range(2):
            expected[1 + i][kv].index_copy_(1, torch.tensor([1, 2, 3]), out[i, kv])
    block_copy.scatter(caches, 1, 3, torch.tensor([1, 2, 3]), out)
    assert all(torch.equal(a, b) for pa, pb in zip(caches, expected) for a, b in zip(pa, pb))


def test_staging_pool_reuses_the_smallest_fit():
    pool = block_copy.StagingPool(max_idle_bytes=300)
    small, big = pool.take(100), pool.take(200)
    pool.give(small), pool.give(big)
    assert pool.take(150) is big and pool.take(50) is small and pool.take(50) is not small
    pool.give(pool.take(301))  # over the idle limit: dropped
    assert pool.take(301).numel() == 301


# -- wire format -----------------------------------------------------------------------------------------


def test_frames_round_trip_and_limits():
    a, b = (m.open_socket(s) for s in socket.socketpair())
    payload = bytes(range(256)) * 4
    deadline = time.monotonic() + 5
    m.send_all(a, m.encode_frame_header(m.WRITE, {"seq": 7}, len(payload), m.payload_checksum(payload)) + payload,
               deadline)
    frame = m.recv_frame_header(b, deadline)
    got = bytearray(frame.inline_payload_bytes)
    m.recv_into(b, memoryview(got), deadline)
    assert (frame.kind, frame.meta, bytes(got), frame.checksum) == (m.WRITE, {"seq": 7}, payload,
                                                                     m.payload_checksum(payload))
    m.send_all(a, m.encode_frame_header(m.WRITE, {"seq": 8}, 1 << 40), deadline)
    with pytest.raises(ProtocolError, match=f"payload of {1 << 40} bytes exceeds the limit of 1000 bytes"):
        m.recv_frame_header(b, deadline, max_payload_bytes=1000)
    a.close(), b.close()  # a refused frame leaves the stream unreadable: the connection must go
    a, b = (m.open_socket(s) for s in socket.socketpair())
    m.send_all(a, m.encode_frame_header(m.ACK, {"pad": "x" * 100}), deadline)
    with pytest.raises(ProtocolError, match="exceeds the limit of 64 bytes"):
        m.recv_frame_header(b, deadline, max_json_bytes=64)
    a.send(b"HTTP/1.1 200 OK\r\n" * 2)
    with pytest.raises(ProtocolError, match="bad magic"):
        m.recv_frame_header(b, deadline)
    a.close(), b.close()


# -- transfers -------------------------------------------------------------------------------------------


def send_prompt(sender, address, table, reservation_id):
    """Two layer groups; the second split in two block ranges. Returns the futures in order."""
    r = table._reservations[reservation_id]
    sender.send(address, reservation_id, 0, 2, 0, SRC).result(10)
    assert (r.num_received, r.complete) == (2 * len(DST), False)
    sender.send(address, reservation_id, 2, 3, 0, SRC[:2]).result(10)
    assert not r.complete
    sender.send(address, reservation_id, 2, 3, 2, SRC[2:]).result(10)
    assert r.complete


@pytest.mark.parametrize("transport,dtype", [("tcp", torch.float32), ("tcp", torch.float16), ("tcp", torch.bfloat16),
                                             ("torch", torch.float32), ("torch", torch.float16)])
def test_round_trip(make_receiver, make_sender, transport, dtype):
    receiver, recv_caches, table = make_receiver(dtype)
    sender, send_caches = make_sender(dtype, transport=transport, checksum=dtype == torch.float16)
    before = snapshot(recv_caches)
    r = table.add("req-1", DST, 4 * BS - 1, ttl_s=30.0)
    send_prompt(sender, receiver.address, table, r.reservation_id)
    assert table.wait_complete(r.reservation_id, 1.0) is r and table.pop(r.reservation_id) is r
    assert_transferred(recv_caches, before, send_caches)


@pytest.mark.parametrize("transport,dtype", [("tcp", torch.float16), ("torch", torch.float32)])
def test_a_draft_of_another_shape_travels_after_the_target(transport, dtype):
    """Target layers [0, 3) and a smaller draft's [3, 5) in one numbering: a message of the target's last layer and
    the draft's first (two shapes in one payload), then the draft's last, land byte for byte in the reserved
    blocks of both models' caches; a receiver whose draft has another shape refuses the handshake, naming it."""
    send_target, send_draft = make_caches(1, dtype), make_draft_caches(2, dtype)
    recv_target, recv_draft = make_caches(3, dtype), make_draft_caches(4, dtype)
    send_caches, recv_caches = send_target + send_draft, recv_target + recv_draft
    layout = KVLayout.for_caches("tiny", recv_target, draft="d:none", draft_caches=recv_draft)
    table = ReservationTable(layout.num_layers)
    receiver = KVReceiver(layout, recv_caches, table)
    receiver.start()
    sender = KVSender(KVLayout.for_caches("tiny", send_target, draft="d:none", draft_caches=send_draft), send_caches,
                      transport=transport, checksum=True)
    narrow_caches = send_target + [tuple(t[:, :, :, :2].contiguous() for t in pair) for pair in send_draft]
    narrow = KVSender(KVLayout.for_caches("tiny", send_target, draft="d:none", draft_caches=narrow_caches[L:]),
                      narrow_caches)
    try:
        before = snapshot(recv_caches)
        r = table.add("req", DST, 16, 30.0)
        sender.send(receiver.address, r.reservation_id, 0, 2, 0, SRC).result(10)
        sender.send(receiver.address, r.reservation_id, 2, 4, 0, SRC).result(10)
        assert not r.complete
        sender.send(receiver.address, r.reservation_id, 4, 5, 0, SRC).result(10)
        assert r.complete
        others = [b for b in range(N) if b not in DST]
        for layer in range(L + DL):
            for kv in range(2):
                assert torch.equal(recv_caches[layer][kv][:, DST], send_caches[layer][kv][:, SRC])
                assert torch.equal(recv_caches[layer][kv][:, others], before[layer][kv][:, others])
        with pytest.raises(LayoutMismatch, match="draft head_dim: sender 2 != receiver 4"):
            narrow.connect(receiver.address)
    finally:
        sender.close()
        narrow.close()
        receiver.close()


def test_pipelined_sends_from_two_senders_at_once(make_receiver, make_sender):
    """Many unacked messages per channel and two channels writing concurrently, each into its own reservation."""
    receiver, recv_caches, table = make_receiver()
    senders = [make_sender(seed=1, transport="tcp", checksum=True), make_sender(seed=2, transport="torch")]
    before = snapshot(recv_caches)
    dsts = [[0, 1, 2, 3, 4, 5], [15, 14, 13, 12, 11, 10]]
    srcs = [[9, 8, 7, 6, 5, 4], [0, 2, 4, 6, 8, 10]]
    reservations = [table.add(f"req-{i}", dst, 24, 30.0) for i, dst in enumerate(dsts)]
    futures = []

    def send_all_groups(i):
        sender, _ = senders[i]
        for layer in range(L):
            for b in range(0, 6, 2):  # one message per (layer, 2 blocks): 9 in flight at once
                futures.append(sender.send(receiver.address, reservations[i].reservation_id, layer, layer + 1, b,
                                           srcs[i][b : b + 2]))

    threads = [threading.Thread(target=send_all_groups, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for future in futures:
        future.result(10)
    for i in range(2):
        assert table.wait_complete(reservations[i].reservation_id, 1.0).complete
        for layer in range(L):
            for kv in range(2):
                assert torch.equal(recv_caches[layer][kv][:, dsts[i]], senders[i][1][layer][kv][:, srcs[i]])
    untouched = [b for b in range(N) if b not in dsts[0] + dsts[1]]
    assert all(torch.equal(recv_caches[layer][kv][:, untouched], before[layer][kv][:, untouched])
               for layer in range(L) for kv in range(2))


def _child_send(address: str, reservation_id: int, transport: str) -> None:
    """Runs in a spawned process: the sender's caches come from the same seed the parent uses to check."""
    caches = make_caches(1)
    sender = KVSender(KVLayout.for_caches("tiny", caches), caches, transport=transport, checksum=True)
    futures = [sender.send(address, reservation_id, 0, 2, 0, SRC), sender.send(address, reservation_id, 2, 3, 0, SRC)]
    for future in futures:
        future.result(20)
    sender.close()


def test_gloo_between_two_processes(make_receiver):
    receiver, recv_caches, table = make_receiver()
    before = snapshot(recv_caches)
    r = table.add("req-1", DST, 4 * BS, ttl_s=60.0)
    child = mp.get_context("spawn").Process(target=_child_send, args=(receiver.address, r.reservation_id, "torch"))
    child.start()
    table.wait_complete(r.reservation_id, 30.0)
    child.join(30)
    assert child.exitcode == 0
    assert_transferred(recv_caches, before, make_caches(1))


def test_layout_mismatch_refused_at_handshake(make_receiver, make_sender):
    receiver, recv_caches, table = make_receiver(torch.float32)
    wrong_dtype, _ = make_sender(torch.bfloat16)
    with pytest.raises(LayoutMismatch, match="dtype: sender bfloat16 != receiver float32"):
        wrong_dtype.connect(receiver.address)
    caches = make_caches(1, block_size=2 * BS)
    wrong_block = KVSender(KVLayout.for_caches("tiny", caches), caches)
    future = wrong_block.send(receiver.address, 1, 0, 1, 0, [0])
    with pytest.raises(LayoutMismatch, match="block_size: sender 8 != receiver 4"):
        future.result(5)
    wrong_block.close()
    tp1_caches = make_caches(1)  # the receiver is one rank of two; this sender runs without TP
    receiver_tp2 = KVReceiver(KVLayout.for_caches("tiny", recv_caches, tp_size=2), recv_caches, table)
    receiver_tp2.start()
    try:
        sender_tp1 = KVSender(KVLayout.for_caches("tiny", tp1_caches), tp1_caches)
        with pytest.raises(LayoutMismatch, match=r"TP sizes differ \(sender tp_size=1, receiver tp_size=2\)"):
            sender_tp1.connect(receiver_tp2.address)
        sender_tp1.close()
    finally:
        receiver_tp2.close()
    for hello, error in [({"transport": "rdma"}, "transport 'rdma' is unsupported: allowed ['tcp', 'torch']"),
                         ({"fingerprint": "0"}, "fingerprint does not match")]:
        sock = m.open_socket(socket.create_connection(m.split_endpoint(receiver.address)))
        hello = {"layout": receiver.layout.to_dict(), "fingerprint": receiver.layout.fingerprint(),
                 "transport": "tcp", **hello}
        m.send_all(sock, m.encode_frame_header(m.HELLO, hello), time.monotonic() + 5)
        reply = m.recv_frame_header(sock, time.monotonic() + 5)
        assert reply.kind == m.HELLO_REPLY and not reply.meta["ok"] and error in reply.meta["message"]
        sock.close()
    good, send_caches = make_sender()
    before = snapshot(recv_caches)
    r = table.add("req", DST, 16, 30.0)
    send_prompt(good, receiver.address, table, r.reservation_id)
    assert_transferred(recv_caches, before, send_caches)


@pytest.mark.parametrize("transport", ["tcp", "torch"])
def test_expired_and_popped_reservations_refused(make_receiver, make_sender, transport):
    receiver, recv_caches, table = make_receiver()
    sender, send_caches = make_sender(transport=transport)
    before = snapshot(recv_caches)
    expired = table.add("late", DST, 16, ttl_s=0.01)
    popped = table.add("gone", DST, 16, ttl_s=30.0)
    table.pop(popped.reservation_id)
    time.sleep(0.02)
    for r in (expired, popped):
        with pytest.raises(ReservationExpired, match=str(r.reservation_id)):
            sender.send(receiver.address, r.reservation_id, 0, 3, 0, SRC).result(5)
    assert_transferred(recv_caches, before, before, dst=[], src=[])  # untouched
    live = table.add("live", DST, 16, ttl_s=30.0)  # the same channel keeps working
    send_prompt(sender, receiver.address, table, live.reservation_id)


class CorruptingProxy:
    """Forwards a sender's frames to a receiver, flipping the first payload byte of every WRITE."""

    def __init__(self, upstream: str):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.upstream = upstream
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        client, _ = self.listener.accept()
        self.listener.close()
        server = socket.create_connection(m.split_endpoint(self.upstream))
        client, server = m.open_socket(client), m.open_socket(server)
        threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()
        try:
            while True:
                frame = m.recv_frame_header(client, None)
                payload = bytearray(frame.inline_payload_bytes)
                m.recv_into(client, memoryview(payload), time.monotonic() + 5)
                if frame.kind == m.WRITE:
                    payload[0] ^= 0xFF
                header = m.encode_frame_header(frame.kind, frame.meta, frame.payload_bytes, frame.checksum)
                m.send_all(server, header + payload, time.monotonic() + 5)
        except TransferError:
            server.close()

    @staticmethod
    def _pipe(src, dst):
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        dst.close()


@pytest.mark.parametrize("checksum", [True, False])
def test_checksum_detects_corruption_in_flight(make_receiver, make_sender, checksum):
    receiver, recv_caches, table = make_receiver()
    sender, send_caches = make_sender(checksum=checksum)
    before = snapshot(recv_caches)
    r = table.add("req", DST, 16, 30.0)
    proxy = CorruptingProxy(receiver.address)
    future = sender.send(proxy.address, r.reservation_id, 0, 3, 0, SRC)
    if checksum:
        with pytest.raises(ChecksumMismatch, match="checksum"):
            future.result(5)
        with pytest.raises(ChecksumMismatch):
            table.wait_complete(r.reservation_id, 1.0)
        assert_transferred(recv_caches, before, before, dst=[], src=[])
    else:  # unnoticed: the receiver holds a corrupted block
        future.result(5)
        assert table.wait_complete(r.reservation_id, 1.0).complete
        assert not torch.equal(recv_caches[0][0][:, DST[0]], send_caches[0][0][:, SRC[0]])
        assert torch.equal(recv_caches[2][1][:, DST], send_caches[2][1][:, SRC])


def raw_handshake(address: str, layout: KVLayout, transport: str = "tcp"):
    """A hand-made sender's connection (and its process group for "torch")."""
    sock = m.open_socket(socket.create_connection(m.split_endpoint(address)))
    hello = {"layout": layout.to_dict(), "fingerprint": layout.fingerprint(), "transport": transport}
    m.send_all(sock, m.encode_frame_header(m.HELLO, hello), time.monotonic() + 5)
    reply = m.recv_frame_header(sock, time.monotonic() + 5).meta
    assert reply["ok"]
    if transport == "torch":
        store = pgs.join_store(m.split_endpoint(address)[0], reply["store_port"], 5.0)
        return sock, (store, pgs.pair_group(store, reply["store_prefix"], pgs.SENDER_RANK, "127.0.0.1",
                                            torch.device("cpu"), 5.0))
    return sock


def test_oversized_frame_refused(make_receiver, make_sender):
    receiver, recv_caches, table = make_receiver(max_payload_bytes=1000)
    sender, send_caches = make_sender()
    with pytest.raises(ValueError, match="exceeds the receiver's limit of 1000 bytes"):
        sender.send(receiver.address, 1, 0, 3, 0, SRC)
    sock = raw_handshake(receiver.address, receiver.layout)
    write = {"seq": 1, "reservation_id": 1, "layer_start": 0, "layer_end": 1, "block_start": 0, "num_blocks": 1}
    m.send_all(sock, m.encode_frame_header(m.WRITE, write, 1 << 40), time.monotonic() + 5)
    ack = m.recv_frame_header(sock, time.monotonic() + 5)
    assert ack.meta["error"] == "ProtocolError" and "exceeds the limit of 1000 bytes" in ack.meta["message"]
    with pytest.raises(PeerGone):  # that connection is closed ...
        m.recv_frame_header(sock, time.monotonic() + 5)
    sock.close()
    r = table.add("req", [4], 4, 30.0)  # ... and the receiver keeps serving others
    sender.send(receiver.address, r.reservation_id, 0, 1, 0, [9]).result(5)


def fake_receiver(behaviour: str) -> tuple[str, threading.Thread]:
    """Accepts one sender, handshakes, reads a WRITE header, then: 'vanish' mid-payload or 'mute' (never acks)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run():
        sock = m.open_socket(listener.accept()[0])
        m.recv_frame_header(sock, time.monotonic() + 5)
        reply = {"ok": True, "max_payload_bytes": 1 << 30}
        m.send_all(sock, m.encode_frame_header(m.HELLO_REPLY, reply), time.monotonic() + 5)
        frame = m.recv_frame_header(sock, time.monotonic() + 5)
        if behaviour == "vanish":
            m.recv_into(sock, memoryview(bytearray(frame.payload_bytes // 2)), time.monotonic() + 5)
        else:
            m.discard(sock, frame.payload_bytes, time.monotonic() + 5)
            time.sleep(1)
        sock.close(), listener.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return f"127.0.0.1:{listener.getsockname()[1]}", thread


@pytest.mark.parametrize("behaviour,error", [("vanish", PeerGone), ("mute", TransferTimeout)])
def test_receiver_gone_fails_future_within_deadline(make_sender, behaviour, error):
    sender, _ = make_sender(send_timeout_s=0.5)
    address, thread = fake_receiver(behaviour)
    started = time.monotonic()
    with pytest.raises(error):
        sender.send(address, 1, 0, 3, 0, SRC).result(5)
    assert time.monotonic() - started < 1.5
    thread.join()


def test_real_receiver_closed_and_unreachable(make_receiver, make_sender):
    receiver, _, table = make_receiver()
    sender, _ = make_sender(send_timeout_s=2.0)
    r = table.add("req", DST, 16, 30.0)
    sender.send(receiver.address, r.reservation_id, 0, 1, 0, SRC).result(5)
    receiver.close()
    started = time.monotonic()
    with pytest.raises((PeerGone, TransferTimeout)):
        sender.send(receiver.address, r.reservation_id, 1, 2, 0, SRC).result(5)
    assert time.monotonic() - started < 1.0


_WRITE_ONE_BLOCK = {"seq": 1, "reservation_id": 1, "layer_start": 0, "layer_end": 1, "block_start": 0,
                    "num_blocks": 1}
# A sender without torch (starts in ~50 ms): writes the frames it is given, then waits to be killed.
_RAW_SENDER = """
import socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
sock = socket.create_connection((host, int(port)))
sock.sendall(bytes.fromhex(sys.argv[2]))
sock.recv(1 << 16)
sock.sendall(bytes.fromhex(sys.argv[3]))
print("ready", flush=True)
time.sleep(60)
"""


def _child_stall_mid_gloo_payload(address: str, layout_dict: dict, ready) -> None:
    """Sends a WRITE header whose payload should follow over gloo, sends none of it, waits to be killed."""
    layout = KVLayout.from_dict(layout_dict)
    sock, group = raw_handshake(address, layout, "torch")
    header = m.encode_frame_header(m.WRITE, _WRITE_ONE_BLOCK, layout.payload_bytes(0, 1, 1), out_of_band=True)
    m.send_all(sock, header, time.monotonic() + 5)
    ready.set()
    time.sleep(60)


@pytest.mark.parametrize("transport", ["tcp", "torch"])
def test_sender_process_killed_mid_payload(make_receiver, make_sender, transport):
    receiver, recv_caches, table = make_receiver()
    if transport == "tcp":
        layout = receiver.layout
        hello = {"layout": layout.to_dict(), "fingerprint": layout.fingerprint(), "transport": "tcp"}
        frames = [m.encode_frame_header(m.HELLO, hello),
                  m.encode_frame_header(m.WRITE, _WRITE_ONE_BLOCK, layout.payload_bytes(0, 1, 1)) + bytes(300)]
        child = subprocess.Popen([sys.executable, "-c", _RAW_SENDER, receiver.address, *(f.hex() for f in frames)],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "ready\n"
        child.stdout.close()

        def kill():
            child.kill(), child.wait(5)
    else:
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        child = ctx.Process(target=_child_stall_mid_gloo_payload, args=(receiver.address, receiver.layout.to_dict(),
                                                                        ready))
        child.start()
        assert ready.wait(30)

        def kill():
            child.kill(), child.join(5)
    time.sleep(0.1)  # let the receiver start waiting for the rest of the payload
    assert receiver.num_connections == 1
    kill()
    deadline = time.monotonic() + 2.0
    while receiver.num_connections and time.monotonic() < deadline:
        time.sleep(0.02)
    assert receiver.num_connections == 0
    sender, send_caches = make_sender()
    before = snapshot(recv_caches)
    r = table.add("req", DST, 16, 30.0)
    send_prompt(sender, receiver.address, table, r.reservation_id)
    assert_transferred(recv_caches, before, send_caches)


# -- handshake authentication (cluster secret) ------------------------------------------------------------


def test_only_a_sender_with_the_key_gets_through_the_handshake(make_receiver, make_sender):
    from kvtransfer.errors import Unauthenticated

    receiver, recv_caches, table = make_receiver(handshake_key=b"k" * 32)
    r = table.add("req-1", DST, 4 * BS - 1, ttl_s=30.0)
    before = snapshot(recv_caches)
    for kwargs, problem in (({}, "HELLO carries no proof of the cluster secret"),
                            ({"handshake_key": b"x" * 32}, "does not verify: a different cluster secret")):
        stranger, _ = make_sender(**kwargs)
        with pytest.raises(Unauthenticated, match=problem):
            stranger.send(receiver.address, r.reservation_id, 0, 2, 0, SRC).result(10)
    assert r.num_received == 0 and all(torch.equal(a[i], b[i]) for a, b in zip(snapshot(recv_caches), before)
                                       for i in (0, 1))
    sender, send_caches = make_sender(handshake_key=b"k" * 32)
    send_prompt(sender, receiver.address, table, r.reservation_id)
    assert_transferred(recv_caches, before, send_caches)


def test_a_handshake_proof_is_bound_to_its_fingerprint_fresh_and_used_once():
    import time

    from kvtransfer.handshake_auth import HandshakeVerifier, prove

    proof = prove(b"k" * 32, "fingerprint")
    assert HandshakeVerifier(b"k" * 32).check(proof, "another fingerprint") == (
        "HELLO's proof does not verify: a different cluster secret")
    verifier = HandshakeVerifier(b"k" * 32)
    assert verifier.check(proof, "fingerprint") is None
    assert verifier.check(proof, "fingerprint") == "HELLO's proof was used before (a replay)"
    later = HandshakeVerifier(b"k" * 32, clock=lambda: time.time() + 120)
    stale = later.check(prove(b"k" * 32, "fingerprint"), "fingerprint")
    assert stale.endswith("off this receiver's clock (at most 60)")
    assert HandshakeVerifier(b"k" * 32).check({"nonce": 1}, "fingerprint") == "HELLO's proof is malformed"


# -- internal TLS (cluster/internal_tls.py) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_tls():
    from cluster import internal_tls

    return internal_tls.generate(), internal_tls.generate()  # this cluster's, and another cluster's


def test_tls_transfers_pipelined_and_refuses_senders_without_the_clusters_certificate(make_receiver, make_sender,
                                                                                      cluster_tls):
    """Over TLS: the bytes arrive exactly (many unacked messages in flight while ACKs come back on the same
    connection); a plaintext sender, one that trusts another CA, one expecting another name and one whose
    certificate another CA signed are refused, and nothing of theirs lands."""
    from cluster.internal_tls import SERVER_NAME, InternalTLS
    from kvtransfer.errors import Unauthenticated

    ours, theirs = cluster_tls
    receiver, recv_caches, table = make_receiver(tls_context=ours.server_context())
    before = snapshot(recv_caches)
    r = table.add("req-1", DST, 4 * BS - 1, ttl_s=30.0)
    for kwargs, error in (({}, (PeerGone, TransferTimeout)),
                          ({"tls_context": theirs.client_context(), "tls_server_name": SERVER_NAME},
                           (Unauthenticated, PeerGone)),
                          ({"tls_context": ours.client_context(), "tls_server_name": "someone-else"},
                           Unauthenticated),
                          ({"tls_context": InternalTLS(ours.ca_pem, theirs.cert_pem, theirs.key_pem).client_context(),
                            "tls_server_name": SERVER_NAME}, PeerGone)):  # trusts us, but we do not trust it
        stranger, _ = make_sender(connect_timeout_s=2.0, **kwargs)
        with pytest.raises(error):
            stranger.send(receiver.address, r.reservation_id, 0, 2, 0, SRC).result(10)
    assert r.num_received == 0 and all(torch.equal(a[i], b[i]) for a, b in zip(snapshot(recv_caches), before)
                                       for i in (0, 1))
    sender, send_caches = make_sender(tls_context=ours.client_context(), tls_server_name=SERVER_NAME, checksum=True)
    futures = [sender.send(receiver.address, r.reservation_id, layer, layer + 1, i, [s])
               for layer in range(L) for i, s in enumerate(SRC)]
    for future in futures:
        future.result(10)
    assert table.wait_complete(r.reservation_id, 1.0) is r
    assert_transferred(recv_caches, before, send_caches)
    with pytest.raises(ValueError, match="transport='torch' cannot be encrypted"):
        make_sender(transport="torch", tls_context=ours.client_context(), tls_server_name=SERVER_NAME)
    receiver.close()  # returns promptly with the TLS connection open
    assert receiver.num_connections == 0
