"""The wire format between a KVSender and a KVReceiver, and socket I/O with deadlines. No pickle, ever.

A frame (integers little-endian):

    0      4    5      6       8          12               20              28
    ┌──────┬────┬──────┬───────┬──────────┬────────────────┬───────────────┐
    │"DUKV"│ver │ kind │ flags │ json_len │ payload_bytes  │ checksum      │   HEADER, 28 bytes
    │  4s  │ u8 │  u8  │  u16  │   u32    │      u64       │ u64 (xxh3_64) │
    └──────┴────┴──────┴───────┴──────────┴────────────────┴───────────────┘
    json_len bytes: a UTF-8 JSON object (the message's fields)
    payload_bytes bytes of raw tensor data, on this socket unless FLAG_OUT_OF_BAND (then the same bytes go
    over the pair's torch.distributed process group, and nothing more follows on the socket)

`checksum` is meaningful only with FLAG_CHECKSUM. A reader refuses (ProtocolError, naming value and limit) a
frame with the wrong magic or version, an unknown kind, JSON over `max_json_bytes` or a payload over
`max_payload_bytes`, before reading or allocating any of it.

A WRITE payload is layers [layer_start, layer_end) of num_blocks blocks, the layers back to back, K then V per
layer, each layer in the shape of the model it belongs to (layout.py: the target's, or a draft's):

    layer_start                                       ...   layer_end - 1
    [2 (K, V), num_kv_heads, num_blocks, block_size, head_dim] ... [2, num_kv_heads', ..., head_dim']   layout.dtype,
                                                                                                       C order

i.e. each layer's cache gathered on its block dim (`index_select(1, ids)`), so one message carries a whole
layer group however many blocks it covers. Where every layer has one shape (no draft) that is one C-order
[num_layers_in_group, 2, num_kv_heads, num_blocks, block_size, head_dim] array.

Messages: HELLO {layout, fingerprint, transport} -> HELLO_REPLY {ok, error?, message?, max_payload_bytes,
store_port?, store_prefix?}; then WRITE {seq, reservation_id, layer_start, layer_end, block_start,
num_blocks} + payload -> ACK {seq, ok, error?, message?}, one ACK per WRITE, in order.
"""

from __future__ import annotations

import json
import select
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

import xxhash

from kvtransfer.errors import PeerGone, ProtocolError, TransferTimeout

MAGIC = b"DUKV"
VERSION = 1
HEADER = struct.Struct("<4sBBHIQQ")
HELLO, HELLO_REPLY, WRITE, ACK = 1, 2, 3, 4
KINDS = {HELLO: "HELLO", HELLO_REPLY: "HELLO_REPLY", WRITE: "WRITE", ACK: "ACK"}
FLAG_CHECKSUM = 1
FLAG_OUT_OF_BAND = 2
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30
DEFAULT_MAX_JSON_BYTES = 64 << 10
POLL_S = 0.1  # socket timeout: how often a blocked read or write looks at its deadline and stop flag


@dataclass(frozen=True)
class FrameHeader:
    kind: int
    flags: int
    meta: dict[str, Any]
    payload_bytes: int
    checksum: int | None  # None unless FLAG_CHECKSUM

    @property
    def out_of_band(self) -> bool:
        return bool(self.flags & FLAG_OUT_OF_BAND)

    @property
    def inline_payload_bytes(self) -> int:
        """Bytes that follow on the socket."""
        return 0 if self.out_of_band else self.payload_bytes


def payload_checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def encode_frame_header(kind: int, meta: dict[str, Any], payload_bytes: int = 0, checksum: int | None = None,
                        out_of_band: bool = False) -> bytes:
    """HEADER + JSON; the caller sends `payload_bytes` bytes after it (or over the process group)."""
    body = json.dumps(meta, separators=(",", ":")).encode()
    flags = (FLAG_CHECKSUM if checksum is not None else 0) | (FLAG_OUT_OF_BAND if out_of_band else 0)
    return HEADER.pack(MAGIC, VERSION, kind, flags, len(body), payload_bytes, checksum or 0) + body


