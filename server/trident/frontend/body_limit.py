"""Bounds on request bodies: one over the size limit is answered 413 (OpenAI-style JSON naming the limit) before
more of it is read, whether it declares its size (``Content-Length``) or arrives chunked; one that takes longer
than the deadline to arrive (a client sending a byte now and then) is answered 408; and the bodies held at once,
from their first byte until their request is answered, stay within a total (``frontend.max_buffered_bytes``): a
request past it is answered 503 at once."""

from __future__ import annotations

import asyncio
import time

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trident.frontend.responses import error_body


class BodyLimit:
    """ASGI middleware: reads a request's body up to ``limit`` bytes within ``deadline_s``, then hands it to ``app``
    whole."""

    def __init__(self, app: ASGIApp, limit: int, deadline_s: float, total: int | None = None) -> None:
        self.app = app
        self.limit = limit
        self.deadline_s = deadline_s
        self.total = total  # bytes held at once, all requests together
        self.held = 0

    async def _busy(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (f"this server holds {self.held} bytes of request bodies, its limit being {self.total} "
                   "(frontend.max_buffered_bytes); retry shortly")
        await JSONResponse(error_body(message, 503), status_code=503, headers={"Retry-After": "1"})(
            scope, receive, send)

    async def _too_slow(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (f"the request body did not arrive within {self.deadline_s:g} s, this server's limit "
                   "(frontend.body_timeout_s)")
        await JSONResponse(error_body(message, 408), status_code=408, headers={"Connection": "close"})(
            scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is larger than {self.limit} bytes, this server's limit (frontend.max_body_bytes)"
        await JSONResponse(error_body(message, 413), status_code=413)(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        return await self._read(scope, receive, send, int(declared) if declared.isdigit() else 0)

    async def _read(self, scope: Scope, receive: Receive, send: Send, declared: int) -> None:
        """The body read, counted against the total from the first byte to the request's answer."""
        counted = 0

        def count(n: int) -> bool:
            nonlocal counted
            if self.total is not None and self.held + n > self.total:
                return False
            self.held += n
            counted += n
            return True

        try:
            if not count(declared):
                return await self._busy(scope, receive, send)
            parts, size = [], 0
            end = time.monotonic() + self.deadline_s
            while True:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, end - time.monotonic()))
                except asyncio.TimeoutError:
                    return await self._too_slow(scope, receive, send)
                if message["type"] != "http.request":  # the client went away
                    return None
                parts.append(message.get("body", b""))
                size += len(parts[-1])
                if size > self.limit:
                    return await self._refuse(scope, receive, send)
                if size > counted and not count(size - counted):  # (a chunked body, or one longer than declared)
                    return await self._busy(scope, receive, send)
                if not message.get("more_body", False):
                    break
            return await self._handle(scope, receive, send, b"".join(parts))
        finally:
            self.held -= counted

    async def _handle(self, scope: Scope, receive: Receive, send: Send, whole: bytes) -> None:
        body: Message | None = {"type": "http.request", "body": whole, "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                first, body = body, None
                return first
            return await receive()  # after the body: a disconnect, for streaming responses

        await self.app(scope, replay, send)
