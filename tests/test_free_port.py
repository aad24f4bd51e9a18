"""The tests' loopback ports (server.testing.daemon.free_port): a daemon started on one must
never find it taken by an outbound connection the kernel handed it in the meantime."""
import socket
from pathlib import Path

import pytest

from server.testing import daemon


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_ports_are_below_the_ephemeral_range_and_never_given_twice():
    ports = [daemon.free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < _ephemeral_low() for p in ports)


def test_xdist_workers_draw_from_disjoint_slices(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    windows = []
    for w in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", w)
        windows.append(set(daemon._port_window()))
    assert all(windows) and not (windows[0] & windows[1] or windows[1] & windows[2]
                                 or windows[0] & windows[2])
    assert max(max(w) for w in windows) < _ephemeral_low()


def test_a_taken_port_is_skipped_and_a_spent_window_falls_back(monkeypatch):
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        taken, other = a.getsockname()[1], b.getsockname()[1]
        b.close()
        a.listen(1)
        lo, hi = sorted((taken, other))
        monkeypatch.setattr(daemon, "_port_window", lambda: range(lo, hi + 1, hi - lo))   # the two
        monkeypatch.setattr(daemon, "_GIVEN", set())
        assert daemon.free_port() == other
        fallback = daemon.free_port()          # the window is spent: a port from bind(0)
        assert fallback not in (taken, other)
