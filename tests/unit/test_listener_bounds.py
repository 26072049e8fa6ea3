"""A worker's listeners against a flood: its TCP stage socket holds a bounded number of handshakes per peer and in all
(the rest are closed at once, unread, and logged in one line a minute), and its /health holds a bounded number of
connections, each for a bounded time. Callers of the deployment are served meanwhile."""

from __future__ import annotations

import logging
import socket
import time

import pytest
import requests

from trident.core import auth
from trident.core.netutil import free_ports
from trident.core.stagecall.handshakes import PER_PEER, TOTAL, Handshakes
from trident.core.stagecall.server import StageServer
from trident.worker import health as health_module
from trident.worker.health import Health


def _first_bytes(sock: socket.socket, timeout: float = 3.0) -> bytes | None:
    """What the server sent first: the handshake's hello, or b"" / None when it closed the connection unread."""
    sock.settimeout(timeout)
    try:
        return sock.recv(64)
    except ConnectionResetError:
        return None


def test_one_peer_holds_at_most_its_share_of_handshakes_and_refusals_are_one_line(caplog):
    server = StageServer(lambda call: {}, lambda message: None, "127.0.0.1")
    server.start()
    flood = []
    try:
        with caplog.at_level(logging.WARNING, logger="trident.worker"):
            for _ in range(PER_PEER + 24):
                flood.append(socket.create_connection(server.address, timeout=5))
            answers = [_first_bytes(s) for s in flood]
        held = [a for a in answers if a]
        assert len(held) == PER_PEER  # each got the hello and holds a handshake; the rest were closed unread
        lines = [r for r in caplog.records if "refused" in r.getMessage()]
        assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]
        assert "127.0.0.1 has 16 handshakes open" in lines[0].getMessage()
        # the deployment's callers meanwhile: another address over TCP, and this host's over the Unix socket
        other = socket.socket()
        other.bind(("127.0.0.2", 0))
        other.connect(server.address)
        auth.connect(other, auth.identity(server.address))
        other.close()
        local = socket.socket(socket.AF_UNIX)
        local.connect(server.path)
        auth.connect(local, auth.identity(server.path))
        local.close()
    finally:
        for s in flood:
            s.close()
        server.stop(drain_s=1)


def test_handshakes_are_bounded_in_all_and_freed_when_done(caplog):
    log = logging.getLogger("test.handshakes")
    bounds = Handshakes(log, per_peer=2, total=3, every_s=60)
    assert [bounds.admit("a"), bounds.admit("a"), bounds.admit("a")] == [True, True, False]
    assert [bounds.admit("b"), bounds.admit("c")] == [True, False]  # (3 in all)
    bounds.done("a")
    assert bounds.admit("c") and bounds.open_now() == 3
    assert len(caplog.records) == 1  # the first refusal's line; the second's is counted for the next
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="test.handshakes"):
        for _ in range(100):
            bounds.refused("a failed proof")
    assert len(caplog.records) == 0  # (within the minute of the first line)
    bounds.every_s = 0
    with caplog.at_level(logging.WARNING, logger="test.handshakes"):
        bounds.refused("a failed proof")
    assert len(caplog.records) == 1 and "refused 102 connection(s)" in caplog.records[0].getMessage()
    assert TOTAL >= 4 * PER_PEER  # (several peers at their share fit at once)


def test_health_holds_a_bounded_number_of_connections_for_a_bounded_time(monkeypatch):
    monkeypatch.setattr(health_module, "DEADLINE_S", 0.5)
    port = free_ports(1)[0]
    health = Health("127.0.0.1", port)
    health.state = "serving"
    silent = []
    try:
        for _ in range(health_module.CONNECTIONS):
            silent.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.1)
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert _first_bytes(extra, 2) in (b"", None)  # closed at once: the slots are taken
        extra.close()
        t0 = time.monotonic()
        for s in silent:  # each cut at its deadline, though it sent nothing (or a byte at a time)
            s.sendall(b"G")
            assert _first_bytes(s, 5) in (b"", None)
        assert time.monotonic() - t0 < 3
        assert requests.get(f"http://127.0.0.1:{port}/health", timeout=5).text == "serving"
    finally:
        for s in silent:
            s.close()
        health.close()


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv(auth.ENV, "a-test-secret-of-enough-length-0123456789")
