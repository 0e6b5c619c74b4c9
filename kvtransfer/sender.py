"""KVSender: the prefill side, shipping layer groups of cached blocks into a receiver's reservation.

One channel (channel.py) per receiver endpoint, opened (HELLO/HELLO_REPLY) on first use and cached until it
breaks; a broken channel is dropped and the next `send` to that endpoint opens a new one.

What a caller may rely on:
- `send` copies the blocks out of the cache before it returns: the caller may overwrite or free them then;
- the returned future resolves to None once the receiver wrote the blocks and acked, or fails with a
  TransferError subclass (ReservationExpired, ChecksumMismatch, LayoutMismatch, PeerGone, TransferTimeout,
  ...); it never hangs: each message must be sent and acked within `send_timeout_s` of leaving the queue;
- a timeout or a lost connection fails every unacked future of that channel (the stream's state is
  unknown after it) and drops the channel;
- `close()` fails every unacked future with PeerGone and joins the threads;
- memory: each queued message holds its gathered copy until sent; up to `max_staging_bytes` of sent
  buffers are kept for reuse (CPU caches only).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from kvtransfer import block_copy, handshake_auth, tls_socket
from kvtransfer import messages as m
from kvtransfer import process_group as pgs
from kvtransfer.channel import Channel, Message, fail_future
from kvtransfer.errors import PeerGone, ProtocolError, TransferError, TransferTimeout, error_for_kind
from kvtransfer.layout import KVLayout

log = logging.getLogger("duet.kvtransfer")


# A message is sent and acked in milliseconds; this bounds how long a prefill worker holds a request's blocks
# for a decode worker that stopped answering (hung, or its host gone without closing the connection).
SEND_TIMEOUT_S = 10.0


class KVSender:
    """Prefill side. One channel per receiver endpoint, opened (handshake) on first use and cached."""

    def __init__(self, layout: KVLayout, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], transport: str = "tcp",
                 checksum: bool = False, connect_timeout_s: float = 5.0, send_timeout_s: float = SEND_TIMEOUT_S, *,
                 max_staging_bytes: int = 512 << 20, handshake_key: bytes | None = None,
                 tls_context: ssl.SSLContext | None = None, tls_server_name: str = ""):
        """With `tls_context`, connections are TLS and the receiver's certificate must name `tls_server_name`
        (cluster/internal_tls.py); the "torch" transport sends payloads outside the socket, so it cannot be."""
        layout.check_caches(kv_caches)
        if transport not in ("tcp", "torch"):
            raise ValueError(f"transport={transport!r} is invalid: must be 'tcp' or 'torch'")
        if tls_context is not None and transport == "torch":
            raise ValueError("transport='torch' cannot be encrypted (its payloads bypass the TLS socket): use 'tcp' "
                             "with internal TLS")
        self.layout = layout
        self.kv_caches = kv_caches
        self.handshake_key = handshake_key  # proves this sender to receivers in its HELLO (handshake_auth)
        self.transport = transport
        self._tls_context, self._tls_server_name = tls_context, tls_server_name
        self.checksum = checksum
        self.connect_timeout_s = connect_timeout_s
        self.send_timeout_s = send_timeout_s
        self._device = kv_caches[0][0].device
        self._staging = block_copy.StagingPool(max_staging_bytes)  # idle gather buffers kept for reuse
        self._num_blocks = kv_caches[0][0].shape[1]
        self._channels: dict[str, Channel] = {}
        self._lock = threading.Lock()
        self._closed = False

    def connect(self, endpoint: str) -> None:
        """Handshake now (if not yet connected); raises LayoutMismatch / PeerGone / TransferTimeout."""
        self._channel(endpoint)

    def send(self, endpoint: str, reservation_id: int, layer_start: int, layer_end: int, block_start: int,
             src_block_ids: list[int]) -> Future:
        """Ship layers [layer_start, layer_end) of `src_block_ids` to blocks
        reservation.block_ids[block_start : block_start + len(src_block_ids)] at `endpoint`, as one message.
        Bad arguments raise ValueError here; transfer failures (connecting included) fail the future."""
        if not 0 <= layer_start < layer_end <= self.layout.num_layers:
            raise ValueError(f"layers [{layer_start}, {layer_end}) are invalid: must be a non-empty range within "
                             f"[0, {self.layout.num_layers})")
        if not src_block_ids or min(src_block_ids) < 0 or max(src_block_ids) >= self._num_blocks:
            raise ValueError(f"src_block_ids={src_block_ids} is invalid: must be non-empty ids in "
                             f"[0, {self._num_blocks})")
        if block_start < 0 or reservation_id < 1:
            raise ValueError(f"block_start={block_start}, reservation_id={reservation_id} are invalid: "
                             "must be >= 0 and >= 1")
        future: Future = Future()
        try:
            channel = self._channel(endpoint)
        except TransferError as e:
            fail_future(future, e)
            return future
        num_bytes = self.layout.payload_bytes(layer_start, layer_end, len(src_block_ids))
        if num_bytes > channel.max_payload_bytes:
            raise ValueError(f"message of {num_bytes} bytes exceeds the receiver's limit of "
                             f"{channel.max_payload_bytes} bytes: send fewer layers or blocks per call")
        meta = {"reservation_id": reservation_id, "layer_start": layer_start, "layer_end": layer_end,
                "block_start": block_start, "num_blocks": len(src_block_ids)}
        payload, release = self._gather(layer_start, layer_end, src_block_ids, num_bytes)
        channel.submit(Message(meta, payload, future, release))
        return future

    def _gather(self, layer_start: int, layer_end: int, src_block_ids: list[int],
                num_bytes: int) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """The message payload as flat bytes (layout in messages.py), and how to recycle its buffer once sent."""
        lay = self.layout
        index = torch.tensor(src_block_ids, dtype=torch.long, device=self._device)
        if self._device.type == "cpu":
            staging = self._staging.take(num_bytes)
            payload = staging[:num_bytes]
            block_copy.gather(self.kv_caches, layer_start, layer_end, index,
                              lay.payload_views(payload, layer_start, layer_end, len(src_block_ids)))
            return payload, lambda: self._staging.give(staging)
        out = torch.empty(num_bytes, dtype=torch.uint8, device=self._device)  # CUDA's allocator already reuses
        block_copy.gather(self.kv_caches, layer_start, layer_end, index,
                          lay.payload_views(out, layer_start, layer_end, len(src_block_ids)))
        if self.transport == "tcp":
            out = out.cpu()  # sockets need host memory
        else:  # NCCL runs on the writer thread's stream: the gather must be done before it starts
            torch.cuda.current_stream(out.device).synchronize()
        return out, None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close()

    def _channel(self, endpoint: str) -> Channel:
        with self._lock:
            if self._closed:
                raise PeerGone("sender is closed")
            channel = self._channels.get(endpoint)
            if channel is not None and channel.broken is None:
                return channel
        channel = self._open(endpoint)  # outside the lock: a slow peer must not stall sends to others
        with self._lock:
            current = self._channels.get(endpoint)
            if self._closed or (current is not None and current.broken is None):
                winner = None if self._closed else current
            else:
                self._channels[endpoint] = winner = channel
        if winner is not channel:  # lost a race with another thread (or with close())
            channel.close()
            if winner is None:
                raise PeerGone("sender is closed")
        return winner

    def _open(self, endpoint: str) -> Channel:
        host, port = m.split_endpoint(endpoint)
        deadline = time.monotonic() + self.connect_timeout_s
        try:
            sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
        except TimeoutError:
            raise TransferTimeout(f"connect to {endpoint} timed out after {self.connect_timeout_s} s") from None
        except OSError as e:
            raise PeerGone(f"cannot connect to {endpoint}: {e}") from e
        try:
            m.open_socket(sock)
            if self._tls_context is not None:
                sock = tls_socket.wrap_client(sock, self._tls_context, self._tls_server_name,
                                              max(deadline - time.monotonic(), 0.1), m.POLL_S)
            hello = {"layout": self.layout.to_dict(), "fingerprint": self.layout.fingerprint(),
                     "transport": self.transport}
            if self.handshake_key is not None:
                hello["auth"] = handshake_auth.prove(self.handshake_key, hello["fingerprint"])
            m.send_all(sock, m.encode_frame_header(m.HELLO, hello), deadline)
            reply = m.recv_frame_header(sock, deadline, max_payload_bytes=0, body_timeout_s=self.connect_timeout_s)
            if reply.kind != m.HELLO_REPLY:
                raise ProtocolError(f"expected HELLO_REPLY from {endpoint}, got {m.KINDS[reply.kind]}")
            if not reply.meta.get("ok"):
                raise error_for_kind(reply.meta.get("error", "TransferError"), str(reply.meta.get("message")))
            try:
                max_payload_bytes = int(reply.meta["max_payload_bytes"])
                store_port, store_prefix = (int(reply.meta["store_port"]), str(reply.meta["store_prefix"])) \
                    if self.transport == "torch" else (0, "")
            except (KeyError, TypeError, ValueError) as e:
                raise ProtocolError(f"HELLO_REPLY from {endpoint} lacks a valid field: {e!r}") from e
            pg = store = None
            if self.transport == "torch":
                remaining_s = max(deadline - time.monotonic(), 0.1)
                store = pgs.join_store(host, store_port, remaining_s)
                pg = pgs.pair_group(store, store_prefix, pgs.SENDER_RANK, sock.getsockname()[0], self._device,
                                    remaining_s)
        except BaseException:
            sock.close()
            raise
        log.info("kvtransfer sender endpoint=%s event=connected transport=%s", endpoint, self.transport)
        return Channel(endpoint, sock, pg, store, max_payload_bytes, self.checksum, self.send_timeout_s)
