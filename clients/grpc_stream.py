#!/usr/bin/env python3
"""Stream a generation from a Trident entry model over gRPC with tritonclient.

    python clients/grpc_stream.py --image photo.png --prompt "Describe the picture." [--mode e_p_d]

The prompt is wrapped in the served model's chat format with one image placeholder per --image.
"""

from __future__ import annotations

import argparse
import base64
import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient

PLACEHOLDERS = {"llava": "<image>", "qwen2vl": "<|vision_start|><|image_pad|><|vision_end|>"}


def chat_prompt(arch: str, prompt: str, n_images: int) -> str:
    images = PLACEHOLDERS[arch] * n_images
    if arch == "qwen2vl":
        return f"<|im_start|>user\n{images}{prompt}<|im_end|>\n<|im_start|>assistant\n"
    return f"<s>USER: {images}\n{prompt} ASSISTANT:"


def tensor(name: str, value: np.ndarray, dtype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC address (default: 127.0.0.1:8001)")
    ap.add_argument("--mode", default="e_p_d", choices=["epd", "e_pd", "e_p_d", "ep_d"], help="entry model")
    ap.add_argument("--image", action="append", default=[], help="image file (repeat for several)")
    ap.add_argument("--prompt", default="Describe the picture.")
    ap.add_argument("--arch", default="llava", choices=list(PLACEHOLDERS), help="served model family (placeholder)")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    images = [base64.b64encode(open(p, "rb").read()) for p in args.image]
    inputs = [
        tensor("text_input", np.array([chat_prompt(args.arch, args.prompt, len(images)).encode()], dtype=object), "BYTES"),
        tensor("stream", np.array([True]), "BOOL"),
        tensor("sampling_parameters", np.array([json.dumps({"max_tokens": args.max_tokens, "temperature": 0}).encode()], dtype=object), "BYTES"),
        tensor("return_finish_reason", np.array([True]), "BOOL"),
    ]
    if images:
        inputs.append(tensor("image", np.array(images, dtype=object), "BYTES"))

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
            if reason is not None:
                print(f"\n[finish_reason: {reason[0].decode()}]")
                return 0
    finally:
        client.stop_stream()


if __name__ == "__main__":
    sys.exit(main())
