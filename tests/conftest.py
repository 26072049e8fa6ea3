"""Shared fixtures: demo checkpoints (built once per session), test images and prompts."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory):
    """Folder of each demo arch's checkpoint: ``demo_models["llava"]``."""
    from trident.demo_models import ARCHS, build_demo_model

    root = tmp_path_factory.mktemp("demo")
    paths = {}
    for arch in ARCHS:
        build_demo_model(arch, root / arch, log=lambda *_: None)
        paths[arch] = str(root / arch)
    return paths


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


def chat_prompt(tokenizer, n_images: int, text: str) -> str:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
