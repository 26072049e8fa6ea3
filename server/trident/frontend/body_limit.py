"""Bounds on request bodies: one over the size limit is answered 413 (OpenAI-style JSON naming the limit) before
more of it is read, whether it declares its size (``Content-Length``) or arrives chunked; one that takes longer
than the deadline to arrive (a client sending a byte now and then) is answered 408."""

from __future__ import annotations

import asyncio
import time

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .responses import error_body


class BodyLimit:
    """ASGI middleware: reads a request's body up to ``limit`` bytes within ``deadline_s``, then hands it to ``app``
    whole."""

    def __init__(self, app: ASGIApp, limit: int, deadline_s: float) -> None:
        self.app = app
        self.limit = limit
        self.deadline_s = deadline_s

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
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(parts), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                first, body = body, None
                return first
            return await receive()  # after the body: a disconnect, for streaming responses

        await self.app(scope, replay, send)
