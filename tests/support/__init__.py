"""Helpers shared by the test suites (the one place tests share code; test modules never import each other).

- :mod:`.media`: deterministic images, base64, chat prompts
- :mod:`.clients`: tritonclient requests to entry and stage models
- :mod:`.server`: `trident serve` in a subprocess, worker stats checks
- :mod:`.reference`: transformers' ``generate()`` references
- :mod:`.children`: child processes forked from a process that imported torch once
"""

from .clients import ADDITIONAL, LOGPROB_FLAGS, Result, cancellable_stream, credential, decode_kv, drain_kv, grpc_generate, http_generate, stage_output, strings
from .media import (
    audio_bytes, b64, chat_prompt, frameless_video, long_header_video, make_frames, make_image, make_wave, media_prompt,
    png_bytes, video_bytes,
)
from .media import bad_media, media_cases
from .reference import build_media_reference, build_reference, internvl_inputs
from .children import child_processes


def __getattr__(name: str):
    """``MEDIA_CASES`` is made on first use: it encodes videos with PyAV, which a test module that sends no media
    need not have (`make gpu-check` runs test_transfer.py on a GPU host's Python, without PyAV)."""
    if name == "MEDIA_CASES":
        global MEDIA_CASES
        MEDIA_CASES = media_cases()
        return MEDIA_CASES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

from .server import (
    OneServerAtATime, Server, bridged_llava_server, descendants, hosted_head, quiet_vllm_metrics, serving,
    settled_vllm_metrics, shared_llava_server, shared_media_server, vllm_metrics, vllm_python, vllm_server, wait_drained,
)

from .server import MODES

BAD_REQUESTS = {  # problem -> (what changes in a good one-image request, what the 400 must say)
    "undecodable image": ({"images": [b64(b"this is not an image at all")]}, "could not be decoded as an image"),
    "not base64": ({"images": ["@@@ not base64 @@@"]}, "not valid base64"),
    "image count": ({"images": "two"}, "image placeholder"),
    "bad json": ({"params": "{max_tokens: 3"}, "sampling_parameters is not valid JSON"),
    "bad value": ({"params": {"max_tokens": -4}}, "max_tokens"),
    "too long": ({"suffix": " word" * 5000}, "context window"),
    "too many images": ({"images": 17}, "carries 17 images; at most"),
    "seed past 64 bits": ({"params": {"max_tokens": 4, "seed": 1 << 64}}, "seed: Input should be less than"),
    "not honoured": ({"params": {"max_tokens": 4, "presence_penalty": 0.5}},
                     "not supported by Trident's engines: presence_penalty"),
    "deep json": ({"params": "[" * 20_000 + "]" * 20_000}, "sampling_parameters is nested too deeply"),
    "long stop": ({"params": {"max_tokens": 4, "stop": ["y" * 257]}}, "stop string 0 has 257 characters"),
}


def bad_request(case: dict, problem: str, params) -> tuple[str, list[str], object, str]:
    """A good request (a reference case) with one problem: (text, images, sampling params, expected message)."""
    change, message = BAD_REQUESTS[problem]
    text = case["text"] + change.get("suffix", "")
    images = change.get("images", case["images"])
    if images == "two" or isinstance(images, int):  # the case's image, that many times
        images = case["images"] * (2 if images == "two" else images)
    return text, images, change.get("params", params), message
IMAGE_CASES = {"one-image": [(224, 224, 1)], "two-images": [(224, 224, 1), (300, 200, 2)], "text-only": []}

__all__ = [
    "ADDITIONAL", "LOGPROB_FLAGS",
    "MEDIA_CASES", "vllm_python", "audio_bytes", "build_media_reference", "frameless_video", "long_header_video", "make_frames", "make_wave",
    "media_prompt", "video_bytes",
    "BAD_REQUESTS", "IMAGE_CASES", "internvl_inputs", "MODES", "bad_request", "Result", "Server", "b64", "build_reference", "cancellable_stream", "chat_prompt", "descendants", "settled_vllm_metrics", "shared_llava_server", "shared_media_server", "vllm_metrics", "drain_kv",
    "grpc_generate", "http_generate", "make_image", "png_bytes", "stage_output", "strings", "wait_drained",
]
