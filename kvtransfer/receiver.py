"""KVReceiver: the decode side's endpoint that writes arriving KV blocks into reserved cache blocks.

Threads: one accepts connections; one per connection runs HELLO/HELLO_REPLY, then its WriteStream (reads
WRITE frames, with a second thread writing them into the cache and answering each with an ACK, in order).
What a caller may rely on:
- a WRITE lands only through `ReservationTable.write`, so only into a live reservation's blocks, and never
  after that reservation was popped; a refused WRITE (expired reservation, checksum mismatch, bad ranges or
  size) leaves the cache untouched, its payload is still consumed, and the connection keeps serving;
- a checksum mismatch also fails the reservation (`wait_complete` raises ChecksumMismatch);
- a handshake whose layout differs is answered with an error naming each differing field, and only that
  connection is closed; a malformed or oversized frame gets an error ACK, then its connection is closed;
- a connection whose peer vanishes ends its thread (PeerGone at once on EOF/reset, TransferTimeout once a
  started frame stalls past `recv_timeout_s`), and the receiver keeps serving the others;
- `close()` stops accepting, closes every connection and process group, and joins every thread, within
  ~0.1 s, except that a gloo receive or group formation already under way cannot be interrupted: it ends when
  its payload arrives, its peer goes away, or at its deadline (`recv_timeout_s` / `handshake_timeout_s`).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import socket
import ssl
import threading
import time
from typing import Any

import torch

from kvtransfer import messages as m
from kvtransfer import process_group as pgs
from kvtransfer import tls_socket
from kvtransfer.errors import LayoutMismatch, PeerGone, ProtocolError, TransferError, Unauthenticated
from kvtransfer.handshake_auth import HandshakeVerifier
from kvtransfer.layout import KVLayout
from kvtransfer.reservation import ReservationTable
from kvtransfer.write_stream import WriteStream, error_ack

log = logging.getLogger("duet.kvtransfer")
TRANSPORTS = ("tcp", "torch")


class KVReceiver:
    """Decode side. Listens on TCP; each connection does a handshake then carries messages."""

    def __init__(self, layout: KVLayout, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 reservations: ReservationTable, host: str = "127.0.0.1", port: int = 0,
                 max_payload_bytes: int = m.DEFAULT_MAX_PAYLOAD_BYTES, *, handshake_timeout_s: float = 10.0,
                 recv_timeout_s: float = 30.0, handshake_key: bytes | None = None,
                 tls_context: ssl.SSLContext | None = None):
        """With `handshake_key`, only senders that prove they hold it are served (kvtransfer/handshake_auth);
        with `tls_context`, connections are TLS (a sender without a certificate it trusts is refused) and only
        the "tcp" transport is served (the "torch" one would send payloads around the encryption)."""
        layout.check_caches(kv_caches)
        if reservations.num_layers != layout.num_layers:
            raise ValueError(f"reservations track {reservations.num_layers} layers: must be {layout.num_layers}")
        if max_payload_bytes < 1:
            raise ValueError(f"max_payload_bytes={max_payload_bytes} is invalid: must be >= 1")
        self.layout = layout
        self.kv_caches = kv_caches
        self.reservations = reservations
        self.host, self.port = host, port
        self.max_payload_bytes = max_payload_bytes
        self.handshake_timeout_s = handshake_timeout_s
        self.recv_timeout_s = recv_timeout_s
        self._verifier = HandshakeVerifier(handshake_key) if handshake_key is not None else None
        self._tls_context = tls_context
        self._device = kv_caches[0][0].device
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._connections: dict[int, tuple[socket.socket, threading.Thread]] = {}
        self._groups: dict[int, Any] = {}
        self._conn_ids = itertools.count(1)
        self._store = None  # TCPStore for the "torch" transport, made on first use
        self._instance = secrets.token_hex(6)  # store prefixes stay unique across receivers sharing nothing

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._listener = socket.create_server((self.host, self.port), family=family)
        self._listener.settimeout(m.POLL_S)
        self.port = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kv-recv-accept", daemon=True)
        self._accept_thread.start()

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def num_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join()
        with self._lock:
            connections = list(self._connections.values())
            groups = list(self._groups.values())
        for sock, _ in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on this socket
            except OSError:
                pass
        for pg in groups:
            pgs.close_group(pg)
        for _, thread in connections:
            thread.join()
        self._store = None

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # listener closed
            conn_id = next(self._conn_ids)
            thread = threading.Thread(target=self._serve, args=(conn_id, m.open_socket(sock), peer),
                                      name=f"kv-recv-{conn_id}", daemon=True)
            with self._lock:
                self._connections[conn_id] = (sock, thread)
            thread.start()

    # -- one connection --------------------------------------------------------------------------------

    def _serve(self, conn_id: int, sock: socket.socket, peer: Any) -> None:
        pg = None
        try:
            if self._tls_context is not None:
                sock = tls_socket.server_side(sock, self._tls_context, m.POLL_S)
                with self._lock:  # close() must shut this one down, the raw socket is detached
                    self._connections[conn_id] = (sock, self._connections[conn_id][1])
                if self._stop.is_set():
                    raise PeerGone("receiver closed")
                sock.handshake(self.handshake_timeout_s, "sender")
            accepted, pg = self._handshake(conn_id, sock)
            if accepted:
                WriteStream(sock, pg, self.layout, self.kv_caches, self.reservations, self.max_payload_bytes,
                            self.recv_timeout_s, self._stop.is_set).serve()
        except ProtocolError as e:
            log.warning("kvtransfer receiver conn=%d peer=%s event=protocol_error error=%s", conn_id, peer, e)
            try:  # tell the sender why before closing; the frame's JSON may be unread, so no seq
                m.send_all(sock, m.encode_frame_header(m.ACK, error_ack(None, e)), time.monotonic() + 1.0)
            except TransferError:
                pass
        except TransferError as e:
            log.info("kvtransfer receiver conn=%d peer=%s event=closed reason=%s", conn_id, peer, e)
        finally:
            sock.close()
            pgs.close_group(pg)
            with self._lock:
                self._connections.pop(conn_id, None)
                self._groups.pop(conn_id, None)

    def _handshake(self, conn_id: int, sock: socket.socket) -> tuple[bool, Any]:
        deadline = time.monotonic() + self.handshake_timeout_s
        hello = m.recv_frame_header(sock, deadline, self._stop.is_set, max_payload_bytes=0,
                                    body_timeout_s=self.handshake_timeout_s)
        if hello.kind != m.HELLO:
            raise ProtocolError(f"expected HELLO, got {m.KINDS[hello.kind]}")
        transport = hello.meta.get("transport")
        reply = self._hello_reply(conn_id, hello.meta)
        m.send_all(sock, m.encode_frame_header(m.HELLO_REPLY, reply), deadline)
        if not reply["ok"]:
            log.info("kvtransfer receiver conn=%d event=handshake_refused reason=%s", conn_id, reply["message"])
            return False, None
        if transport != "torch":
            return True, None
        pg = pgs.pair_group(self._store, reply["store_prefix"], pgs.RECEIVER_RANK, sock.getsockname()[0],
                            self._device, self.handshake_timeout_s)
        with self._lock:
            self._groups[conn_id] = pg
        if self._stop.is_set():  # close() ran while the group was forming and could not abort it
            raise ProtocolError("receiver closed during the handshake")
        return True, pg

    def _hello_reply(self, conn_id: int, hello: dict[str, Any]) -> dict[str, Any]:
        """HELLO_REPLY fields: ok (+ where to meet for "torch"), or the error the sender will raise."""
        try:
            sender_layout = KVLayout.from_dict(hello.get("layout"))
            if sender_layout.fingerprint() != hello.get("fingerprint"):
                raise ValueError("its fingerprint does not match its fields (a different canonical encoding?)")
        except (TypeError, ValueError) as e:
            return {"ok": False, "error": ProtocolError.__name__, "message": f"HELLO layout is invalid: {e}"}
        if self._verifier is not None and (problem := self._verifier.check(hello.get("auth"),
                                                                           sender_layout.fingerprint())):
            return {"ok": False, "error": Unauthenticated.__name__, "message": problem}
        if problem := sender_layout.mismatch(self.layout):
            return {"ok": False, "error": LayoutMismatch.__name__, "message": f"KV layout mismatch: {problem}"}
        transport = hello.get("transport")
        allowed = [t for t in TRANSPORTS if t != "torch" or (pgs.available() and self._tls_context is None)]
        if transport not in allowed:
            return {"ok": False, "error": TransferError.__name__,
                    "message": f"transport {transport!r} is unsupported: allowed {allowed}"}
        reply: dict[str, Any] = {"ok": True, "max_payload_bytes": self.max_payload_bytes}
        if transport == "torch":
            reply["store_port"] = self._store_port()
            reply["store_prefix"] = f"duet-kv/{self._instance}/{conn_id}"
        return reply

    def _store_port(self) -> int:
        with self._lock:
            if self._store is None:
                self._store = pgs.host_store(self.host, self.handshake_timeout_s)
            return self._store.port
