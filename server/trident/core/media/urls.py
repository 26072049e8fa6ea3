"""Media URLs of the OpenAI API (the frontend): data URLs, http(s) URLs behind an SSRF guard, allowed local
paths; each becomes the base64 an entry model takes."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

from trident.core.config import MediaPolicy
from trident.core.errors import InvalidRequest
from trident.core.media import _BYTES_KEY, base64_text, max_bytes

_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_LAST_32_BITS = (ipaddress.ip_network("::/96"), ipaddress.ip_network("::ffff:0:0:0/96"))  # IPv4-compatible, -translated


def is_public_address(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A globally routable address, also for the IPv4 address an IPv6 one carries (IPv4-mapped, -compatible,
    -translated, NAT64, 6to4, Teredo): 100.64/10, NAT64 prefixes, site-local fec0::/10 and the like are not."""
    if not addr.is_global or addr.is_multicast:
        return False
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.is_site_local or any(addr in net for net in _NAT64):
            return False  # (NAT64: the gateway reaches whatever IPv4 address the last 32 bits name)
        embedded = addr.ipv4_mapped or addr.sixtofour or (addr.teredo[1] if addr.teredo else None)
        if embedded is None and any(addr in net for net in _LAST_32_BITS):
            embedded = ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
        if embedded is not None and not is_public_address(embedded):
            return False
    return True


class FetchBudget:
    """The bytes a request's media URLs and files may still bring (``frontend.media.max_bytes`` for them all), and
    the time its URLs may still take, together (``frontend.media.timeout_s``, counted from the first fetch: a
    request's URLs are fetched one after another, and each may take all that is left of it)."""

    def __init__(self, total: int, time_s: float | None = None) -> None:
        self.total, self.left = total, total
        self.time_s = time_s
        self._deadline: float | None = None

    def time_left(self, policy_s: float) -> tuple[float, bool]:
        """The time the next fetch may take, and whether the request's whole budget (not one URL's) bounds it."""
        time_s = self.time_s if self.time_s is not None else policy_s
        if self._deadline is None:  # (the request's first fetch)
            self._deadline = time.monotonic() + time_s
            return min(time_s, policy_s), time_s < policy_s
        left = self._deadline - time.monotonic()
        return (left, True) if left < policy_s else (policy_s, False)

    def limit(self, kind: str) -> int:
        """The most the next item may hold: its kind's limit, or what is left."""
        return min(max_bytes(kind), self.left)

    def refuse(self, kind: str, index: int, size: int | None = None) -> InvalidRequest:
        """The error for an item past :meth:`limit` (``size``: its size when known)."""
        what = f"{size >> 20} MiB" if size is not None and size >= 1 << 20 else "more"
        over_its_kind = (size is not None and size > max_bytes(kind)) or self.left >= max_bytes(kind)
        if over_its_kind:  # (else what is left of the request's budget was the bound)
            return InvalidRequest(f"{kind} {index} holds {what} than the {max_bytes(kind) >> 20} MiB allowed per "
                                  f"{kind} item ({_BYTES_KEY[kind]})")
        return InvalidRequest(f"{kind} {index} would take the request's media URLs and files past "
                              f"{self.total >> 20} MiB together (frontend.media.max_bytes)")

    def spend(self, size: int) -> None:
        self.left -= size


