"""End to end through a real Triton server: `trident serve` with every mode, tritonclient over gRPC and HTTP."""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from support import (
    ADDITIONAL, LOGPROB_FLAGS, credential,
    BAD_REQUESTS, IMAGE_CASES, MODES, b64, bad_request, build_reference, drain_kv, grpc_generate,
    http_generate, make_image, png_bytes, quiet_vllm_metrics, settled_vllm_metrics, shared_llava_server, shared_media_server,
    stage_output, strings, wait_drained,
)
from trident.core.protocol import HFKVRecord, decode_record

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
GREEDY = {"max_tokens": NEW_TOKENS, "temperature": 0}
IMAGE_SPECS = IMAGE_CASES


@pytest.fixture(scope="module", params=["qwen2vl", "llava"])
def server(request, demo_models, tmp_path_factory, shared_servers):
    """Qwen2-VL's server from test_media_serving.py, then the LLaVA server test_openai.py, test_bad_input.py and
    test_trust.py go on with (conftest orders them): every mode, every test here leaves it as it found it."""
    model = demo_models[request.param]
    srv = shared_media_server(shared_servers, model, request.param, tmp_path_factory) if request.param == "qwen2vl" \
        else shared_llava_server(shared_servers, model, tmp_path_factory)
    srv.arch, srv.model_path = request.param, model
    return srv


@pytest.fixture(scope="module")
def reference(server):
    return build_reference(server.model_path, IMAGE_SPECS, NEW_TOKENS)


def test_start_up_warms_every_loaded_mode(server):
    """Before `ready`, one request with an image went through each loaded entry model, and none failed."""
    ready = next(i for i, line in enumerate(server.log) if line.startswith("[trident] ready"))
    start_up = server.log[:ready]
    warmed = [line for line in start_up if line.startswith("[trident] warmed up ")]
    assert warmed and warmed[0].startswith("[trident] warmed up epd, e_pd, e_p_d, ep_d in "), start_up
    assert not [line for line in start_up if "warm-up request" in line], start_up
    assert not [line for line in start_up if " WARNING trident" in line], start_up  # a quiet start
    if not shutil.which("nvidia-smi"):  # Triton asked for no GPU metrics, so no NVML error
        assert not [line for line in start_up if "NVML" in line], start_up


def test_add_mode_while_serving(server, reference, admin):
    """A mode unloaded while the others serve, then loaded again (as a user adds a mode): it serves as before."""
    headers = {"triton-access-token": server.token}
    admin.unload_model("ep_d", headers=headers)
    try:
        deadline = time.monotonic() + 30
        while admin.is_model_ready("ep_d") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not admin.is_model_ready("ep_d")
        assert admin.is_model_ready("e_p_d")
    finally:  # (loaded again whatever happened: the tests after this one serve ep_d)
        admin.load_model("ep_d", headers=headers)
    assert admin.is_model_ready("ep_d")
    c = reference["one-image"]
    assert grpc_generate(server.grpc, "ep_d", c["text"], c["images"], GREEDY, stream=True).text == c["expected"]


@pytest.mark.parametrize("case", list(IMAGE_SPECS))
@pytest.mark.parametrize("mode", MODES)
def test_modes_equal_generate(server, reference, mode, case):
    c = reference[case]
    streamed = grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True)
    assert streamed.text == c["expected"]
    assert streamed.responses > 1
    assert (streamed.finish_reason, streamed.num_output_tokens) == ("length", NEW_TOKENS)
    assert streamed.num_input_tokens == c["num_input_tokens"]

    whole = grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=False)
    assert (whole.text, whole.responses) == (c["expected"], 1)

    status, body = http_generate(server.http, mode, c["text"], c["images"], GREEDY)
    assert status == 200, body
    assert body["text_output"] == c["expected"]
    assert body["finish_reason"] == "length" and body["num_output_tokens"] == NEW_TOKENS


