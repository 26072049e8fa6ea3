"""Media URLs of the OpenAI API: the SSRF guard (addresses, ports, one pinned lookup, a total time limit) and the
bytes they may bring (each item within its kind's limit, a request's together within a budget, nothing inflated)."""

from __future__ import annotations

import asyncio
import gzip
import ipaddress
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trident.core.config import MediaPolicy
from trident.core.errors import InvalidRequest
from trident.core.media.urls import FetchBudget, is_public_address, media_url_to_base64

PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000" "1f15c4890000000d49444154789c6360000002000154a24f0d0000000049454e44ae426082")


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2001:4860:4860::8888", True), ("::ffff:8.8.8.8", True),
    ("127.0.0.1", False), ("10.0.0.1", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("::1", False), ("fe80::1", False), ("fc00::1", False), ("::ffff:127.0.0.1", False),
    ("64:ff9b::7f00:1", False), ("64:ff9b::808:808", False), ("2002:7f00:1::", False),
    ("::ffff:0:7f00:1", False), ("::7f00:1", False), ("::a00:1", False), ("fec0::1", False),  # translated,
    ("::ffff:0:808:808", True), ("::808:808", True),  # compatible (IPv4 inside), site-local
])
def test_public_addresses(address, public):
    assert is_public_address(ipaddress.ip_address(address)) is public


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/cat.png", "http://localhost/cat.png", "http://2130706433/cat.png", "http://0x7f000001/x.png",
    "http://127.1/x.png", "http://[::1]/x.png", "http://[::ffff:127.0.0.1]/x.png", "http://[64:ff9b::a00:1]/x.png",
    "http://100.64.0.1/x.png", "http://169.254.169.254/latest/meta-data", "http://[::ffff:0:7f00:1]/x.png",
    "http://[::7f00:1]/x.png", "http://[fec0::1]/x.png",
])
def test_private_hosts_are_refused_before_any_connection(url):
    with pytest.raises(InvalidRequest, match="non-public address"):
        asyncio.run(media_url_to_base64(url, MediaPolicy()))


class _Images(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        if self.path.startswith("/bytes/"):  # /bytes/<n>[/gzip][/unsized]: n bytes, as asked
            _, _, n, *how = self.path.split("/")
            body = os.urandom(int(n))
            if "gzip" in how:  # what a small answer that inflates would say of itself
                body = gzip.compress(b"\0" * int(n))
            self.send_response(200)
            if "gzip" in how:
                self.send_header("Content-Encoding", "gzip")
            if "unsized" not in how:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
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
    policy = MediaPolicy(allow_private_urls=True, allowed_ports=None)
    got = asyncio.run(media_url_to_base64(f"http://images.example:{image_server}/cat.png", policy))
    assert got and lookups == ["images.example"]


def test_a_slow_url_is_cut_off_at_the_total_time_limit(image_server):
    policy = MediaPolicy(allow_private_urls=True, allowed_ports=None, timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest, match="took longer than 1 s"):
        asyncio.run(media_url_to_base64(f"http://127.0.0.1:{image_server}/slow.png", policy))
    assert time.monotonic() - t0 < 3


def test_a_url_port_outside_the_allowed_ones_is_refused_before_any_lookup(monkeypatch):
    async def getaddrinfo(self, host, port, **kw):
        raise AssertionError("looked up")

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", getaddrinfo)
    with pytest.raises(InvalidRequest, match=r"names port 6379; media URLs may name ports 80, 443, 8080, 8443"):
        asyncio.run(media_url_to_base64("http://images.example:6379/x.png", MediaPolicy()))


def _get(port: int, path: str, budget: FetchBudget | None = None, kind: str = "image", **policy) -> str:
    policy = MediaPolicy(allow_private_urls=True, allowed_ports=None, **policy)
    return asyncio.run(media_url_to_base64(f"http://127.0.0.1:{port}{path}", policy, 0, kind, budget))


def test_a_compressed_answer_is_refused_unread(image_server):
    """40 KiB that inflate to 40 MiB: refused by its Content-Encoding, with nothing inflated."""
    with pytest.raises(InvalidRequest, match="answered with Content-Encoding 'gzip'"):
        _get(image_server, f"/bytes/{40 << 20}/gzip")


def test_each_item_within_its_kind_s_limit_and_the_request_s_within_its_budget(image_server):
    from trident.core.media import LIMITS

    over = LIMITS.max_bytes + 1  # media_limits.max_bytes: an image's limit (the default, 32 MiB)
    for how in ("", "/unsized"):  # told by its Content-Length, or counted as it comes
        with pytest.raises(InvalidRequest, match=r"image 0 holds .* than the 32 MiB allowed per image item "
                                                 r"\(media_limits.max_bytes\)"):
            _get(image_server, f"/bytes/{over}{how}", max_bytes=256 << 20)
    budget = FetchBudget(3 << 20)
    assert _get(image_server, f"/bytes/{2 << 20}", budget)
    assert budget.left == 1 << 20
    with pytest.raises(InvalidRequest, match=r"past 3 MiB together \(frontend.media.max_bytes\)"):
        _get(image_server, f"/bytes/{(1 << 20) + 1}/unsized", budget)
    assert budget.left == 1 << 20  # what was refused is not spent


def test_a_local_file_counts_against_the_budget(tmp_path):
    (tmp_path / "a.png").write_bytes(b"x" * 1000)
    policy = MediaPolicy(allowed_media_dir=tmp_path)
    budget = FetchBudget(1500)
    assert asyncio.run(media_url_to_base64(str(tmp_path / "a.png"), policy, 0, "image", budget))
    with pytest.raises(InvalidRequest, match="past 0 MiB together"):
        asyncio.run(media_url_to_base64(str(tmp_path / "a.png"), policy, 1, "image", budget))


def test_a_request_s_urls_share_one_time_budget(image_server):
    """Each URL may take frontend.media.timeout_s, and a request's URLs all together too: 28 slow URLs (as many as
    the media limits allow) cannot hold a request for 28 times the timeout."""
    budget = FetchBudget(64 << 20)
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest, match=r"image 0 URL took longer than 1 s to fetch"):
        _get(image_server, "/slow.png", budget, timeout_s=1.0)  # (the first: its own bound, the whole's too)
    with pytest.raises(InvalidRequest, match=r"image 0 URL: the request's media URLs took longer than 1 s to fetch "
                                             r"together \(frontend.media.timeout_s\)"):
        _get(image_server, "/slow.png", budget, timeout_s=1.0)
    assert time.monotonic() - t0 < 1.6
