"""Idle keep-alive connections give way to requests: uvicorn counts every open connection against
``frontend.max_connections`` and answers a request past it 503, so about that many idle keep-alive connections
(clients that keep theirs open, or one that opens many and sends nothing more) made every other request a 503. When a
request's headers are in and the connections are at the limit, the connections idle longest (waiting, between
requests, on their keep-alive timer) are closed to make room, as nginx reclaims idle keep-alive connections; a
connection with a request in progress is never closed for another."""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class ReclaimIdle(HttpToolsProtocol):
    """uvicorn's HTTP protocol (a base for ``http=``) that closes idle keep-alive connections when a request needs
    their room."""

    def on_headers_complete(self) -> None:
        limit = self.limit_concurrency
        if limit is not None and len(self.connections) >= limit:
            idle = sorted((p for p in self.connections if p is not self and p.timeout_keep_alive_task is not None),
                          key=lambda p: p.timeout_keep_alive_task.when())  # (the earliest timer: idle longest)
            for protocol in idle[: len(self.connections) - limit + 1]:
                protocol._unset_keepalive_if_required()
                protocol.transport.close()
                self.connections.discard(protocol)  # (its connection_lost, on the loop's next turn, does it again)
        super().on_headers_complete()
