"""Video and audio end to end on the hf engine: `trident serve` of Qwen2-VL and Qwen2.5-VL (video, image +
video) and of Qwen2-Audio (one clip, two clips, text only) in every mode, against transformers' `model.generate()`, over
gRPC streaming, gRPC and HTTP `generate`, and through the OpenAI API; bad media gets a 400 naming the problem."""

from __future__ import annotations

import base64
import time

import pytest

from support import (
    credential,
    MEDIA_CASES as CASES, MODES, audio_bytes, b64, bad_media, build_media_reference, drain_kv, grpc_generate, http_generate,
    make_frames, make_wave, media_prompt, stage_output, strings,
    shared_media_server, video_bytes, wait_drained,
)
from support.server import SHARED_MEDIA_NAME

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
GREEDY = {"max_tokens": NEW_TOKENS, "temperature": 0}
NAME = SHARED_MEDIA_NAME


@pytest.fixture(scope="module", params=["qwen2audio", "qwen2_5omni", "qwen3vl", "qwen2_5vl", "qwen2vl"])
def server(request, demo_models, tmp_path_factory, shared_servers):
    """Each family's server in every mode; Qwen2-VL's (last) goes on to test_serving.py."""
    srv = shared_media_server(shared_servers, demo_models[request.param], request.param, tmp_path_factory)
    srv.arch = request.param
    return srv


@pytest.fixture(scope="module")
def reference(server):
    return build_media_reference(server.model_path, CASES[server.arch], NEW_TOKENS)


def _cases(server, reference):
    return [(case, reference[case]) for case in CASES[server.arch]]


def test_start_up_warms_up_with_the_family_s_media(server):
    assert [line for line in server.log if line.startswith("[trident] warmed up epd, e_pd, e_p_d, ep_d in ")], server.log
    assert not [line for line in server.log if "warm-up request" in line], server.log


@pytest.mark.parametrize("mode", MODES)
def test_modes_equal_generate(server, reference, mode):
    for case, c in _cases(server, reference):
        streamed = grpc_generate(server.grpc, mode, c["text"], c["media"], GREEDY, stream=True)
        assert streamed.text == c["expected"], case
        assert (streamed.finish_reason, streamed.num_output_tokens) == ("length", NEW_TOKENS), case
        assert streamed.num_input_tokens == c["num_input_tokens"], case
        whole = grpc_generate(server.grpc, mode, c["text"], c["media"], GREEDY, stream=False)
        assert (whole.text, whole.responses) == (c["expected"], 1), case
        status, body = http_generate(server.http, mode, c["text"], c["media"], GREEDY)
        assert status == 200 and body["text_output"] == c["expected"], (case, body)


def test_a_repeated_clip_is_a_cache_hit_and_a_new_one_is_encoded_once(server, reference):
    """The embedding cache and encode-once key clips by content: the same clip again (through another mode)
    runs no encoder, and four concurrent requests with a clip the cache has not seen encode it once."""
    from concurrent.futures import ThreadPoolExecutor

    case, c = _cases(server, reference)[0]
    clips = len(CASES[server.arch][case])

    def encode_stats(until=None) -> dict:
        deadline = time.monotonic() + 5
        while True:
            stats = server.stats()["encode"]
            if until is None or until(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def run(mode: str = "e_p_d") -> str:
        return grpc_generate(server.grpc, mode, c["text"], c["media"], GREEDY, stream=True).text

    def hits() -> dict[str, float]:  # (Triton's metrics port, by kind)
        out: dict[str, float] = {}
        for (name, labels), value in server.metrics().items():
            if name == "trident_embedding_cache_hits_total":
                out[dict(labels)["kind"]] = out.get(dict(labels)["kind"], 0) + value
        return out

    assert run() == c["expected"]
    before, counted = server.stats(settled=True)["encode"], hits()
    for mode in ("e_p_d", "e_pd"):
        assert run(mode) == c["expected"]
    after = encode_stats(lambda s: s["published"] == before["published"] + 2)
    assert after["vision_runs"] == before["vision_runs"]
    assert after["cache_hits"] - before["cache_hits"] == 2 * clips
    kinds = [kind for kind, _ in CASES[server.arch][case]]
    assert {k: v - counted.get(k, 0) for k, v in hits().items() if v != counted.get(k, 0)} == {
        k: 2 * kinds.count(k) for k in kinds}

    kind, raw = CASES[server.arch][case][0]
    fresh = {**c["media"], kind: [b64(raw + b"\0")] + c["media"][kind][1:]}  # other bytes, the same clip
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda _: grpc_generate(server.grpc, "e_p_d", c["text"], fresh, GREEDY, stream=True).text, range(4)))
    assert texts == [c["expected"]] * 4
    done = encode_stats(lambda s: s["published"] == after["published"] + 4)
    assert done["cache_misses"] - after["cache_misses"] == 1
    assert (done["encodes_shared"] - after["encodes_shared"]) + (done["cache_hits"] - after["cache_hits"]) == 4 * clips - 1


def test_ensemble_carries_media(server, reference):
    """Triton's ensemble (swapped in while serving) hands the video and audio inputs to encode as well."""
    try:
        server.swap_scheduler("e_p_d", "ensemble")
        for case, c in _cases(server, reference):
            assert grpc_generate(server.grpc, "e_p_d", c["text"], c["media"], GREEDY, stream=True,
                                 parameters=credential()).text == c["expected"], case  # an ensemble's client proves it
    finally:
        server.swap_scheduler("e_p_d", "bls")


def _openai_part(kind: str, raw: bytes) -> dict:
    data = base64.b64encode(raw).decode()
    if kind == "video":
        return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + data}}
    if kind == "audio":
        return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}


