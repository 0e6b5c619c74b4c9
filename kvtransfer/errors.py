"""Errors of a KV transfer. Every one is a `TransferError`, so a caller can catch them all at once.

The receiver sends an error back to the sender by class name in an ack (`error_for_kind` maps the
name back), so a sender's future fails with the same class the receiver raised.
"""

from __future__ import annotations


class TransferError(Exception):
    """A transfer failed; the message says what and why."""


class LayoutMismatch(TransferError):
    """The handshake found sender and receiver caches laid out differently (the message names each field)."""


class ReservationExpired(TransferError):
    """The reservation is unknown, already popped (committed or released), or past its deadline."""


class ChecksumMismatch(TransferError):
    """The payload's xxh3_64 differs from the checksum the sender computed: bytes changed in flight."""


class TransferTimeout(TransferError):
    """A deadline passed (connect, handshake, payload, or ack)."""


class PeerGone(TransferError):
    """The connection was lost or closed by the peer (or by our own `close()`)."""


class Unauthenticated(TransferError):
    """The handshake did not prove knowledge of the cluster secret (none, a wrong one, stale, or replayed), or
    its TLS handshake failed (no certificate, or one the cluster's CA did not sign)."""


class ProtocolError(TransferError):
    """A frame was malformed, oversized or unexpected; the connection that carried it is closed."""


_BY_NAME: dict[str, type[TransferError]] = {
    cls.__name__: cls
    for cls in (TransferError, LayoutMismatch, ReservationExpired, ChecksumMismatch, TransferTimeout, PeerGone,
                ProtocolError, Unauthenticated)
}


def error_for_kind(kind: str, message: str) -> TransferError:
    """The exception for an ack's error kind; an unknown kind (e.g. "ValueError") becomes a TransferError."""
    cls = _BY_NAME.get(kind)
    if cls is None:
        return TransferError(f"{kind}: {message}")
    return cls(message)
