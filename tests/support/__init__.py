"""Helpers shared by the test suites (the one place tests share code; test modules never import each other).

- :mod:`.media`: deterministic images, base64, chat prompts
- :mod:`.clients`: tritonclient requests to entry and stage models
- :mod:`.server`: `trident serve` in a subprocess, worker stats checks
- :mod:`.reference`: transformers' ``generate()`` references
"""

from .clients import Result, drain_kv, grpc_generate, http_generate, stage_output, strings
from .media import b64, chat_prompt, make_image, png_bytes
from .reference import build_reference
from .server import Server, descendants, wait_drained

MODES = ["epd", "e_pd", "e_p_d", "ep_d"]
IMAGE_CASES = {"one-image": [(224, 224, 1)], "two-images": [(224, 224, 1), (300, 200, 2)], "text-only": []}

__all__ = [
    "IMAGE_CASES", "MODES", "Result", "Server", "b64", "build_reference", "chat_prompt", "descendants", "drain_kv",
    "grpc_generate", "http_generate", "make_image", "png_bytes", "stage_output", "strings", "wait_drained",
]
