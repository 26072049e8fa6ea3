"""The bounded front of Triton's HTTP and metrics ports, in the head process.

Triton 2.51 (the one PyTriton 0.7 bundles) reads request bodies of any size, and a chunked body of many small chunks
ends it: its HTTP server puts one entry per chunk on the stack (2,000,000 one-byte chunks, about 12 MB, from anyone:
SIGSEGV). ``--http-max-input-size`` and the fix came with 2.59.1, and libevhtp is linked into the binary, out of the
shim's reach. So Triton's HTTP and metrics servers listen on Unix sockets in the server's workspace (its user's
alone: no other local user reaches them either), and this front listens on the public ports in their place:

- a body over :func:`max_body_bytes` (what the media limits let one request carry, base64) is answered 413 before
  more of it is read, and a chunked one reaches Triton in pieces of at least :data:`PIECE` bytes (whatever size
  the client's chunks are);
- a compressed body (``Content-Encoding``) is inflated here, within the same bound, and reaches Triton plain;
- the answer goes back as Triton writes it (a ``generate_stream`` event by event), and a client that goes away
  closes its connection to Triton at once (not at Triton's next write), which stops its request; an answer Triton
  breaks off (it died) is cut off for the client too, never ended as if it were whole;
- while Triton does not answer (starting, restarting, stopped) every request gets 503;
- a body that is not the JSON Triton expects gets 400 (Triton 2.51 answers its JSON reader's errors 500), and a
  request whose python-backend stub missed its health window 503 with Retry-After (Triton answers it 400);
- with ``scheduler: ensemble``, an inference request to an entry model (``/v2/models/<entry>[/versions/<n>]/infer``,
  ``generate``, ``generate_stream``) is read whole (within the same bound) and reaches Triton with the stage
  credential as a request parameter in its JSON, in place of any the client sent (:mod:`.entry_credential`). An
  entry model that is a Triton ensemble forwards it to its steps (:mod:`.grpc_front` does the same for gRPC).

With a Triton that has the fix (``http-max-input-size``), the front is not needed; PyTriton 0.7 brings 2.51.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import ClientError, ClientSession, ClientTimeout, UnixConnector, web
from yarl import URL

from trident.core.config import MediaLimits, MiB
from trident.supervisor.loop_thread import LoopThread
from trident.supervisor.startup import StartupError

if TYPE_CHECKING:
    from trident.supervisor.entry_credential import CredentialForEntries

log = logging.getLogger("trident.supervisor")

PIECE = 1 * MiB  # a chunked body reaches Triton in pieces this large at least (the last may be smaller)
TEXT_ALLOWANCE = 16 * MiB  # a request's prompt, sampling parameters and JSON around its media
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding",
    "upgrade", "host", "content-length", "expect",
})  # (not passed on, either way)
NOT_TO_TRITON = HOP_BY_HOP | {"content-encoding"}  # (the front inflates a compressed body)


INFERENCE = re.compile(r"^/v2/models/([^/]+)(?:/versions/[^/]+)?/(infer|generate|generate_stream)$")
"""Triton's inference paths (the model name, raw as Triton reads it; the endpoint)."""

JSON_ERRORS = (b'{"error":"failed to parse the request JSON', b'{"error":"Unable to parse JSON',
               b'{"error":"attempt to access JSON')
"""How Triton 2.51 begins the 500 it answers a body that is not the JSON it expects with (its JSON reader's errors
are internal ones): the front answers them 400, as the client's error they are."""


STUB_UNHEALTHY = (b'{"error":"Stub process \'', b"' is not healthy")
"""How Triton 2.51 answers a request whose python-backend stub missed the backend's 1 s health window (a starved
stub, docs/reliability.md): with 400 on ``generate``, as if the client had erred. The server failed, for now: the
front answers it 503, to be tried again."""


def _client_status(status: int, body: bytes) -> int:
    """The status a client gets for Triton's small error answer ``body`` (``status`` 400 or 500)."""
    if status == 500 and body.startswith(JSON_ERRORS):
        return 400
    if body.startswith(STUB_UNHEALTHY[0]) and STUB_UNHEALTHY[1] in body:
        return 503
    return status


