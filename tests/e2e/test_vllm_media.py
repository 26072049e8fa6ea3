"""Video and audio through the vllm engine: `trident serve --backend vllm` of the Qwen3-VL and Qwen2.5-Omni demos in
every mode (Omni: an image, a clip and an audio clip in one request, all through one encode stage, vLLM's encoder), of the
Qwen2-VL and Qwen2.5-VL demos in EPD and E/P/D, and of the Qwen2-Audio demo in E/P/D (their families' own code is the encoder and the split of
prefill from decode; E/PD and EP/D are the same stages paired otherwise, checked with vLLM on LLaVA in
test_vllm_serving.py and with the hf engine on every family), over gRPC streaming and HTTP `generate`.

Every vllm mode gives exactly what vLLM gives in one engine (epd). Where that is also transformers'
`model.generate()`, the test holds it to that too:
- Qwen2-Audio: every case (so its E/P/D is held to transformers directly, and its server runs no EPD engine).
- Qwen3-VL: every case (each clip's patches after their times; an odd-frame clip included), in every mode.
- Qwen2.5-Omni's thinker: every case (image + clip + audio clip; a clip; two audio clips), in every mode.
- Qwen2-VL and Qwen2.5-VL: `short-video` only. For a clip whose temporal positions reach further than its
  frames' larger side in merged patches (`one-video`, `image-and-video`: more temporal patches than that for
  Qwen2-VL; Qwen2.5-VL spaces them `tokens_per_second * seconds per patch` apart), transformers 5.19 starts the
  text after the clip `max(h, w) / merge` positions past the clip's start, where Qwen's reference and vLLM
  start it past the clip's largest position. The hf engine reproduces transformers, the vllm engine vLLM.
"""

from __future__ import annotations

import pytest

from support import (
    MEDIA_CASES, MODES, bad_media, build_media_reference, grpc_generate, http_generate, media_prompt,
    vllm_server, wait_drained,
)

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
GREEDY = {"max_tokens": NEW_TOKENS, "temperature": 0}
KV_STAGES = {"encode", "prefill", "decode", "encode_prefill"}
SERVED_MODES = {"qwen3vl": None, "qwen2_5omni": None, "qwen2_5vl": ["epd", "e_p_d"], "qwen2audio": ["e_p_d"], "qwen2vl": ["epd", "e_p_d"]}
SAME_AS_TRANSFORMERS = {
    "qwen2vl": {"short-video"}, "qwen2_5vl": {"short-video"}, "qwen2audio": set(MEDIA_CASES["qwen2audio"]),
    "qwen3vl": set(MEDIA_CASES["qwen3vl"]), "qwen2_5omni": set(MEDIA_CASES["qwen2_5omni"]),
}


# (qwen3vl first, in every mode: test_vllm_any_model.py ends with it, on the same server; qwen2vl last:
# tests/e2e/test_vllm_serving.py starts with it, on the same server)
@pytest.fixture(scope="module", params=list(SERVED_MODES))
def server(request, demo_models, tmp_path_factory, shared_servers):
    return vllm_server(shared_servers, demo_models[request.param], request.param, tmp_path_factory.mktemp("vllm") / "ws",
                       SERVED_MODES[request.param])


@pytest.fixture(scope="module")
def reference(server):
    return build_media_reference(server.model_path, MEDIA_CASES[server.arch], NEW_TOKENS)


@pytest.fixture(scope="module")
def aggregated(server, reference):
    """vLLM's own output in one engine (epd) for each case; where the server runs no epd, transformers' (which
    vLLM's equals for every case of that family)."""
    if "epd" not in server.modes:
        assert SAME_AS_TRANSFORMERS[server.arch] == set(reference), server.arch
        return {case: c["expected"] for case, c in reference.items()}
    out = {}
    for case, c in reference.items():
        r = grpc_generate(server.grpc, "epd", c["text"], c["media"], GREEDY, stream=True)
        assert (r.num_output_tokens, r.num_input_tokens) == (NEW_TOKENS, c["num_input_tokens"]), case
        out[case] = r.text
    return out


@pytest.mark.parametrize("mode", ["epd"])  # (deselected where the server runs no epd: conftest, SERVED_MODES)
def test_epd_equals_transformers_where_they_agree(server, reference, aggregated, mode):
    for case in SAME_AS_TRANSFORMERS[server.arch]:
        assert aggregated[case] == reference[case]["expected"], case


def test_every_served_mode_equals_vllm_in_one_engine(server, reference, aggregated):
    assert server.modes == (SERVED_MODES[server.arch] or MODES)
    for mode in server.modes:
        for case, c in reference.items():
            streamed = grpc_generate(server.grpc, mode, c["text"], c["media"], GREEDY, stream=True)
            assert streamed.text == aggregated[case], (mode, case)
            assert streamed.num_input_tokens == c["num_input_tokens"], (mode, case)
            status, body = http_generate(server.http, mode, c["text"], c["media"], GREEDY)
            assert status == 200 and body["text_output"] == aggregated[case], (mode, case, body)
    wait_drained(server, KV_STAGES & set(server.stats()), timeout=30)


@pytest.mark.parametrize("mode", ["e_p_d", "epd"])
def test_bad_media_is_a_clear_400_and_the_server_carries_on(server, reference, aggregated, mode):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model_path)
    for problem, (text, media, message) in bad_media(server.arch, lambda kinds: media_prompt(tok, kinds, "Hi.")).items():
        status, body = http_generate(server.http, mode, text, media, GREEDY)
        assert status == 400 and message in body.get("error", ""), (problem, status, body)
    case, c = next(iter(reference.items()))
    assert grpc_generate(server.grpc, mode, c["text"], c["media"], GREEDY, stream=True).text == aggregated[case]
    wait_drained(server, KV_STAGES & set(server.stats()), timeout=30)