@pytest.mark.servers("llava")  # (Qwen2-VL's ensemble carries media in test_media_serving.py)
@pytest.mark.parametrize("mode", MODES)
def test_ensemble_equals_bls_scheduler(server, reference, mode):
    """The same entry model as Triton's ensemble (swapped in while serving) gives what the BLS scheduler (the
    default, test_modes_equal_generate) gives, model.generate()'s text for every case, streamed over gRPC and over
    HTTP generate; swapped back, the BLS serves again."""
    try:
        server.swap_scheduler(mode, "ensemble")
        for case, c in reference.items():
            # an ensemble's steps are the stage models: its clients prove the deployment secret
            streamed = grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True,
                                     parameters=credential())
            assert streamed.text == c["expected"], case
            status, body = http_generate(server.http, mode, c["text"], c["images"], GREEDY, parameters=credential())
            assert status == 200 and body["text_output"] == c["expected"], case
    finally:
        server.swap_scheduler(mode, "bls")
    c = next(iter(reference.values()))
    assert grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True).text == c["expected"]


def test_include_input_in_output(server, reference):
    import tritonclient.http as httpclient

    c = reference["text-only"]
    status, body = http_generate(server.http, "e_p_d", c["text"], [], GREEDY)
    assert status == 200
    # exclude_input_in_output=false (the vLLM backend's default) puts the prompt first.
    import requests

    r = requests.post(f"http://{server.http}/v2/models/e_p_d/generate",
                      json={"text_input": c["text"], "sampling_parameters": json.dumps(GREEDY)}, timeout=60)
    assert r.status_code == 200 and r.json()["text_output"] == c["text"] + c["expected"]
    assert httpclient  # the HTTP client package is importable for users of the examples


@pytest.mark.parametrize("size", [(64, 64), (224, 224), (1024, 768)])  # (the shared server takes up to 2 MiB)
def test_stage_records_are_small(server, reference, size):
    text = reference["one-image"]["text"]
    image = strings(b64(png_bytes(make_image(*size, 5))))
    emb = stage_output(server.grpc, "encode", {"image": image})
    assert 0 < len(emb) <= 1024
    kv = stage_output(server.grpc, "prefill", {"text_input": strings(text), "embedding_meta": strings(emb)})
    assert 0 < len(kv) <= 1024
    kv2 = stage_output(server.grpc, "encode_prefill", {"text_input": strings(text), "image": image})
    assert 0 < len(kv2) <= 1024
    # Consume the KV through decode so nothing is left to expire.
    for record in (kv, kv2):
        assert isinstance(decode_record(record), HFKVRecord)
        drain_kv(server.grpc, record)


def test_sixteen_concurrent_streams_and_pools_drain(server, reference):
    cases = [reference[c] for c in IMAGE_SPECS]

    def one(i: int):
        c = cases[i % len(cases)]
        return grpc_generate(server.grpc, "e_p_d", c["text"], c["images"], GREEDY, stream=True).text, c["expected"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    for got, expected in results:
        assert got == expected
    wait_drained(server, {"encode", "prefill", "decode"})


PARAMS_ONLY = {"bad json", "bad value", "seed past 64 bits", "not honoured", "deep json", "long stop"}
"""Problems of ``sampling_parameters`` alone: the first stage of every mode refuses them with the same code
(``worker/infer.py``), so two modes (its first stage ``generate``, and ``encode``) cover them."""


@pytest.mark.parametrize("mode, problem", [
    (mode, problem) for problem in BAD_REQUESTS for mode in (["epd", "e_p_d"] if problem in PARAMS_ONLY else MODES)
])
def test_bad_requests_are_clear_errors(server, reference, mode, problem):
    c = reference["one-image"]
    text, images, params, message = bad_request(c, problem, GREEDY)
    status, body = http_generate(server.http, mode, text, images, params)
    assert status == 400, body
    assert message in body["error"]
    with pytest.raises(Exception, match=message):
        grpc_generate(server.grpc, mode, text, images, params, stream=True)
    # still serving
    ok = grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True)
    assert ok.text == c["expected"]


