"""A stage worker's health over HTTP, for a cluster's probes (``health_port``): ``GET /health`` is 200 while its
stage model is bound and served, 503 while its engine loads or it looks for its server, and from the moment it
stops. Nothing else is served there; requests are not logged."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Health:
    def __init__(self, address: str, port: int) -> None:
        self.state = "starting"
        health = self

        class Handler(BaseHTTPRequestHandler):
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

        self._server = ThreadingHTTPServer((address, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="trident-health", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
