"""A deadline on a request's headers: uvicorn reads them for as long as a client takes, so a client sending a byte
now and then (or nothing after connecting) holds a connection for good, and enough of them fill
``frontend.max_connections``. A connection whose request headers are not whole within the deadline, counted from
the connection's start or from the first byte of its next request, is answered 408 and closed (as nginx's
``client_header_timeout``). An idle keep-alive connection is uvicorn's to close (``timeout_keep_alive``)."""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from trident.frontend.responses import error_body


def header_deadline_protocol(deadline_s: float, base: type[HttpToolsProtocol] = HttpToolsProtocol
                             ) -> type[HttpToolsProtocol]:
    """uvicorn's HTTP protocol (``http=``; ``base``, a subclass of it) with a deadline of ``deadline_s`` on each
    request's headers."""
    body = json.dumps(error_body(f"the request headers did not arrive within {deadline_s:g} s, this server's limit "
                                 "(frontend.header_timeout_s)", 408)).encode()
    answer = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    class HeaderDeadline(base):
        _timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._timer is None:
                self._timer = self.loop.call_later(deadline_s, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                self.transport.write(answer)
                self.transport.close()

    return HeaderDeadline
