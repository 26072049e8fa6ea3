"""Images of a request: decoding and validating what clients send.

The entry interface carries each image as base64 (a ``data:`` URL is accepted too). Anything that is not a
decodable image of a sane size is an :class:`~trident.errors.InvalidRequest` naming the image.
"""

from __future__ import annotations

import base64
import binascii
import io

from PIL import Image, UnidentifiedImageError

from .errors import InvalidRequest

MAX_IMAGE_PIXELS = 40_000_000  # PIL's decompression-bomb guard, raised to an error
MAX_IMAGE_BYTES = 32 << 20


def decode_base64_image(data: bytes | str, index: int = 0) -> Image.Image:
    """One image from base64 text or a ``data:image/...;base64,`` URL, as RGB."""
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
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise InvalidRequest(f"image {index} is larger than {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequest(f"image {index} is not valid base64: {e}") from None
    return open_image(raw, index)


def open_image(raw: bytes, index: int = 0) -> Image.Image:
    """Decode image bytes (PNG, JPEG, ...) into an RGB PIL image."""
    if not raw:
        raise InvalidRequest(f"image {index} is empty")
    try:
        with Image.open(io.BytesIO(raw)) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise InvalidRequest(f"image {index} has {img.width}x{img.height} pixels, more than {MAX_IMAGE_PIXELS}")
            return img.convert("RGB")
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise InvalidRequest(f"image {index} could not be decoded as an image: {e}") from None
