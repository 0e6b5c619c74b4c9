"""Proof in a HELLO that the sender holds the cluster's KV key (cluster/cluster_secret.py derives it), so a
stranger who can reach a receiver's port cannot open a channel and write into reserved blocks.

    auth = {nonce: 16 random bytes (hex), time_ms: sender's wall clock,
            mac: HMAC-SHA256(key, nonce|time_ms|fingerprint)}

The receiver accepts a HELLO whose mac verifies, whose time is within MAX_SKEW_S of its own clock, and whose
nonce it has not seen within that window (a recorded HELLO replayed later is refused). The channel itself is
encrypted only under internal TLS (cluster/internal_tls.py, kvtransfer/tls_socket.py): on a network where others
can read or alter traffic, turn that on or keep the network private.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from typing import Any

MAX_SKEW_S = 60.0


def _mac(key: bytes, nonce: str, time_ms: int, fingerprint: str) -> str:
    return hmac.new(key, f"{nonce}|{time_ms}|{fingerprint}".encode(), hashlib.sha256).hexdigest()


def prove(key: bytes, fingerprint: str) -> dict[str, Any]:
    nonce, time_ms = secrets.token_hex(16), int(time.time() * 1000)
    return {"nonce": nonce, "time_ms": time_ms, "mac": _mac(key, nonce, time_ms, fingerprint)}


class HandshakeVerifier:
    """The receiver's side: `check` returns None for a valid proof, else why not. Thread-safe."""

    def __init__(self, key: bytes, clock=time.time):
        self._key, self._clock = key, clock
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten
        self._lock = threading.Lock()

    def check(self, auth: object, fingerprint: str) -> str | None:
        if not isinstance(auth, dict):
            return "HELLO carries no proof of the cluster secret"
        nonce, time_ms, given = auth.get("nonce"), auth.get("time_ms"), auth.get("mac")
        if not (isinstance(nonce, str) and isinstance(time_ms, int) and isinstance(given, str)):
            return "HELLO's proof is malformed"
        if not hmac.compare_digest(given, _mac(self._key, nonce, time_ms, fingerprint)):
            return "HELLO's proof does not verify: a different cluster secret"
        now = self._clock()
        if abs(now - time_ms / 1000) > MAX_SKEW_S:
            return f"HELLO's proof is {now - time_ms / 1000:+.0f} s off this receiver's clock (at most {MAX_SKEW_S:g})"
        with self._lock:
            for old in [n for n, until in self._seen.items() if until < now]:
                del self._seen[old]
            if nonce in self._seen:
                return "HELLO's proof was used before (a replay)"
            self._seen[nonce] = now + 2 * MAX_SKEW_S
        return None