def decode_fixed_header(raw: bytes, max_json_bytes: int, max_payload_bytes: int) -> tuple[int, int, int, int, int]:
    """(kind, flags, json_len, payload_bytes, checksum) of HEADER bytes, checked against the limits."""
    magic, version, kind, flags, json_len, payload_bytes, checksum = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: expected {MAGIC!r} (not a duet KV transfer peer?)")
    if version != VERSION:
        raise ProtocolError(f"wire version {version} is unsupported: this side speaks {VERSION}")
    if kind not in KINDS:
        raise ProtocolError(f"frame kind {kind} is unknown: allowed {sorted(KINDS)}")
    if json_len > max_json_bytes:
        raise ProtocolError(f"frame JSON of {json_len} bytes exceeds the limit of {max_json_bytes} bytes")
    if payload_bytes > max_payload_bytes:
        raise ProtocolError(f"frame payload of {payload_bytes} bytes exceeds the limit of {max_payload_bytes} bytes")
    return kind, flags, json_len, payload_bytes, checksum


def send_all(sock: socket.socket, data: bytes | memoryview, deadline: float) -> None:
    """Send every byte by `deadline` (time.monotonic); TransferTimeout or PeerGone otherwise."""
    view = memoryview(data).cast("B")
    sent = 0
    while sent < len(view):
        try:
            sent += sock.send(view[sent:])
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"send stalled: {sent} of {len(view)} bytes sent by the deadline") from None
        except OSError as e:
            raise PeerGone(f"connection lost while sending: {e}") from e


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None, stop=None) -> None:
    """Fill `view` from the socket by `deadline` (None: no deadline, but `stop()` true ends the wait)."""
    view = view.cast("B")
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise TransferTimeout(f"receive stalled: {got} of {len(view)} bytes by the deadline") from None
            if stop is not None and stop():
                raise PeerGone("closed while receiving") from None
            continue
        except OSError as e:
            raise PeerGone(f"connection lost while receiving: {e}") from e
        if n == 0:
            raise PeerGone(f"peer closed the connection ({got} of {len(view)} bytes received)")
        got += n


def discard(sock: socket.socket, num_bytes: int, deadline: float) -> None:
    """Read and drop `num_bytes` (a refused payload), so the next frame starts where it should."""
    scratch = memoryview(bytearray(min(num_bytes, 1 << 20)))
    while num_bytes > 0:
        n = min(num_bytes, len(scratch))
        recv_into(sock, scratch[:n], deadline)
        num_bytes -= n


def recv_frame_header(sock: socket.socket, deadline: float | None, stop=None,
                      max_json_bytes: int = DEFAULT_MAX_JSON_BYTES,
                      max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                      body_timeout_s: float = 30.0) -> FrameHeader:
    """Read HEADER and JSON; the caller reads (or discards) `inline_payload_bytes` next.

    `deadline` bounds the wait for the frame to start; once it has, the rest must come within
    `body_timeout_s`."""
    raw = bytearray(HEADER.size)
    view = memoryview(raw)
    recv_into(sock, view[:1], deadline, stop)
    body_deadline = time.monotonic() + body_timeout_s
    recv_into(sock, view[1:], body_deadline)
    kind, flags, json_len, payload_bytes, checksum = decode_fixed_header(bytes(raw), max_json_bytes,
                                                                         max_payload_bytes)
    body = bytearray(json_len)
    recv_into(sock, memoryview(body), body_deadline)
    try:
        meta = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"{KINDS[kind]} frame JSON is malformed: {e}") from e
    if not isinstance(meta, dict):
        raise ProtocolError(f"{KINDS[kind]} frame JSON must be an object, got {type(meta).__name__}")
    return FrameHeader(kind, flags, meta, payload_bytes, checksum if flags & FLAG_CHECKSUM else None)


def wait_readable(sock: socket.socket, timeout_s: float) -> bool:
    """True if a read would not block (data or EOF) within `timeout_s`."""
    if hasattr(sock, "pending") and sock.pending():  # TLS: decrypted bytes already buffered
        return True
    readable, _, _ = select.select([sock], [], [], max(timeout_s, 0.0))
    return bool(readable)


def open_socket(sock: socket.socket) -> socket.socket:
    """Put a connected socket in the mode these helpers expect: short timeouts, no Nagle, big buffers."""
    sock.settimeout(POLL_S)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers and ACKs are small
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, 4 << 20)
    return sock


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port" -> (host, port)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"endpoint {endpoint!r} is invalid: expected 'host:port'")
    return host.strip("[]"), int(port)
