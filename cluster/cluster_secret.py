"""The cluster secret: what lets a process into the internal plane (worker gRPC services, KV-transfer
handshakes, registry entries). Every component of one cluster holds the same secret; `duet up` generates it,
Helm keeps it in a Secret, the Ray launcher passes it in the runtime env.

    source   --cluster-secret-file PATH (its content, stripped), overridden by $DUET_CLUSTER_SECRET
    gRPC     each internal call carries `authorization: Bearer <grpc_token(secret)>`; workers refuse a call
             without it (UNAUTHENTICATED), except health checks and reflection, which probes use
    KV       a sender's HELLO carries a MAC over a fresh nonce, its time and its layout fingerprint
    registry each entry carries a MAC over its fields: the router ignores an entry it cannot verify

Each use gets its own key derived from the secret (HMAC-SHA256 with a purpose label), so the secret itself
never crosses the wire. Without a secret (ad hoc runs, unit tests) the internal plane is open, and each
component says so once in its log.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

ENV_VAR = "DUET_CLUSTER_SECRET"


def load_cluster_secret(path: Path | str | None = None) -> bytes | None:
    """$DUET_CLUSTER_SECRET if set, else the content of `path` (stripped), else None. An empty secret is
    refused (ValueError): it would look like protection and give none."""
    text = os.environ.get(ENV_VAR)
    if text is None and path is not None:
        text = Path(path).read_text(encoding="utf-8")
    if text is None:
        return None
    if not text.strip():
        raise ValueError(f"the cluster secret ({ENV_VAR} or {path}) is empty: give at least 16 characters")
    return text.strip().encode()


def generate_cluster_secret() -> str:
    return secrets.token_hex(32)


def derived_key(secret: bytes, purpose: str) -> bytes:
    return hmac.new(secret, b"duet/" + purpose.encode(), hashlib.sha256).digest()


def kv_handshake_key(secret: bytes) -> bytes:
    """The key KV senders prove they hold in a HELLO (kvtransfer/handshake_auth.py)."""
    return derived_key(secret, "kv-handshake")


def grpc_token(secret: bytes) -> str:
    """The bearer token internal gRPC calls carry: derived, so a token seen on the wire reveals no other key."""
    return derived_key(secret, "grpc").hex()


def mac(secret: bytes, purpose: str, *parts: str) -> str:
    """HMAC-SHA256 (hex) of `parts` under the key for `purpose`; parts are length-prefixed, so no two
    different part lists give the same message."""
    message = b"".join(len(p.encode()).to_bytes(8, "little") + p.encode() for p in parts)
    return hmac.new(derived_key(secret, purpose), message, hashlib.sha256).hexdigest()


def verify(secret: bytes, purpose: str, given: object, *parts: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given, mac(secret, purpose, *parts))