@pytest.mark.parametrize("mode", MODES)
def test_openai_media_parts_equal_entry_model(server, reference, mode):
    """video_url and input_audio parts get the entry model's text; usage counts the media tokens."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key="unused", max_retries=0)
    case, c = _cases(server, reference)[0]
    items = CASES[server.arch][case]
    content = [_openai_part(kind, raw) for kind, raw in items] + [{"type": "text", "text": "What happens in it?"}]
    r = client.chat.completions.create(model=f"{NAME}:{mode}", messages=[{"role": "user", "content": content}],
                                       max_tokens=NEW_TOKENS, temperature=0)
    assert r.choices[0].message.content == c["expected"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (c["num_input_tokens"], NEW_TOKENS)


def test_openai_media_urls_equal_data_urls(server, reference, tmp_path):
    """video_url and audio_url parts with a path under frontend.media.allowed_media_dir, and with an http URL (fetched from
    a local server, so by a frontend that allows private URLs), give the data URL's text; a path outside the
    folder and a missing file are 400s naming them."""
    import functools
    import http.server
    import threading

    import openai
    from fastapi.testclient import TestClient

    from trident.core.config import FrontendSettings, MediaPolicy
    from trident.frontend.app import create_app
    from trident.frontend.app import TritonEngine

    case, c = _cases(server, reference)[0]
    items = CASES[server.arch][case]
    part = {"video": "video_url", "audio": "audio_url", "image": "image_url"}
    for i, (kind, raw) in enumerate(items):
        (server.media_dir / f"item{i}").write_bytes(raw)
        (tmp_path / f"item{i}").write_bytes(raw)

    def content(url) -> list[dict]:
        return [{"type": part[kind], part[kind]: {"url": url(i)}} for i, (kind, _) in enumerate(items)] + [
            {"type": "text", "text": "What happens in it?"}]

    def ask(post, url) -> tuple[int, dict]:
        r = post({"model": NAME, "max_tokens": NEW_TOKENS, "temperature": 0,
                  "messages": [{"role": "user", "content": content(url)}]})
        return r.status_code, r.json()

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content(
        lambda i: str(server.media_dir / f"item{i}"))}], max_tokens=NEW_TOKENS, temperature=0)
    assert r.choices[0].message.content == c["expected"]
    with pytest.raises(openai.BadRequestError, match="outside the allowed media folder"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content(
            lambda i: str(tmp_path / f"item{i}"))}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="is not a file"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content(
            lambda i: f"file://{server.media_dir}/missing{i}")}], max_tokens=2)

    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        app = create_app(FrontendSettings(model_name=NAME, model_path=server.model_path,
                                          media=MediaPolicy(allow_private_urls=True, allowed_ports=None)),
                         TritonEngine(server.grpc))
        with TestClient(app) as http_client:
            def post(body):
                return http_client.post("/v1/chat/completions", json=body)
            status, body = ask(post, lambda i: f"{base}/item{i}")
            assert status == 200 and body["choices"][0]["message"]["content"] == c["expected"], body
            status, body = ask(post, lambda i: f"{base}/missing{i}")
            assert status == 400 and "HTTP 404" in body["error"]["message"], body
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("mode", ["e_p_d", "epd"])
def test_bad_media_is_a_clear_400_and_the_server_carries_on(server, reference, mode):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model_path)
    for problem, (text, media, message) in bad_media(server.arch, lambda kinds: media_prompt(tok, kinds, "Hi.")).items():
        status, body = http_generate(server.http, mode, text, media, GREEDY)
        assert status == 400 and message in body.get("error", ""), (problem, status, body)
    case, c = _cases(server, reference)[0]
    assert grpc_generate(server.grpc, mode, c["text"], c["media"], GREEDY, stream=True).text == c["expected"]


def test_openai_audio_format_is_checked(server):
    """The frontend checks an input_audio part's format against its bytes, before any model sees it."""
    import requests

    wav = base64.b64encode(audio_bytes(make_wave(1.0))).decode()
    for fmt, message in (("mp3", "input_audio 0 says format 'mp3' but its bytes are 'wav'"),
                         ("aiff", "input_audio 0 has format 'aiff'; supported: wav, mp3, flac, ogg")):
        content = [{"type": "input_audio", "input_audio": {"data": wav, "format": fmt}}, {"type": "text", "text": "Hi"}]
        r = requests.post(f"http://127.0.0.1:{server.openai_port}/v1/chat/completions", timeout=60,
                          json={"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 2})
        assert r.status_code == 400 and message in r.json()["error"]["message"], (fmt, r.text)


def test_records_stay_small(server):
    """A 32-frame clip and a 30 s clip: the encode stage's record and the prefill's are at most 1 KiB."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model_path)
    if server.arch != "qwen2audio":
        kind, raw = "video", video_bytes(make_frames(64, 96, 64, 9), fps=4)  # 16 s at 2 fps: 32 frames
    else:
        kind, raw = "audio", audio_bytes(make_wave(30.0, seed=5))
    emb = stage_output(server.grpc, "encode", {kind: strings(b64(raw))})
    assert 0 < len(emb) <= 1024
    from trident.core.protocol import EmbeddingsRecord, decode_record

    record = decode_record(emb, EmbeddingsRecord)
    assert record.kinds == [kind]
    if kind == "video":
        assert record.grid_thw[0][0] == 16  # 32 frames in temporal pairs
    else:
        assert record.token_counts == [750]
    kv = stage_output(server.grpc, "prefill", {"text_input": strings(media_prompt(tok, [kind], "Hi.")),
                                               "embedding_meta": strings(emb)})
    assert 0 < len(kv) <= 1024
    drain_kv(server.grpc, kv)
    wait_drained(server, {"encode", "prefill", "decode"})
