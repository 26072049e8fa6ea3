#!/usr/bin/env python3
"""Write a perf_analyzer ``--input-data`` JSON for Trident's entry models: prompts with synthetic images.

    python clients/perf/make_inputs.py --images 2 --size 336x336 --requests 8 --arch llava -o input.json
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grpc_stream import PLACEHOLDERS, chat_prompt  # noqa: E402  (the clients' one chat format)

TOPICS = ["the colors", "the shapes", "the layout", "the mood", "the light", "the textures", "the objects", "the scene"]


def synthetic_png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def prompt(arch: str, n_images: int, i: int) -> str:
    return chat_prompt(arch, f"Describe {TOPICS[i % len(TOPICS)]} of the picture in detail, please.", n_images)


def perf_analyzer_inputs(arch: str, n_images: int, size: tuple[int, int], requests: int, sampling: dict) -> dict:
    """One entry per request, each with its own images (a unique image per request defeats caching)."""
    data = []
    for i in range(requests):
        entry = {
            "text_input": [prompt(arch, n_images, i)],
            "stream": [True],
            "sampling_parameters": [json.dumps(sampling)],
            "exclude_input_in_output": [True],
        }
        if n_images:
            images = [base64.b64encode(synthetic_png(*size, seed=i * 16 + k)).decode() for k in range(n_images)]
            entry["image"] = {"content": images, "shape": [n_images]}
        data.append(entry)
    return {"data": data}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="llava", choices=list(PLACEHOLDERS))
    ap.add_argument("--images", type=int, default=1, help="images per request (default: 1)")
    ap.add_argument("--size", default="224x224", help="image size WxH (default: 224x224)")
    ap.add_argument("--requests", type=int, default=8, help="distinct requests (default: 8)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("-o", "--output", default="-", help="output file (default: stdout)")
    args = ap.parse_args()
    w, h = (int(v) for v in args.size.lower().split("x"))
    doc = perf_analyzer_inputs(args.arch, args.images, (w, h), args.requests,
                               {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True})
    text = json.dumps(doc)
    if args.output == "-":
        print(text)
    else:
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