def test_swap_entry_model_while_streaming(server, reference, admin):
    headers = {"triton-access-token": server.token}
    c = reference["one-image"]
    long_params = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        streaming = pool.submit(grpc_generate, server.grpc, "e_p_d", c["text"], c["images"], long_params, True)
        time.sleep(0.5)
        admin.unload_model("e_pd", headers=headers)
        deadline = time.monotonic() + 30
        while admin.is_model_ready("e_pd") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not admin.is_model_ready("e_pd")
        with pytest.raises(Exception):
            grpc_generate(server.grpc, "e_pd", c["text"], c["images"], GREEDY, stream=True)
        admin.load_model("e_pd", headers=headers)
        result = streaming.result(timeout=120)
    assert result.num_output_tokens == 200 and result.finish_reason == "length"
    assert admin.is_model_ready("e_pd")
    for mode in ("e_pd", "e_p_d"):
        assert grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True).text == c["expected"]
    # The repository API refuses callers without the token.
    with pytest.raises(Exception, match="(?i)token|unauthori|denied|permission"):
        admin.unload_model("e_pd")


def test_vllm_backend_metrics_count_each_answered_request(server, reference):
    """The eight families of Triton's vLLM backend, in its names, labels and buckets, per entry model: a streamed
    answer and a whole one are each counted once with their token counts; a refused request is not; the outputs the
    scheduler always asks the stage for reach only a client that asked for them."""
    import requests

    from trident.in_triton.scheduler.engine_metrics import LATENCY_BUCKETS, N_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS

    c = reference["one-image"]
    before = quiet_vllm_metrics(server, ("e_p_d", "epd"))
    streamed = grpc_generate(server.grpc, "e_p_d", c["text"], c["images"], GREEDY, stream=True)
    status, whole = http_generate(server.http, "epd", c["text"], c["images"], GREEDY)
    assert status == 200 and streamed.text == whole["text_output"] == c["expected"]
    status, _ = http_generate(server.http, "epd", c["text"], c["images"], {"max_tokens": -1})
    assert status == 400
    r = requests.post(f"http://{server.http}/v2/models/e_p_d/generate", timeout=60, json={
        "text_input": c["text"], "image": c["images"], "sampling_parameters": json.dumps({"max_tokens": 2})})
    assert r.status_code == 200 and not {"finish_reason", "num_input_tokens", "num_output_tokens"} & set(r.json())
    # (an entry model counts a request just after its last response: poll)
    after = settled_vllm_metrics(server, before, {"e_p_d": 2, "epd": 1})

    def delta(model: str, name: str) -> float:
        return after[model].get(name, 0) - before[model].get(name, 0)

    for model, answers, tokens, streams in (("e_p_d", 2, NEW_TOKENS + 2, 1), ("epd", 1, NEW_TOKENS, 0)):
        assert delta(model, "vllm:prompt_tokens_total") == answers * c["num_input_tokens"], model
        assert delta(model, "vllm:generation_tokens_total") == tokens, model
        assert delta(model, "vllm:request_prompt_tokens_sum") == answers * c["num_input_tokens"], model
        assert delta(model, "vllm:request_generation_tokens_sum") == tokens, model
        for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
                     "request_generation_tokens", "request_params_n"):
            assert delta(model, f"vllm:{name}_count") == answers, (model, name)
        assert delta(model, "vllm:request_params_n_sum") == answers, model
        assert delta(model, "vllm:time_per_output_token_seconds_count") == streams, model
    for name, buckets in (("time_to_first_token_seconds", TTFT_BUCKETS), ("time_per_output_token_seconds", TPOT_BUCKETS),
                          ("e2e_request_latency_seconds", LATENCY_BUCKETS), ("request_params_n", N_BUCKETS)):
        les = sorted(float(k.split("{")[1].rstrip("}")) for k in after["e_p_d"] if k.startswith(f"vllm:{name}_bucket{{"))
        assert les == [float(b) for b in buckets] + [float("inf")], name
