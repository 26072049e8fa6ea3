"""Image URLs of the OpenAI API: the SSRF guard (addresses, one pinned lookup, a total time limit)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trident.config import MediaPolicy
from trident.errors import InvalidRequest
from trident.media.urls import is_public_address, media_url_to_base64

PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000" "1f15c4890000000d49444154789c6360000002000154a24f0d0000000049454e44ae426082")


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2001:4860:4860::8888", True), ("::ffff:8.8.8.8", True),
    ("127.0.0.1", False), ("10.0.0.1", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("::1", False), ("fe80::1", False), ("fc00::1", False), ("::ffff:127.0.0.1", False),
    ("64:ff9b::7f00:1", False), ("64:ff9b::808:808", False), ("2002:7f00:1::", False),
])
def test_public_addresses(address, public):
    assert is_public_address(ipaddress.ip_address(address)) is public


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/cat.png", "http://localhost/cat.png", "http://2130706433/cat.png", "http://0x7f000001/x.png",
    "http://127.1/x.png", "http://[::1]/x.png", "http://[::ffff:127.0.0.1]/x.png", "http://[64:ff9b::a00:1]/x.png",
    "http://100.64.0.1/x.png", "http://169.254.169.254/latest/meta-data",
])
def test_private_hosts_are_refused_before_any_connection(url):
    with pytest.raises(InvalidRequest, match="non-public address"):
        asyncio.run(media_url_to_base64(url, MediaPolicy()))


class _Images(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        if self.path == "/slow.png":  # a byte every 0.3 s: each read is quick, the whole is not
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.3)
            return
        self.send_response(200 if self.headers["Host"] == "images.example:%d" % self.server.server_port else 404)
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args):
        pass


@pytest.fixture
def image_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port
    server.shutdown()
    server.server_close()


def test_the_fetch_connects_to_the_address_checked(image_server, monkeypatch):
    """One lookup, then the connection goes to that address with the URL's Host: a second lookup (what a DNS
    rebinding answers differently) never happens."""
    lookups = []

    async def getaddrinfo(self, host, port, **kw):
        lookups.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", getaddrinfo)
    policy = MediaPolicy(allow_private_urls=True)
    got = asyncio.run(media_url_to_base64(f"http://images.example:{image_server}/cat.png", policy))
    assert got and lookups == ["images.example"]


def test_a_slow_url_is_cut_off_at_the_total_time_limit(image_server):
    policy = MediaPolicy(allow_private_urls=True, timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest, match="took longer than 1 s"):
        asyncio.run(media_url_to_base64(f"http://127.0.0.1:{image_server}/slow.png", policy))
    assert time.monotonic() - t0 < 3
