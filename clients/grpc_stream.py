#!/usr/bin/env python3
"""Stream a generation from a Trident entry model over gRPC with tritonclient.

    python clients/grpc_stream.py --image photo.png --prompt "Describe the picture." [--mode e_p_d]
    python clients/grpc_stream.py --arch qwen2vl --video clip.mp4 --prompt "What happens?"
    python clients/grpc_stream.py --arch qwen2audio --audio speech.wav --prompt "What is said?"

The prompt is wrapped in the served model's chat format with one placeholder per --image, --video and --audio.
"""

from __future__ import annotations

import argparse
import base64
import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient

PLACEHOLDERS = {  # by served family, by entry input
    "llava": {"image": "<image>"},
    "qwen2vl": {"image": "<|vision_start|><|image_pad|><|vision_end|>", "video": "<|vision_start|><|video_pad|><|vision_end|>"},
    "qwen2audio": {"audio": "<|audio_bos|><|AUDIO|><|audio_eos|>"},
}
MEDIA = ("image", "video", "audio")  # the entry inputs that carry media


def chat_prompt(arch: str, prompt: str, n_images: int = 0, n_videos: int = 0, n_audios: int = 0) -> str:
    counts = {"image": n_images, "video": n_videos, "audio": n_audios}
    for kind, n in counts.items():
        if n and kind not in PLACEHOLDERS[arch]:
            raise SystemExit(f"the {arch} family takes {', '.join(PLACEHOLDERS[arch])}, not {kind}")
    media = "".join(PLACEHOLDERS[arch].get(kind, "") * n for kind, n in counts.items())
    if arch.startswith("qwen2"):
        return f"<|im_start|>user\n{media}{prompt}<|im_end|>\n<|im_start|>assistant\n"
    return f"<s>USER: {media}\n{prompt} ASSISTANT:"


def add_media_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--image", action="append", default=[], help="image file (repeat for several)")
    ap.add_argument("--video", action="append", default=[], help="video file: mp4, webm, mkv (repeat for several)")
    ap.add_argument("--audio", action="append", default=[], help="audio file: wav, flac, mp3, ogg (repeat for several)")


def read_media(args) -> dict[str, list[str]]:
    """The --image / --video / --audio files as base64, by entry input."""
    return {kind: [base64.b64encode(open(p, "rb").read()).decode() for p in getattr(args, kind)] for kind in MEDIA}


def tensor(name: str, value: np.ndarray, dtype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC address (default: 127.0.0.1:8001)")
    ap.add_argument("--mode", default="e_p_d", choices=["epd", "e_pd", "e_p_d", "ep_d"], help="entry model")
    add_media_flags(ap)
    ap.add_argument("--prompt", default="Describe the picture.")
    ap.add_argument("--arch", default="llava", choices=list(PLACEHOLDERS), help="served model family (placeholder)")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    media = read_media(args)
    text = chat_prompt(args.arch, args.prompt, *(len(media[kind]) for kind in MEDIA))
    inputs = [
        tensor("text_input", np.array([text.encode()], dtype=object), "BYTES"),
        tensor("stream", np.array([True]), "BOOL"),
        tensor("sampling_parameters", np.array([json.dumps({"max_tokens": args.max_tokens, "temperature": 0}).encode()], dtype=object), "BYTES"),
        tensor("return_finish_reason", np.array([True]), "BOOL"),
    ]
    for kind in MEDIA:
        if media[kind]:
            inputs.append(tensor(kind, np.array([m.encode() for m in media[kind]], dtype=object), "BYTES"))

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(args.mode, inputs)
    try:
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                return 1
            print(result.as_numpy("text_output")[0].decode(), end="", flush=True)
            reason = result.as_numpy("finish_reason")
            if reason is not None and reason[0] != b"None":  # ("None" on every response before the last)
                print(f"\n[finish_reason: {reason[0].decode()}]")
                return 0
    finally:
        client.stop_stream()


if __name__ == "__main__":
    sys.exit(main())
