"""A sender's connection to one receiver: a socket (and maybe a process group), a writer and an ACK reader.

    caller ─submit─▶ queue ─▶ writer thread: WRITE header (+ payload inline or over the group) ─▶ receiver
                               pending (sent, unacked, in order) ◀─ ACK reader thread ◀─ ACKs, same order

The writer does not wait for ACKs, so the receiver's copy into its cache overlaps the next message's
transfer. A channel is usable until `broken` is set; from then on every unacked or queued message fails
with that error (the stream's state is unknown after a timeout or a lost connection) and the owner opens a
new channel. A writer blocked inside a process-group send can only be woken by the group itself (peer gone or
deadline), so `close()` may take up to `send_timeout_s` when the peer vanished without closing its end.
"""

from __future__ import annotations

import collections
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

import torch

from kvtransfer import messages as m
from kvtransfer import process_group as pgs
from kvtransfer.errors import PeerGone, ProtocolError, TransferError, TransferTimeout, error_for_kind

log = logging.getLogger("duet.kvtransfer")


@dataclass
class Message:
    meta: dict[str, Any]
    payload: torch.Tensor | None  # flat uint8; dropped once sent
    future: Future
    release: Callable[[], None] | None = None  # recycles the payload's buffer once sent
    seq: int = 0
    deadline: float = 0.0  # time.monotonic() by which it must be sent and acked


def fail_future(future: Future, error: BaseException) -> None:
    try:
        future.set_exception(error)
    except InvalidStateError:
        pass  # already resolved or cancelled


class Channel:
    def __init__(self, endpoint: str, sock: socket.socket, pg: Any, store: Any, max_payload_bytes: int,
                 checksum: bool, send_timeout_s: float):
        self.endpoint = endpoint
        self.max_payload_bytes = max_payload_bytes
        self._sock, self._pg, self._store = sock, pg, store
        self._checksum = checksum
        self._send_timeout_s = send_timeout_s
        self._queue: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._pending: collections.deque[Message] = collections.deque()  # sent, awaiting ACK, in order
        self._lock = threading.Lock()
        self._next_seq = 1
        self.broken: TransferError | None = None
        self._threads = [threading.Thread(target=self._write_loop, name=f"kv-send-{endpoint}", daemon=True),
                         threading.Thread(target=self._ack_loop, name=f"kv-ack-{endpoint}", daemon=True)]
        for thread in self._threads:
            thread.start()

    def submit(self, message: Message) -> None:
        with self._lock:
            if self.broken is None:
                self._queue.put(message)
                return
        fail_future(message.future, type(self.broken)(f"channel to {self.endpoint} is broken: {self.broken}"))

    def close(self) -> None:
        self.fail(PeerGone(f"sender closed its channel to {self.endpoint}"))
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def fail(self, error: TransferError) -> None:
        """Break the channel: fail everything unacked, close the socket and group, stop the threads."""
        with self._lock:
            if self.broken is not None:
                return
            self.broken = error
            doomed = list(self._pending)
            self._pending.clear()
        self._queue.put(None)  # wakes the writer, which fails whatever is still queued
        for message in doomed:
            fail_future(message.future, error)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        pgs.close_group(self._pg)
        log.info("kvtransfer sender endpoint=%s event=channel_closed reason=%s", self.endpoint, error)

    def _write_loop(self) -> None:
        while (message := self._queue.get()) is not None:
            if not message.future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            with self._lock:
                if self.broken is not None:
                    fail_future(message.future, self.broken)
                    continue
                message.seq, self._next_seq = self._next_seq, self._next_seq + 1
                message.deadline = time.monotonic() + self._send_timeout_s
                self._pending.append(message)  # before sending: its ACK may race in right after
            try:
                self._transmit(message)
            except TransferError as e:
                self.fail(e)
        while not self._queue.empty():  # broken: nothing queued may be left hanging
            if (message := self._queue.get()) is not None:
                fail_future(message.future, self.broken or PeerGone("channel closed"))
        self._sock.close()

    def _transmit(self, message: Message) -> None:
        payload = message.payload
        checksum = None
        if self._checksum:
            checksum = m.payload_checksum(memoryview(payload.cpu().numpy()))
        meta = dict(message.meta, seq=message.seq)
        header = m.encode_frame_header(m.WRITE, meta, payload.numel(), checksum, out_of_band=self._pg is not None)
        m.send_all(self._sock, header, message.deadline)
        if self._pg is not None:
            pgs.send_tensor(self._pg, payload, pgs.RECEIVER_RANK, message.seq & 0x7FFFFFFF, message.deadline)
        else:
            m.send_all(self._sock, memoryview(payload.numpy()), message.deadline)
        message.payload = None  # free (or recycle) the gathered copy now, not when the ACK comes
        if message.release is not None:
            message.release()
            message.release = None

    def _ack_loop(self) -> None:
        try:
            while self.broken is None:
                with self._lock:
                    head_deadline = self._pending[0].deadline if self._pending else None
                now = time.monotonic()
                if head_deadline is not None and now >= head_deadline:
                    raise TransferTimeout(f"no ACK from {self.endpoint} within {self._send_timeout_s} s")
                wait_s = m.POLL_S if head_deadline is None else min(m.POLL_S, head_deadline - now)
                if not m.wait_readable(self._sock, wait_s):
                    continue
                ack = m.recv_frame_header(self._sock, now + self._send_timeout_s, max_payload_bytes=0,
                                          body_timeout_s=self._send_timeout_s)
                self._resolve(ack)
        except TransferError as e:
            self.fail(e)
        except (OSError, ValueError) as e:  # socket closed under select() by fail()
            self.fail(PeerGone(f"connection to {self.endpoint} lost: {e}"))

    def _resolve(self, ack: m.FrameHeader) -> None:
        if ack.kind != m.ACK:
            raise ProtocolError(f"expected ACK, got {m.KINDS[ack.kind]}")
        meta = ack.meta
        if meta.get("seq") is None and not meta.get("ok"):  # the receiver refused the stream itself
            raise error_for_kind(meta.get("error", "TransferError"), str(meta.get("message")))
        with self._lock:
            head = self._pending.popleft() if self._pending else None
        if head is None or head.seq != meta.get("seq"):
            raise ProtocolError(f"ACK seq={meta.get('seq')} does not match the oldest unacked message "
                                f"{head.seq if head else None}")
        if meta.get("ok"):
            head.future.set_result(None)
        else:
            fail_future(head.future, error_for_kind(meta.get("error", "TransferError"), str(meta.get("message"))))
