"""The families added on transformers' own multimodal API, on the hf engine in every mode: `trident serve` of each demo
against transformers' `model.generate()` token for token, over gRPC streaming and HTTP `generate`.

Gemma 3: its ``<start_of_image>`` expands to newlines, start and end tokens around the image's embeddings
(``Placeholder.expands_to``); its image tokens attend to each other both ways in the prefill (``token_type_ids``); its
text layers alternate sliding-window (512 positions in the demo) and global attention, so a prompt longer than the
window (the ``long-text`` case, ~630 tokens) is decoded with each layer kind masked as its own (the decoder's per-kind
masks) from a KV cache that holds the whole prompt at every layer.

Qwen3-VL: each image's embedding rows carry its DeepStack features beside its output (``hidden * 3`` wide in the
demo), split again at the prefill, where the first text layers add them at the image tokens; positions are
interleaved M-RoPE. A record whose rows are not that wide is refused.

InternVL 3: an image is its tiles (by its aspect, plus a thumbnail), each pixel-shuffled to 16 tokens in the demo, its
rows joined; ``<IMG_CONTEXT>`` is written as ``<img>``, the tokens and ``</img>``.

The vllm engine's Gemma 3, Qwen3-VL and InternVL are in test_vllm_any_model.py."""

from __future__ import annotations

import pytest
import torch

from support import MODES, b64, internvl_inputs, chat_prompt, grpc_generate, http_generate, make_image, png_bytes, wait_drained
from support.server import check_stopped
from support.served import Server

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
GREEDY = {"max_tokens": NEW_TOKENS, "temperature": 0}
CASES = {  # by family: (image sizes (w, h, seed), the user's text)
    "gemma3": {
        "one-image": ([(300, 200, 1)], "Describe the picture."),
        "two-images": ([(112, 112, 2), (90, 260, 3)], "Compare them."),
        "long-text": ([(160, 120, 4)], " ".join(["The weather today is cloudy with light rain."] * 60) + " Why?"),
        "text-only": ([], "Tell me a story."),
    },
    "qwen3vl": {
        "one-image": ([(300, 200, 1)], "Describe the picture."),
        "two-images": ([(256, 256, 2), (90, 260, 3)], "Compare them."),
        "text-only": ([], "Tell me a story."),
    },
}
CASES["internvl"] = CASES["qwen3vl"]  # (300x200: 2 tiles and a thumbnail; 256x256 and 90x260: 1 and 3 tiles)
SOFT_TOKEN = {"gemma3": "<image_soft_token>", "qwen3vl": "<|image_pad|>", "internvl": "<IMG_CONTEXT>"}


@pytest.fixture(scope="module", params=list(CASES))
def server(request, demo_models, tmp_path_factory, shared_servers):
    arch = request.param

    def start() -> Server:
        srv = Server(demo_models[arch], tmp_path_factory.mktemp(arch) / "ws", openai=False).started(240)
        srv.arch = arch
        return srv

    return shared_servers.get((arch, "hf"), start, check_stopped)


@pytest.fixture(scope="module")
def reference(server):
    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(server.model_path).eval()
    processor = AutoProcessor.from_pretrained(server.model_path) if server.arch != "internvl" else None
    tokenizer = AutoTokenizer.from_pretrained(server.model_path)
    out = {}
    for case, (specs, words) in CASES[server.arch].items():
        images = [make_image(*s) for s in specs]
        text = chat_prompt(tokenizer, len(images), words)
        if processor is None:
            inputs = internvl_inputs(server.model_path, tokenizer, text, images)
        else:
            inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
        with torch.inference_mode():
            ids = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        out[case] = {"text": text, "images": [b64(png_bytes(i)) for i in images], "num_input_tokens": inputs["input_ids"].shape[1],
                     "expected": tokenizer.decode(ids.tolist(), skip_special_tokens=True)}
    if server.arch == "gemma3":
        assert out["long-text"]["num_input_tokens"] > 512  # (past the demo's sliding window)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_equals_transformers(server, reference, mode):
    for case, c in reference.items():
        streamed = grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True)
        assert streamed.text == c["expected"], (mode, case)
        assert (streamed.num_input_tokens, streamed.num_output_tokens) == (c["num_input_tokens"], NEW_TOKENS), (mode, case)
        status, body = http_generate(server.http, mode, c["text"], c["images"], GREEDY)
        assert status == 200 and body["text_output"] == c["expected"], (mode, case, body)
    wait_drained(server, {"encode", "prefill", "decode", "encode_prefill"} & set(server.stats()), timeout=30)


def test_a_soft_token_outside_its_placeholder_is_a_400(server, reference):
    c, token = reference["one-image"], SOFT_TOKEN[server.arch]
    status, body = http_generate(server.http, "e_p_d", c["text"] + token, c["images"], GREEDY)
    said = (f"the prompt has 2 image placeholder(s) {token!r} but the request carries 1 image(s)"
            if server.arch == "internvl" else f"{token!r} outside a image placeholder")  # (InternVL's token is its placeholder)
    assert status == 400 and said in body["error"], body
