"""How a tensor-parallel prefill worker's rank 0 learns that its follower ranks shipped a request's KV: each
rank pushes one report per request over its own loopback connection; nothing polls.

    rank r (AckReporter, in PrefillRankHooks)               rank 0 (FollowerAcks)
                                                            listens on loopback; its address is in the
                                                            worker's TCPStore under ACK_ADDRESS_KEY
    request R's last shard sent (or failed):
      connect once, to that address  ─────────────────────▶ one reader thread per connection
      one line: encode_op(ShardSent(R, r, ...)) + b"\\n" ──▶ R's future resolves once every rank reported
                                                            (or fails with the lowest failing rank's error)

Rank 0 expects R before it tells the followers to send it, so no report comes early. A report nobody waits
for (the request was aborted, forgotten or timed out) is dropped: nothing of a request outlives it here.
One thread sleeps until the nearest deadline (`timeout_s` after `expect`) and fails what is overdue.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.follower_ops import OpDecodeError, decode_op, encode_op
from kvtransfer.errors import PeerGone, TransferError, TransferTimeout, error_for_kind

log = logging.getLogger("duet.prefill")

ACK_ADDRESS_KEY = "tp_acks/address"
MAX_REPORT_BYTES = 64 << 10  # one line; request ids are bounded far below (router/request_builder.py)
MAX_ERROR_CHARS = 2000


@dataclass(frozen=True)
class ShardSent:
    """Rank `rank`'s report that every message of its shard of `request_id`'s KV was acknowledged by the
    decode rank (`error_kind` None), or that one failed (`error_kind`: the `TransferError` subclass name)."""
    request_id: str
    rank: int
    error_kind: str | None
    message: str

    def error(self) -> TransferError | None:
        if self.error_kind is None:
            return None
        return error_for_kind(self.error_kind, f"TP rank {self.rank}: {self.message}")


class AckReporter:
    """Follower side: pushes this rank's `ShardSent` reports to rank 0. Thread-safe (the sender's threads call
    it). A report that cannot be delivered is logged and lost: rank 0 is gone, or times the request out."""

    def __init__(self, store, rank: int, timeout_s: float = 60.0):
        self.rank = rank
        self._store = store  # the worker's TCPStore: where rank 0 published its address
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def report(self, request_id: str, error: BaseException | None) -> None:
        kind, message = (None, "") if error is None else (type(error).__name__, str(error)[:MAX_ERROR_CHARS])
        line = encode_op(ShardSent(request_id, self.rank, kind, message)) + b"\n"
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = self._connect()
                self._sock.sendall(line)
            except Exception as e:  # noqa: BLE001 - rank 0 is gone; it times out the request itself
                log.warning("tp rank=%d request=%s event=ack_lost error=%r", self.rank, request_id, e)
                self._close_socket()

    def _connect(self) -> socket.socket:
        # blocks (up to the store's timeout) until rank 0 published the address: only the first report waits
        host, port = self._store.get(ACK_ADDRESS_KEY).decode().rsplit(":", 1)
        return socket.create_connection((host, int(port)), timeout=self._timeout_s)

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close_socket()


@dataclass
class _Expected:
    future: Future
    deadline_s: float
    waiting: set[int]  # the ranks that have not reported yet
    errors: dict[int, TransferError] = field(default_factory=dict)


class FollowerAcks:
    """Rank 0 side: a future per request that resolves once every follower rank reported its shard sent, or
    fails with the lowest failing rank's error once all did; fails with `TransferTimeout` if one has not after
    `timeout_s`, with `PeerGone` if a rank's connection closes first, with `TransferError` on `close()`."""

    def __init__(self, store, ranks: list[int], timeout_s: float = 120.0, host: str = "127.0.0.1"):
        self.ranks = ranks
        self.timeout_s = timeout_s
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._pending: dict[str, _Expected] = {}
        self._connections: list[socket.socket] = []
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._accept, name="tp-acks-accept", daemon=True),
                         threading.Thread(target=self._expire, name="tp-acks-expire", daemon=True)]
        for thread in self._threads:
            thread.start()
        store.set(ACK_ADDRESS_KEY, self.address)

    def expect(self, request_id: str) -> Future:
        """The future for `request_id`; call it before the followers are told to send the request's last blocks."""
        future: Future = Future()
        with self._cond:
            self._pending[request_id] = _Expected(future, time.monotonic() + self.timeout_s, set(self.ranks))
            self._cond.notify_all()
        return future

    def forget(self, request_id: str) -> None:
        """Stop waiting for `request_id` (its future stays unresolved); later reports of it are dropped."""
        with self._cond:
            self._pending.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, {}
            connections, self._connections = self._connections, []
            self._cond.notify_all()
        for sock in [self._listener, *connections]:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept / recv on it
            except OSError:
                pass
            sock.close()
        for expected in pending.values():
            expected.future.set_exception(TransferError("prefill worker stopped"))
        for thread in self._threads:
            thread.join(timeout=2.0)

    # -- threads ---------------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._connections.append(conn)
            threading.Thread(target=self._read, args=(conn,), name="tp-acks-read", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        rank = None
        with conn, conn.makefile("rb") as lines:
            while True:
                try:
                    line = lines.readline(MAX_REPORT_BYTES + 1)
                except OSError:
                    break
                if not line:
                    break
                try:
                    if not line.endswith(b"\n"):
                        raise OpDecodeError(f"a report line over {MAX_REPORT_BYTES} bytes or cut short")
                    report = decode_op(line[:-1], (ShardSent,))
                except OpDecodeError as e:
                    log.error("tp event=bad_ack rank=%s error=%s", rank, e)
                    break
                if report.rank not in self.ranks:
                    log.error("tp event=bad_ack rank=%d error=not a follower rank %s", report.rank, self.ranks)
                    break
                rank = report.rank
                self._on_report(report)
        with self._cond:
            if conn in self._connections:
                self._connections.remove(conn)
        if rank is not None:
            self._rank_gone(rank)

    def _on_report(self, report: ShardSent) -> None:
        with self._cond:
            expected = self._pending.get(report.request_id)
            if expected is None:
                return  # aborted, forgotten or timed out: nothing waits for it
            expected.waiting.discard(report.rank)
            error = report.error()
            if error is not None:
                expected.errors[report.rank] = error
            if expected.waiting:
                return
            del self._pending[report.request_id]
        if expected.errors:
            expected.future.set_exception(expected.errors[min(expected.errors)])
        else:
            expected.future.set_result(None)

    def _rank_gone(self, rank: int) -> None:
        with self._cond:
            if self._closed:
                return
            lost = {rid: e for rid, e in self._pending.items() if rank in e.waiting}
            for rid in lost:
                del self._pending[rid]
        for rid, expected in lost.items():
            expected.future.set_exception(PeerGone(f"request {rid}: TP rank {rank}'s report connection closed"))

    def _expire(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                overdue = {rid: e for rid, e in self._pending.items() if e.deadline_s <= now}
                for rid in overdue:
                    del self._pending[rid]
                if not overdue:  # sleep until the nearest deadline, or until expect / close wakes it
                    nearest_s = min((e.deadline_s for e in self._pending.values()), default=None)
                    self._cond.wait(None if nearest_s is None else nearest_s - now)
                    continue
            for rid, expected in overdue.items():
                expected.future.set_exception(TransferTimeout(
                    f"request {rid}: a TP follower rank did not report its KV shard sent in {self.timeout_s} s"))