@pytest.mark.parametrize("mode", MODES)
def test_logprobs_equal_transformers_log_softmax(server, reference, mode):
    """``logprobs`` and ``cumulative_logprob`` in the vLLM backend's shape (every response: its own tokens' entries
    and the sum so far; ``finish_reason`` "None" before the last), each token's equal to the log-softmax of
    transformers' logits at that step (in E/P/D and EP/D the first token's comes in the prefill's record), streamed
    and not. Without ``logprobs`` in the sampling parameters they are null and NaN, as the vLLM backend's."""
    import math

    import torch

    c = reference["one-image"]
    flags = (*ADDITIONAL, *LOGPROB_FLAGS)
    for stream in (True, False):
        r = grpc_generate(server.grpc, mode, c["text"], c["images"], {**GREEDY, "logprobs": 2}, stream=stream, flags=flags)
        assert r.text == c["expected"] and (r.responses > 1) == stream
        for i, o in enumerate(r.outputs):
            assert o["finish_reason"] == ("length" if i == r.responses - 1 else "None")
            assert o["num_input_tokens"] == c["num_input_tokens"]
            assert o["num_output_tokens"] == len(json.loads(o["logprobs"])) >= 1
        entries = r.logprobs
        assert [int(next(iter(e))) for e in entries] == c["ids"]
        for entry, ref in zip(entries, c["logprobs"]):
            ranked = torch.sort(ref, descending=True).values
            assert {1, 2} <= {v["rank"] for v in entry.values()} and len(entry) <= 3
            for token, got in entry.items():
                assert abs(got["logprob"] - float(ref[int(token)])) < 1e-3, (token, got)
                assert abs(float(ranked[got["rank"] - 1]) - got["logprob"]) < 1e-3, (token, got)  # its rank's value
        total = sum(next(iter(e.values()))["logprob"] for e in entries)
        assert abs(r.outputs[-1]["cumulative_logprob"] - total) < 1e-3 * len(entries)
    plain = grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True, flags=LOGPROB_FLAGS)
    assert plain.text == c["expected"]
    assert all(o["logprobs"] == "null" and math.isnan(o["cumulative_logprob"]) for o in plain.outputs)


STRUCTURED = {  # structured_outputs -> what the whole text must be
    "choice": ({"choice": ["yes", "no", "maybe"]}, r"yes|no|maybe"),
    "regex": ({"regex": "[0-9]{2}-[a-z]{3}"}, r"[0-9]{2}-[a-z]{3}"),
    "json": ({"json": {"type": "object", "properties": {"n": {"type": "integer", "enum": [1, 2, 3]}},
                       "required": ["n"], "additionalProperties": False}}, r'\s*\{\s*"n"\s*:\s*[123]\s*\}\s*'),
}


@pytest.mark.parametrize("kind", list(STRUCTURED))
def test_structured_output_in_every_mode(server, reference, kind):
    """``sampling_parameters.structured_outputs`` (vLLM's names; as Triton's vLLM backend takes it, a JSON string):
    in every mode the text keeps to it from its first token (sampled where the prompt is prefilled) and ends when it
    is complete, and every mode gives what EPD gives; a schema that does not compile is a 400 naming the problem."""
    import re

    c = reference["one-image"]
    spec, pattern = STRUCTURED[kind]
    params = {"max_tokens": 48, "temperature": 0, "structured_outputs": json.dumps(spec)}
    texts = {}
    for mode in MODES:
        r = grpc_generate(server.grpc, mode, c["text"], c["images"], params, stream=True)
        assert re.fullmatch(pattern, r.text) and r.finish_reason == "stop", (mode, r.text, r.finish_reason)
        texts[mode] = r.text
    assert len(set(texts.values())) == 1, texts
    status, body = http_generate(server.http, "e_p_d", c["text"], c["images"],
                                 {"structured_outputs": {"json": {"type": "objekt"}}})
    assert status == 400 and 'structured_outputs: Unsupported type "objekt"' in body["error"], body
