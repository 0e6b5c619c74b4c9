"""The receiver's side of one connection after the handshake: WRITE frames in, ACKs out, in order.

Two threads and two staging buffers, so receiving message k+1 overlaps writing message k into the cache:

    reader (connection thread)                         applier
    header ─▶ payload into a free buffer ─▶ queue ─▶   check, scatter into reserved blocks, ACK ─▶ buffer freed
         ▲ waits for a free buffer (two per connection)                                                 │
         └──────────────────────────────────────────────────────────────────────────────────────────────┘

The reader reads every payload in full before anything judges it, so a refused message (expired reservation,
checksum mismatch, bad ranges or size) leaves the stream in sync and the cache untouched. Only the applier
sends, so ACKs keep the WRITE order; `serve` returns (or raises) only after the applier has stopped, so the
caller may then send an error frame itself.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.cpu_threads import confine_to_one_cpu_thread
from kvtransfer import block_copy
from kvtransfer import messages as m
from kvtransfer import process_group as pgs
from kvtransfer.errors import ChecksumMismatch, PeerGone, ProtocolError, TransferError
from kvtransfer.layout import KVLayout
from kvtransfer.reservation import ReservationTable

log = logging.getLogger("duet.kvtransfer")
_WRITE_FIELDS = ("reservation_id", "layer_start", "layer_end", "block_start", "num_blocks")
NUM_BUFFERS = 2  # one being received while the other is written: enough to overlap the two


def error_ack(seq: int | None, error: Exception) -> dict[str, Any]:
    return {"seq": seq, "ok": False, "error": type(error).__name__, "message": str(error)}


class WriteStream:
    def __init__(self, sock: socket.socket, pg: Any, layout: KVLayout, kv_caches: block_copy.KVCaches,
                 reservations: ReservationTable, max_payload_bytes: int, recv_timeout_s: float,
                 stop: Callable[[], bool]):
        self.sock, self.pg = sock, pg
        self.layout = layout
        self.kv_caches = kv_caches
        self.reservations = reservations
        self.max_payload_bytes = max_payload_bytes
        self.recv_timeout_s = recv_timeout_s
        self.stop = stop
        self._device = kv_caches[0][0].device
        self._num_blocks = kv_caches[0][0].shape[1]
        # gloo/NCCL receive straight into the caches' device; a socket needs host memory
        self._buffer_device = self._device if pg is not None else torch.device("cpu")
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(NUM_BUFFERS):
            self._free.put(torch.empty(0, dtype=torch.uint8, device=self._buffer_device))
        self._work: queue.Queue[tuple[m.FrameHeader, torch.Tensor, torch.Tensor] | None] = queue.Queue()

    def serve(self) -> None:
        """Until the peer leaves, `stop()`, or an error (raised: PeerGone, TransferTimeout, ProtocolError)."""
        applier = threading.Thread(target=self._apply_loop, name=f"{threading.current_thread().name}-apply",
                                   daemon=True)
        applier.start()
        try:
            while not self.stop():
                self._read_one()
        finally:
            self._work.put(None)
            applier.join()

    def _read_one(self) -> None:
        frame = m.recv_frame_header(self.sock, None, self.stop, max_payload_bytes=self.max_payload_bytes,
                                    body_timeout_s=self.recv_timeout_s)
        if frame.kind != m.WRITE:
            raise ProtocolError(f"expected WRITE, got {m.KINDS[frame.kind]}")
        seq = frame.meta.get("seq")
        if not isinstance(seq, int):
            raise ProtocolError(f"WRITE seq={seq!r} is invalid: must be an int")
        if frame.out_of_band != (self.pg is not None):
            route = "over the process group" if self.pg is not None else "inline on the socket"
            raise ProtocolError(f"WRITE payload must travel {route} on this connection")
        buffer = self._take_buffer()
        if buffer.numel() < frame.payload_bytes:
            buffer = torch.empty(frame.payload_bytes, dtype=torch.uint8, device=self._buffer_device)
        payload = buffer[: frame.payload_bytes]
        deadline = time.monotonic() + self.recv_timeout_s
        try:
            if frame.out_of_band:
                pgs.recv_tensor(self.pg, payload, pgs.SENDER_RANK, seq & 0x7FFFFFFF, deadline)
            else:
                m.recv_into(self.sock, memoryview(payload.numpy()), deadline)
        except BaseException:
            self._free.put(buffer)
            raise
        self._work.put((frame, buffer, payload))

    def _take_buffer(self) -> torch.Tensor:
        while True:
            try:
                return self._free.get(timeout=m.POLL_S)
            except queue.Empty:
                if self.stop():
                    raise PeerGone("receiver closed") from None

    def _apply_loop(self) -> None:
        confine_to_one_cpu_thread()  # its copies must not start an OpenMP pool (engine/cpu_threads.py)
        broken = False
        while (item := self._work.get()) is not None:
            frame, buffer, payload = item
            ack = self._apply(frame, payload)
            self._free.put(buffer)
            if broken:
                continue
            try:
                m.send_all(self.sock, m.encode_frame_header(m.ACK, ack), time.monotonic() + self.recv_timeout_s)
            except TransferError as e:
                broken = True  # keep draining (the reader may be waiting for a buffer); wake the reader
                log.info("kvtransfer receiver event=ack_failed seq=%s error=%s", ack["seq"], e)
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _apply(self, frame: m.FrameHeader, payload: torch.Tensor) -> dict[str, Any]:
        """Check and write one WRITE's payload; the ACK to send back."""
        meta, seq = frame.meta, frame.meta["seq"]
        lay = self.layout
        try:
            values = [meta.get(name) for name in _WRITE_FIELDS]
            for name, value in zip(_WRITE_FIELDS, values):
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"WRITE {name}={value!r} is invalid: must be an int")
            reservation_id, layer_start, layer_end, block_start, num_blocks = values
            if not 0 <= layer_start < layer_end <= lay.num_layers or num_blocks < 1:
                raise ValueError(f"layers [{layer_start}, {layer_end}) x {num_blocks} blocks are invalid: must be "
                                 f"within [0, {lay.num_layers}) x >= 1 block")
            expected = lay.payload_bytes(layer_start, layer_end, num_blocks)
            if frame.payload_bytes != expected:
                raise ValueError(f"payload of {frame.payload_bytes} bytes is invalid: layers [{layer_start}, "
                                 f"{layer_end}) x {num_blocks} blocks take {expected} bytes")
            if frame.checksum is not None:
                actual = m.payload_checksum(memoryview(payload.cpu().numpy()))
                if actual != frame.checksum:
                    message = (f"payload checksum {actual:016x} != sent {frame.checksum:016x} "
                               f"(reservation {reservation_id}, layers [{layer_start}, {layer_end}))")
                    self.reservations.fail(reservation_id, message, ChecksumMismatch)
                    raise ChecksumMismatch(message)
            data = lay.payload_views(payload.to(self._device), layer_start, layer_end, num_blocks)

            def write_fn(dst_block_ids: list[int]) -> None:
                if max(dst_block_ids) >= self._num_blocks:
                    raise ValueError(f"reserved block {max(dst_block_ids)} is invalid: cache has "
                                     f"{self._num_blocks} blocks")
                index = torch.tensor(dst_block_ids, dtype=torch.long, device=self._device)
                block_copy.scatter(self.kv_caches, layer_start, layer_end, index, data)

            self.reservations.write(reservation_id, layer_start, layer_end, block_start, num_blocks, write_fn)
        except (TransferError, ValueError, RuntimeError) as e:  # refuse this one, keep serving
            log.info("kvtransfer receiver event=write_refused seq=%d error=%s: %s", seq, type(e).__name__, e)
            return error_ack(seq, e)
        return {"seq": seq, "ok": True}
