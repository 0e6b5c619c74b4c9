"""engine/ports.py: ports for components are picked below the kernel's ephemeral range, where no outgoing
connection or bind(0) of another process can take one before its component listens (a CI run lost a TP
decode worker to exactly that)."""

from __future__ import annotations

import socket

from engine import ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    picked = ports.pick_free_ports(16)
    assert len(set(picked)) == 16
    assert all(10000 <= p < ports._ephemeral_low() for p in picked)
    for port in picked:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_bind0_port_is_never_picked(monkeypatch):
    # a bind(0) socket held open: its port lies in the ephemeral range, which is never searched
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        assert held.getsockname()[1] >= ports._ephemeral_low()
        assert held.getsockname()[1] not in ports.pick_free_ports(32)


def test_without_room_below_the_ephemeral_range_it_falls_back_to_bind0(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports._LOWEST + 10)
    picked = ports.pick_free_ports(3)
    assert len(set(picked)) == 3 and all(p > ports._LOWEST + 10 for p in picked)
