"""A stage worker's health over HTTP, for a cluster's probes (``health_port``): ``GET /health`` is 200 while its
stage model is bound and served, 503 while its engine loads or it looks for its server, and from the moment it
stops. Nothing else is served there; requests are not logged. A probe is small and quick: a connection whose request
has not come whole within :data:`DEADLINE_S` is closed, and at most :data:`CONNECTIONS` are served at once (past
it a connection is closed unread), so a client that trickles bytes holds neither threads nor descriptors."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DEADLINE_S = 5.0  # a connection's whole request
CONNECTIONS = 16  # served at once


class _Bounded(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class Health:
    def __init__(self, address: str, port: int) -> None:
        self.state = "starting"
        health = self

        class Handler(BaseHTTPRequestHandler):
            def setup(self) -> None:
                super().setup()
                self.close_connection = True  # (one request a connection: no keep-alive to hold)
                self._cut = threading.Timer(DEADLINE_S, self._cut_off)  # (the whole request, however it trickles)
                self._cut.daemon = True
                self._cut.start()

            def _cut_off(self) -> None:
                try:
                    self.request.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def finish(self) -> None:
                self._cut.cancel()
                try:
                    super().finish()
                except OSError:
                    pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path != "/health":
                    self.send_error(404)
                    return
                body = health.state.encode()
                self.send_response(200 if health.state == "serving" else 503)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # (a probe every few seconds is not an event)
                pass

        self._server = _Bounded((address, port), Handler)
        threading.Thread(target=self._server.serve_forever, name="trident-health", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
