"""Free TCP ports for processes that will listen on them a moment later.

A port found by binding port 0 comes from the kernel's ephemeral range, where the next outgoing connection or
bind(0) of any process (a gloo rendezvous, a Redis client) may take it before its new owner listens on it:
`duet up` lost a worker to exactly that. Ports below the ephemeral range are handed out only to whoever asks
for them by number, so they are picked there, at random, and checked by binding.
"""
from __future__ import annotations

import random
import socket

_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 10000  # below: well-known and registered services
_ATTEMPTS = 200


def _ephemeral_low() -> int:
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems without the file use 49152 and up


def pick_free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports outside the ephemeral range that were free a moment ago (held open together, so no
    duplicates); bind(0) ports when that range is too narrow to find them."""
    socks: list[socket.socket] = []
    rng = random.SystemRandom()
    high = _ephemeral_low()
    try:
        for _ in range(_ATTEMPTS if high - _LOWEST >= 100 * n else 0):
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, rng.randrange(_LOWEST, high)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def pick_free_port(host: str = "127.0.0.1") -> int:
    return pick_free_ports(1, host)[0]


def is_port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on host:port now. Bound as servers bind (SO_REUSEADDR), so a connection
    of a past listener lingering in TIME_WAIT does not count; only a socket bound there does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.create_server((host, port), family=family):
            return True
    except OSError:
        return False
