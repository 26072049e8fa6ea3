"""Test images and prompts."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def make_image(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic RGB test image."""
    rng = np.random.default_rng(seed)
    base = np.fromfunction(lambda y, x, c: (x * (seed + 1) + y * 3 + c * 50) % 256, (height, width, 3))
    noise = rng.integers(0, 32, size=(height, width, 3))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8))


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def b64(png: bytes) -> str:
    return base64.b64encode(png).decode()


def chat_prompt(tokenizer, n_images: int, text: str) -> str:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