async def resolve_public(host: str, port: int, policy: MediaPolicy) -> str:
    """The address to fetch a media URL's host from: resolved once, off the event loop, and only if every
    address the name has is public (the fetch then connects to that address: no second lookup for a DNS
    rebinding to answer differently)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise InvalidRequest(f"media URL host {host!r} does not resolve: {e}") from None
    addrs = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
    if not addrs:
        raise InvalidRequest(f"media URL host {host!r} does not resolve")
    if not policy.allow_private_urls:
        for addr in addrs:
            if not is_public_address(addr):
                raise InvalidRequest(
                    f"media URL host {host!r} resolves to the non-public address {addr}; "
                    "the server allows it with frontend.media.allow_private_urls"
                )
    return str(addrs[0])


async def _fetch(url: str, policy: MediaPolicy, index: int, kind: str, budget: FetchBudget) -> bytes:
    """GET an http(s) media URL from its pinned address, within the budget's limit and ``policy``'s total time; the
    bytes are counted as they come, as sent (a compressed answer is refused: nothing is inflated here)."""
    import httpx

    parsed = urlparse(url)
    if not parsed.hostname:
        raise InvalidRequest(f"{kind} {index} URL has no host")
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        raise InvalidRequest(f"{kind} {index} URL has an invalid port") from None
    if policy.allowed_ports is not None and port not in policy.allowed_ports:
        raise InvalidRequest(f"{kind} {index} URL names port {port}; media URLs may name ports "
                             f"{', '.join(map(str, policy.allowed_ports))} (frontend.media.allowed_ports)")
    address = await resolve_public(parsed.hostname, port, policy)
    netloc = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    pinned = parsed._replace(netloc=netloc).geturl()
    host_header = parsed.netloc.rsplit("@", 1)[-1]
    data = bytearray()
    limit = budget.limit(kind)
    time_s, whole_request = budget.time_left(policy.timeout_s)
    try:
        if time_s <= 0:
            raise TimeoutError
        async with asyncio.timeout(time_s):
            async with httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False) as client:
                async with client.stream("GET", pinned, headers={"Host": host_header, "Accept-Encoding": "identity"},
                                         extensions={"sni_hostname": parsed.hostname}) as response:
                    if response.status_code != 200:
                        raise InvalidRequest(f"{kind} {index} URL answered HTTP {response.status_code}")
                    encoding = response.headers.get("content-encoding", "identity").strip().lower()
                    if encoding != "identity":
                        raise InvalidRequest(f"{kind} {index} URL answered with Content-Encoding {encoding[:20]!r}; "
                                             "media is fetched as it is stored (identity)")
                    length = response.headers.get("content-length", "")
                    if length.isdigit() and int(length) > limit:
                        raise budget.refuse(kind, index, int(length))
                    async for part in response.aiter_raw():
                        data += part
                        if len(data) > limit:
                            raise budget.refuse(kind, index)
    except TimeoutError:
        if whole_request:
            raise InvalidRequest(f"{kind} {index} URL: the request's media URLs took longer than "
                                 f"{budget.time_s or policy.timeout_s:g} s to fetch together "
                                 "(frontend.media.timeout_s)") from None
        raise InvalidRequest(f"{kind} {index} URL took longer than {policy.timeout_s:g} s to fetch") from None
    except httpx.HTTPError as e:
        raise InvalidRequest(f"{kind} {index} URL could not be fetched: {type(e).__name__}") from None
    return bytes(data)


async def media_url_to_base64(url: str, policy: MediaPolicy, index: int = 0, kind: str = "image",
                              budget: FetchBudget | None = None) -> str:
    """An OpenAI ``image_url`` / ``video_url`` / ``audio_url`` (data URL, http(s) URL or allowed local path) as
    base64.

    Not decoded here: the entry model does that once, and refuses what it cannot decode with the same
    message (a 400 through the frontend too). A data URL's form and size are checked here (a clear 400
    without a round trip); decoding 200 KB of base64 only to check it cost ~1 ms per image. What URLs and files
    bring counts against ``budget``, one request's (a new one of ``policy.max_bytes`` if None)."""
    if url.startswith("data:"):
        return base64_text(url, index, kind)
    budget = budget or FetchBudget(policy.max_bytes)
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        raw = await _fetch(url, policy, index, kind, budget)
    elif parsed.scheme in ("file", ""):
        path = Path(parsed.path if parsed.scheme == "file" else url).resolve()
        root = policy.allowed_media_dir
        if root is None or not path.is_relative_to(root.resolve()):
            raise InvalidRequest(
                f"{kind} {index} path {str(path)!r} is outside the allowed media folder"
                + ("" if root else " (none is set: the server's frontend.media.allowed_media_dir)")
            )
        if not path.is_file():
            raise InvalidRequest(f"{kind} {index} path {str(path)!r} is not a file")
        size = path.stat().st_size
        if size > budget.limit(kind):
            raise budget.refuse(kind, index, size)
        raw = await asyncio.to_thread(path.read_bytes)  # (off the event loop)
        if len(raw) > budget.limit(kind):  # it grew since
            raise budget.refuse(kind, index, len(raw))
    else:
        raise InvalidRequest(f"{kind} {index} URL scheme {parsed.scheme!r} is not supported (data:, http(s), file)")
    if not raw:
        raise InvalidRequest(f"{kind} {index} is empty")
    budget.spend(len(raw))
    return base64.b64encode(raw).decode()
