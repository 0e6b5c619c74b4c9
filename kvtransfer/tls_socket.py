"""TLS on a KV-transfer connection (cluster/internal_tls.py makes the contexts).

A connection is used by two threads at once: the sender writes WRITE frames while its ACK reader reads, and
the receiver reads frames while its applier writes ACKs. OpenSSL allows one call at a time on a connection
(TLS 1.3 reads may write: key updates, tickets), so TLSSocket runs the socket non-blocking, holds a lock
for each SSL call only, and waits for readiness (select) without it: a reader waiting for the next frame
never stalls a writer.

It offers what kvtransfer/messages.py uses of a socket, with a plain socket's timeout behaviour: `send` and
`recv_into` raise TimeoutError after `poll_s` without progress, so the callers' deadline and stop checks run.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Callable

from kvtransfer.errors import PeerGone, TransferTimeout, Unauthenticated


class TLSSocket:
    def __init__(self, tls: ssl.SSLSocket, poll_s: float):
        """Wraps `tls`, whose handshake `handshake()` then does."""
        self._tls = tls
        self._lock = threading.Lock()
        self._poll_s = poll_s
        self.family = tls.family

    def handshake(self, timeout_s: float, peer: str) -> TLSSocket:
        """Within `timeout_s`: TransferTimeout past it, Unauthenticated for a certificate the context refuses
        (or none), PeerGone if the connection breaks. The socket is closed on failure."""
        self._tls.settimeout(timeout_s)
        try:
            self._tls.do_handshake()
        except TimeoutError:
            self._tls.close()
            raise TransferTimeout(f"TLS handshake with the {peer} did not finish within {timeout_s} s") from None
        except ssl.SSLError as e:
            self._tls.close()
            raise Unauthenticated(f"TLS handshake with the {peer} failed: {e}") from e
        except OSError as e:
            self._tls.close()
            raise PeerGone(f"TLS handshake with the {peer} failed: {e}") from e
        self._tls.setblocking(False)
        return self

    def send(self, data: memoryview) -> int:
        return self._call(self._tls.send, data)

    def recv_into(self, view: memoryview) -> int:
        return self._call(self._tls.recv_into, view)

    def pending(self) -> int:
        """Bytes already decrypted and buffered: readable now though select() on the socket says no."""
        with self._lock:
            return self._tls.pending()

    def fileno(self) -> int:
        return self._tls.fileno()

    def getsockname(self):
        return self._tls.getsockname()

    def shutdown(self, how: int) -> None:
        """Shut the TCP connection down under both threads (not a TLS close_notify, which would need the lock)."""
        socket.socket.shutdown(self._tls, how)

    def close(self) -> None:
        with self._lock:
            self._tls.close()

    def _call(self, op: Callable[[memoryview], int], view: memoryview) -> int:
        give_up = time.monotonic() + self._poll_s
        while True:
            with self._lock:
                if self._tls.fileno() < 0:
                    raise OSError("TLS connection closed")
                try:
                    return op(view)
                except ssl.SSLWantReadError:
                    wait_read = True
                except ssl.SSLWantWriteError:
                    wait_read = False
            remaining_s = give_up - time.monotonic()
            if remaining_s <= 0:
                raise TimeoutError("TLS socket not ready")
            fd = [self._tls]
            try:
                select.select(fd if wait_read else [], [] if wait_read else fd, [], remaining_s)
            except ValueError:  # closed by the other thread meanwhile
                raise OSError("TLS connection closed") from None


def wrap_client(sock: socket.socket, context: ssl.SSLContext, server_name: str, timeout_s: float,
                poll_s: float) -> TLSSocket:
    """The sending side, handshaken within `timeout_s`; the receiver's certificate must name `server_name`."""
    tls = context.wrap_socket(sock, server_hostname=server_name, do_handshake_on_connect=False)
    return TLSSocket(tls, poll_s).handshake(timeout_s, "receiver")


def server_side(sock: socket.socket, context: ssl.SSLContext, poll_s: float) -> TLSSocket:
    """The receiving side, before its handshake (so `shutdown()` can interrupt a handshake that hangs)."""
    return TLSSocket(context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), poll_s)