def max_body_bytes(media: MediaLimits) -> int:
    """The largest request body the front takes: every media item the limits allow at its largest, base64 (4/3),
    and :data:`TEXT_ALLOWANCE` for the rest."""
    return -(-media.request_bytes * 4 // 3) + TEXT_ALLOWANCE


@dataclass(frozen=True)
class Route:
    """One public port and the Unix socket of Triton's server behind it."""

    what: str  # "HTTP", "metrics"
    host: str
    port: int
    upstream: Path


def _error(status: int, message: str) -> web.Response:
    """An answer as Triton writes its own errors."""
    return web.Response(status=status, body=json.dumps({"error": message}).encode(), content_type="application/json")


class _Relay:
    """The handler of one route: each request to Triton's socket, and its answer back."""

    def __init__(self, route: Route, limit: int, entries: CredentialForEntries | None) -> None:
        self.route = route
        self.limit = limit
        self.entries = entries
        self.session: ClientSession | None = None

    async def open(self) -> None:
        # No pool limit: Triton bounds its own work. A connection to Triton per request (a Unix socket's costs
        # little): Triton's stop waits for every open HTTP connection, an idle one kept for the next request too.
        # auto_decompress off: Triton's compressed answers pass unread.
        self.session = ClientSession(
            connector=UnixConnector(path=str(self.route.upstream), limit=0, force_close=True), auto_decompress=False,
            timeout=ClientTimeout(total=None, sock_connect=5), skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def _too_large(self) -> web.Response:
        return _error(413, f"the request body is larger than {self.limit} bytes, this server's limit (what the media "
                           "limits let one request carry, base64)")

    async def _pieces(self, request: web.BaseRequest, over: list[int]):
        """The body as it arrives (inflated when compressed), in pieces of at least :data:`PIECE` bytes, counted
        against the limit (past it: ``over`` gets the count, and the body ends in an error)."""
        held, size, total = [], 0, 0
        async for data in request.content.iter_any():
            total += len(data)
            if total > self.limit:
                over.append(total)
                raise ValueError("the request body is over the limit")
            held.append(data)
            size += len(data)
            if size >= PIECE:
                yield b"".join(held)
                held, size = [], 0
        if held:
            yield b"".join(held)

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        declared = request.content_length
        if declared is not None and declared > self.limit:
            return self._too_large()
        if request.headers.get("Expect", "").lower() == "100-continue":  # (curl asks, for bodies over 1 MB)
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_TO_TRITON}
        over: list[int] = []
        plain = declared is not None and "Content-Encoding" not in request.headers
        path = INFERENCE.match(request.rel_url.raw_path) if self.entries is not None else None
        if path and path.group(1) in self.entries.entries and request.body_exists:  # (the body, read whole, with
            try:                                                                   # the credential in it)
                body = b"".join([piece async for piece in self._pieces(request, over)])
            except ValueError:
                return self._too_large()
            head = headers.pop("Inference-Header-Content-Length", None)
            body, head = self.entries.into_json(body, path.group(2) != "infer", head)
            headers["Content-Length"] = str(len(body))
            if head is not None:
                headers["Inference-Header-Content-Length"] = head
        elif plain:  # (as it came: a Content-Length body reaches Triton in whatever parts it arrives)
            headers["Content-Length"] = str(declared)
            body = request.content.iter_any() if declared else None
        else:
            body = self._pieces(request, over) if request.body_exists else None
        out = None
        try:
            target = URL("http://triton" + request.raw_path, encoded=True)
            async with self.session.request(request.method, target, headers=headers, data=body,
                                            allow_redirects=False) as answer:
                status, first = answer.status, b""
                if status in (400, 500) and answer.content_length is not None and answer.content_length < 4096:
                    first = await answer.content.read()
                out = web.StreamResponse(status=_client_status(status, first) if first else status)
                for k, v in answer.headers.items():
                    if k.lower() not in HOP_BY_HOP:
                        out.headers.add(k, v)
                if out.status == 503 and status != 503:  # (a stub that missed its health window: try again)
                    out.headers["Retry-After"] = "1"
                if answer.content_length is not None:
                    out.content_length = answer.content_length
                await out.prepare(request)
                if first:
                    await out.write(first)
                async for data in answer.content.iter_any():
                    await out.write(data)
                await out.write_eof()
                return out
        except (ClientError, OSError, ValueError) as e:
            if out is not None and out.prepared:  # Triton went away mid-answer: the client's answer is cut off, never
                if request.transport is not None:  # ended as if whole (no last chunk, or short of its length)
                    request.transport.abort()
                return out
            if over:
                return self._too_large()
            if request.transport is None or request.transport.is_closing():
                raise  # (the client went away)
            return _error(503, f"Triton is not answering ({type(e).__name__}); try again")


class HttpFront(LoopThread):
    """Listens on each route's public port (bound at :meth:`start`: a taken one is a :class:`StartupError` naming it)
    and relays to Triton's Unix sockets, in a thread of its own with its own event loop."""

    what = "the HTTP front"

    def __init__(self, routes: list[Route], limit: int, entries: CredentialForEntries | None = None) -> None:
        super().__init__()
        self.routes = routes
        self.limit = limit
        self.entries = entries
        self._sockets: list[socket.socket] = []

    def start(self) -> None:
        self._sockets = [self._bind(route) for route in self.routes]
        super().start()

    @staticmethod
    def _bind(route: Route) -> socket.socket:
        family = socket.AF_INET6 if ":" in route.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((route.host, route.port))
        except OSError as e:
            sock.close()
            raise StartupError(f"{route.what} port {route.host}:{route.port}: {e.strerror}") from None
        sock.listen(1024)
        sock.setblocking(False)
        return sock

    def _new_loop(self) -> asyncio.AbstractEventLoop:
        try:
            import uvloop

            return uvloop.new_event_loop()
        except ImportError:
            return asyncio.new_event_loop()

    async def _serve(self, started: threading.Event) -> None:
        relays, runners = [], []
        try:
            for route, sock in zip(self.routes, self._sockets):
                relay = _Relay(route, self.limit, self.entries)
                await relay.open()
                relays.append(relay)
                # (client_max_size bounds nothing read here: _Relay counts the body itself; a handler's error is a
                # 500 with no traceback for the client)
                # (handler_cancellation: a client that goes away cancels its handler at once, which closes its
                # connection to Triton, and Triton cancels the request, even while it writes nothing)
                runner = web.ServerRunner(web.Server(relay, handler_cancellation=True), handle_signals=False,
                                          access_log=None, shutdown_timeout=1.0)
                await runner.setup()
                runners.append(runner)
                await web.SockSite(runner, sock).start()
            started.set()
            await self._stopped.wait()
        finally:
            for runner in runners:
                await runner.cleanup()
            for relay in relays:
                await relay.close()
