"""Images: PIL decoding within the pixel limit, and a content id of decoded pixels."""

from __future__ import annotations

import hashlib
import io

from PIL import Image, UnidentifiedImageError

from trident.core.errors import InvalidRequest
from trident.core.media import LIMITS

# open_image checks LIMITS.max_pixels from the header, before decoding; PIL's own guard (a fixed 179 M pixels)
# would refuse first, without naming the server's limit, or refuse an image the operator allowed
Image.MAX_IMAGE_PIXELS = None


def open_image(raw: bytes, index: int = 0, budget=None) -> Image.Image:
    """Decode image bytes (PNG, JPEG, ...) into an RGB PIL image; its pixels are spent from ``budget`` (a
    :class:`~trident.core.media.PixelBudget`, the request's) first."""
    if not raw:
        raise InvalidRequest(f"image {index} is empty")
    try:
        with Image.open(io.BytesIO(raw)) as img:
            if img.width * img.height > LIMITS.max_pixels:
                raise InvalidRequest(
                    f"image {index} has {img.width}x{img.height} pixels, more than {LIMITS.max_pixels} (media_limits.max_pixels)"
                )
            if budget is not None:
                budget.spend(img.width * img.height, f"image {index} ({img.width}x{img.height})")
            return img.convert("RGB")
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise InvalidRequest(f"image {index} could not be decoded as an image: {e}") from None


def image_digest(image: Image.Image) -> str:
    """A content id of a decoded image (mode, size, pixels): equal ids mean equal images, e.g. for a
    prefix cache keyed by image."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()
