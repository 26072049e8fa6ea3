"""A bound on request bodies: one over the limit is answered 413 (OpenAI-style JSON naming the limit) before
more of it is read, whether it declares its size (``Content-Length``) or arrives chunked."""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .responses import error_body


class BodyLimit:
    """ASGI middleware: reads a request's body up to ``limit`` bytes, then hands it to ``app`` whole."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

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
        while True:
            message = await receive()
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
