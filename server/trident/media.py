"""Images of a request: decoding and validating what clients send.

The entry interface carries each image as base64 (a ``data:`` URL is accepted too). Anything that is not a
decodable image of a sane size is an :class:`~trident.errors.InvalidRequest` naming the image.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import ipaddress
import socket
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from urllib.parse import urlparse

from PIL import Image, UnidentifiedImageError

from .config import ImageLimits, MediaPolicy
from .errors import InvalidRequest

LIMITS = ImageLimits.from_env()
"""This process's image limits (``trident serve --max-images / --max-image-pixels / --max-image-mib``)."""
# open_image checks LIMITS.max_pixels from the header, before decoding; PIL's own guard (a fixed 179 M pixels)
# would refuse first, without naming the server's limit, or refuse an image the operator allowed
Image.MAX_IMAGE_PIXELS = None


def check_image_count(count: int) -> None:
    """A request may carry at most ``LIMITS.max_images`` images (checked before any is decoded)."""
    if count > LIMITS.max_images:
        raise InvalidRequest(
            f"the request carries {count} images; at most {LIMITS.max_images} are accepted (--max-images)"
        )


def decode_base64(data: bytes | str, index: int = 0) -> bytes:
    """An image's bytes from base64 text or a ``data:image/...;base64,`` URL (not yet decoded as an image)."""
    if isinstance(data, bytes):
        try:
            data = data.decode("ascii")
        except UnicodeDecodeError:
            raise InvalidRequest(f"image {index} is not base64 text") from None
    data = data.strip()
    if data.startswith("data:"):
        header, sep, data = data.partition(",")
        if not sep or not header.endswith(";base64"):
            raise InvalidRequest(f"image {index} is a data URL that is not base64-encoded")
    if len(data) > LIMITS.max_bytes * 4 // 3 + 4:
        raise InvalidRequest(f"image {index} is larger than {LIMITS.max_bytes} bytes (--max-image-mib)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequest(f"image {index} is not valid base64: {e}") from None
    if len(raw) > LIMITS.max_bytes:
        raise InvalidRequest(f"image {index} is larger than {LIMITS.max_bytes} bytes (--max-image-mib)")
    return raw


def decode_base64_image(data: bytes | str, index: int = 0) -> Image.Image:
    """One image from base64 text or a ``data:image/...;base64,`` URL, as RGB."""
    return open_image(decode_base64(data, index), index)


def content_id(raw: bytes) -> str:
    """The content id of an image's bytes: what caches and routing key an image by (equal bytes, equal id)."""
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


@dataclass(frozen=True)
class ImageItem:
    """One image of a request as it arrived: its bytes and content id, decoded only when it is encoded."""

    raw: bytes
    index: int  # position in the request (for error messages)

    @cached_property
    def content_id(self) -> str:
        return content_id(self.raw)

    def open(self) -> Image.Image:
        return open_image(self.raw, self.index)

    @classmethod
    def from_base64(cls, data: bytes | str, index: int = 0) -> "ImageItem":
        return cls(decode_base64(data, index), index)


def image_digest(image: Image.Image) -> str:
    """A content id of a decoded image (mode, size, pixels): equal ids mean equal images, e.g. for a
    prefix cache keyed by image."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def open_image(raw: bytes, index: int = 0) -> Image.Image:
    """Decode image bytes (PNG, JPEG, ...) into an RGB PIL image."""
    if not raw:
        raise InvalidRequest(f"image {index} is empty")
    try:
        with Image.open(io.BytesIO(raw)) as img:
            if img.width * img.height > LIMITS.max_pixels:
                raise InvalidRequest(
                    f"image {index} has {img.width}x{img.height} pixels, more than {LIMITS.max_pixels} (--max-image-pixels)"
                )
            return img.convert("RGB")
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise InvalidRequest(f"image {index} could not be decoded as an image: {e}") from None


# -- image URLs of the OpenAI API (frontend) -------------------------------------------------------------
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


def is_public_address(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A globally routable address, also for the IPv4 address an IPv6 one carries (IPv4-mapped, NAT64,
    6to4, Teredo): 100.64/10, NAT64 prefixes and the like are not."""
    if not addr.is_global or addr.is_multicast:
        return False
    if isinstance(addr, ipaddress.IPv6Address):
        if any(addr in net for net in _NAT64):
            return False  # the gateway reaches whatever IPv4 address the last 32 bits name
        embedded = addr.ipv4_mapped or addr.sixtofour or (addr.teredo[1] if addr.teredo else None)
        if embedded is not None and not is_public_address(embedded):
            return False
    return True


async def resolve_public(host: str, port: int, policy: MediaPolicy) -> str:
    """The address to fetch an image URL's host from: resolved once, off the event loop, and only if every
    address the name has is public (the fetch then connects to that address: no second lookup for a DNS
    rebinding to answer differently)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise InvalidRequest(f"image URL host {host!r} does not resolve: {e}") from None
    addrs = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
    if not addrs:
        raise InvalidRequest(f"image URL host {host!r} does not resolve")
    if not policy.allow_private_urls:
        for addr in addrs:
            if not is_public_address(addr):
                raise InvalidRequest(
                    f"image URL host {host!r} resolves to the non-public address {addr}; "
                    "start the server with --allow-private-media-urls to allow it"
                )
    return str(addrs[0])


async def _fetch(url: str, policy: MediaPolicy, index: int) -> bytes:
    """GET an http(s) image URL from its pinned address, within ``policy``'s size and total time."""
    import httpx

    parsed = urlparse(url)
    if not parsed.hostname:
        raise InvalidRequest(f"image {index} URL has no host")
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        raise InvalidRequest(f"image {index} URL has an invalid port") from None
    address = await resolve_public(parsed.hostname, port, policy)
    netloc = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    pinned = parsed._replace(netloc=netloc).geturl()
    host_header = parsed.netloc.rsplit("@", 1)[-1]
    data = bytearray()
    try:
        async with asyncio.timeout(policy.timeout_s):
            async with httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False) as client:
                async with client.stream("GET", pinned, headers={"Host": host_header},
                                         extensions={"sni_hostname": parsed.hostname}) as response:
                    if response.status_code != 200:
                        raise InvalidRequest(f"image {index} URL answered HTTP {response.status_code}")
                    async for part in response.aiter_bytes():
                        data += part
                        if len(data) > policy.max_bytes:
                            raise InvalidRequest(f"image {index} URL is larger than {policy.max_bytes >> 20} MiB")
    except TimeoutError:
        raise InvalidRequest(f"image {index} URL took longer than {policy.timeout_s:g} s to fetch") from None
    except httpx.HTTPError as e:
        raise InvalidRequest(f"image {index} URL could not be fetched: {type(e).__name__}") from None
    return bytes(data)


