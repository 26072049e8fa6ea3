#!/usr/bin/env python3
"""Write a perf_analyzer ``--input-data`` JSON for Trident's entry models: prompts with synthetic images, video
clips and audio clips (made with numpy, PIL and PyAV; each request gets its own, so no cache answers).

    python clients/perf/make_inputs.py --images 2 --size 336x336 --requests 8 --arch llava -o input.json
    python clients/perf/make_inputs.py --arch qwen2vl --images 0 --videos 1 --frames 16 -o video.json
    python clients/perf/make_inputs.py --arch qwen2audio --images 0 --audios 1 --seconds 5 -o audio.json
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


def synthetic_video(frames: int, width: int, height: int, seed: int, fps: int = 2) -> bytes:
    """An mp4 (mpeg4) clip of noise frames at ``fps`` (the server samples 2 per second by default)."""
    import av

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def synthetic_wav(seconds: float, seed: int, rate: int = 16000) -> bytes:
    """A 16-bit wav of a tone and noise."""
    import soundfile

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * (200 + seed % 400) * t) + 0.05 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    soundfile.write(buf, wave.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def prompt(arch: str, n_images: int, i: int, n_videos: int = 0, n_audios: int = 0) -> str:
    what = "the picture" if n_images else "the clip" if n_videos or n_audios else "a picture"
    return chat_prompt(arch, f"Describe {TOPICS[i % len(TOPICS)]} of {what} in detail, please.", n_images, n_videos, n_audios)


def _b64(items: list[bytes]) -> dict:
    return {"content": [base64.b64encode(b).decode() for b in items], "shape": [len(items)]}


def perf_analyzer_inputs(
    arch: str, n_images: int, size: tuple[int, int], requests: int, sampling: dict,
    n_videos: int = 0, frames: int = 8, n_audios: int = 0, seconds: float = 2.0,
) -> dict:
    """One entry per request, each with its own media (a unique item per request defeats caching)."""
    data = []
    for i in range(requests):
        entry = {
            "text_input": [prompt(arch, n_images, i, n_videos, n_audios)],
            "stream": [True],
            "sampling_parameters": [json.dumps(sampling)],
            "exclude_input_in_output": [True],
        }
        if n_images:
            entry["image"] = _b64([synthetic_png(*size, seed=i * 16 + k) for k in range(n_images)])
        if n_videos:
            entry["video"] = _b64([synthetic_video(frames, *size, seed=i * 16 + k) for k in range(n_videos)])
        if n_audios:
            entry["audio"] = _b64([synthetic_wav(seconds, seed=i * 16 + k) for k in range(n_audios)])
        data.append(entry)
    return {"data": data}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="llava", choices=list(PLACEHOLDERS))
    ap.add_argument("--images", type=int, default=1, help="images per request (default: 1)")
    ap.add_argument("--size", default="224x224", help="image and video frame size WxH (default: 224x224)")
    ap.add_argument("--videos", type=int, default=0, help="video clips per request (default: 0)")
    ap.add_argument("--frames", type=int, default=8, help="frames per clip, at 2 fps (default: 8)")
    ap.add_argument("--audios", type=int, default=0, help="audio clips per request (default: 0)")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds per audio clip (default: 2)")
    ap.add_argument("--requests", type=int, default=8, help="distinct requests (default: 8)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("-o", "--output", default="-", help="output file (default: stdout)")
    args = ap.parse_args()
    w, h = (int(v) for v in args.size.lower().split("x"))
    doc = perf_analyzer_inputs(args.arch, args.images, (w, h), args.requests,
                               {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True},
                               n_videos=args.videos, frames=args.frames, n_audios=args.audios, seconds=args.seconds)
    text = json.dumps(doc)
    if args.output == "-":
        print(text)
    else:
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
