"""The OpenAI frontend's connection and body bounds, on a real uvicorn (the frontend's protocol) and on the ASGI
middleware: idle keep-alive connections give way to a new request at the connection limit, and the request bodies
held at once stay within their total."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from trident.frontend.body_limit import BodyLimit
from trident.frontend.header_deadline import header_deadline_protocol
from trident.frontend.idle_reclaim import ReclaimIdle
from trident.core.netutil import free_ports

LIMIT = 3  # connections


async def _ok(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def served():
    port = free_ports(1)[0]
    config = uvicorn.Config(_ok, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=60,
                            limit_concurrency=LIMIT, http=header_deadline_protocol(10, base=ReclaimIdle))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


def _request(sock: socket.socket) -> bytes:
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.endswith((b"ok", b"Service Unavailable")):
        chunk = sock.recv(4096)
        if not chunk:
            break
        answer += chunk
    return answer


def test_idle_keep_alive_connections_give_way_to_a_request(served):
    idle = []
    for _ in range(LIMIT):  # each answered, then kept open by its client: idle on its keep-alive timer
        sock = socket.create_connection(("127.0.0.1", served), timeout=5)
        assert _request(sock).startswith(b"HTTP/1.1 200")
        idle.append(sock)
        time.sleep(0.05)
    newcomer = socket.create_connection(("127.0.0.1", served), timeout=5)
    assert _request(newcomer).startswith(b"HTTP/1.1 200")  # (before: 503, the idle ones counted against the limit)
    idle[0].settimeout(5)
    assert idle[0].recv(1) == b""  # the one idle longest was closed for it
    assert _request(idle[-1]).startswith(b"HTTP/1.1 200")  # the others still serve
    for sock in (*idle, newcomer):
        sock.close()


def test_the_bodies_held_at_once_stay_within_their_total():
    """A body is counted from its declared size (or as it arrives) until its request is answered: one that would
    take the total past the limit is answered 503 at once, and the room comes back when the first is answered."""
    answers: list[int] = []
    seen: list[bytes] = []

    async def app(scope, receive, send):
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    bounded = BodyLimit(app, limit=100, deadline_s=5, total=150)

    async def request(size: int, arrive: asyncio.Event | None = None) -> None:
        scope = {"type": "http", "headers": [(b"content-length", str(size).encode())]}

        async def receive():
            if arrive is not None:
                await arrive.wait()
            return {"type": "http.request", "body": b"x" * size, "more_body": False}

        async def send(message):
            if message["type"] == "http.response.start":
                answers.append(message["status"])

        await bounded(scope, receive, send)

    async def main():
        slow = asyncio.Event()
        first = asyncio.ensure_future(request(100, slow))  # (its body still coming)
        await asyncio.sleep(0.01)
        assert bounded.held == 100
        await request(100)  # 200 more would pass the 150
        assert answers == [503]
        await request(40)  # (within what is left)
        slow.set()
        await first
        assert answers == [503, 200, 200] and bounded.held == 0
        await request(100)
        assert answers[-1] == 200

    asyncio.run(main())
    assert sorted(len(b) for b in seen) == [40, 100, 100]