async def image_url_to_base64(url: str, policy: MediaPolicy, index: int = 0) -> str:
    """An OpenAI ``image_url`` (data URL, http(s) URL or allowed local path) as base64.

    Not decoded as an image here: the entry model does that once, and refuses what is not an image with
    the same message (a 400 through the frontend too)."""
    if url.startswith("data:"):
        decode_base64(url, index)  # a clear 400 without a round trip
        return url.split(",", 1)[1]
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        raw = await _fetch(url, policy, index)
    elif parsed.scheme in ("file", ""):
        path = Path(parsed.path if parsed.scheme == "file" else url).resolve()
        root = policy.allowed_media_dir
        if root is None or not path.is_relative_to(root.resolve()):
            raise InvalidRequest(
                f"image {index} path {str(path)!r} is outside the allowed media folder"
                + ("" if root else " (none is set: start the server with --allowed-media-dir)")
            )
        if not path.is_file():
            raise InvalidRequest(f"image {index} path {str(path)!r} is not a file")
        if path.stat().st_size > policy.max_bytes:
            raise InvalidRequest(f"image {index} file is larger than {policy.max_bytes >> 20} MiB")
        raw = path.read_bytes()
    else:
        raise InvalidRequest(f"image {index} URL scheme {parsed.scheme!r} is not supported (data:, http(s), file)")
    if not raw:
        raise InvalidRequest(f"image {index} is empty")
    return base64.b64encode(raw).decode()
