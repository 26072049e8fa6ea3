"""End to end through a real Triton server: `trident serve` with every mode, tritonclient over gRPC and HTTP."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from support import (
    ADDITIONAL, LOGPROB_FLAGS, credential,
    BAD_REQUESTS, IMAGE_CASES, MODES, Server, b64, bad_request, build_reference, drain_kv, grpc_generate,
    http_generate, make_image, png_bytes, stage_output, strings, wait_drained,
)
from trident.protocol import HFKVRecord, decode_record

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
GREEDY = {"max_tokens": NEW_TOKENS, "temperature": 0}
IMAGE_SPECS = IMAGE_CASES


@pytest.fixture(scope="module", params=["llava", "qwen2vl"])
def server(request, demo_models, tmp_path_factory):
    # ep_d's stages run but its entry model is loaded by a test, as a user adds a mode while serving.
    srv = Server(demo_models[request.param], tmp_path_factory.mktemp("serve") / "ws", load=["epd", "e_pd", "e_p_d"])
    try:
        srv.wait_ready()
        srv.arch = request.param
        srv.model_path = demo_models[request.param]
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, "\n".join(srv.log[-30:])
        # (a worker's own output may share the line: it writes to the same pipe)
        assert any(line.endswith("[trident] stopped") for line in srv.log), "\n".join(srv.log[-30:])
        for pid in srv.worker_pids():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


@pytest.fixture(scope="module")
def reference(server):
    return build_reference(server.model_path, IMAGE_SPECS, NEW_TOKENS)


def test_start_up_warms_every_loaded_mode(server):
    """Before `ready`, one request with an image went through each loaded entry model, and none failed."""
    warmed = [line for line in server.log if line.startswith("[trident] warmed up ")]
    assert warmed and warmed[0].startswith("[trident] warmed up epd, e_pd, e_p_d in "), server.log
    assert not [line for line in server.log if "warm-up request" in line], server.log
    assert server.log.index(warmed[0]) < next(i for i, line in enumerate(server.log) if line.startswith("[trident] ready"))
    assert not [line for line in server.log if " WARNING trident" in line], server.log  # a quiet start

def test_add_mode_while_serving(server, reference, admin):
    assert not admin.is_model_ready("ep_d")
    assert admin.is_model_ready("e_p_d")
    admin.load_model("ep_d", headers={"triton-access-token": server.token})
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


@pytest.mark.parametrize("size", [(64, 64), (224, 224), (1024, 768), (2048, 2048)])
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
(``workers/infer.py``), so two modes (its first stage ``generate``, and ``encode``) cover them."""


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
