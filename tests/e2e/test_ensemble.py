"""A server whose entry models are Triton ensembles (`scheduler: ensemble`), its E/P/D chain of stage models, and
its clients holding no deployment credential: the head's HTTP and gRPC fronts give each entry model's request the
stage credential, which the ensemble forwards to its steps (supervisor/grpc_front.py, supervisor/http_front.py).
The OpenAI frontend and the start-up warm-up, which hold none either, serve through it; the stage models still
answer only the deployment's own callers."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import requests

from support import b64, build_reference, descendants, grpc_generate, http_generate, make_image, png_bytes, strings
from support.server import serving

pytestmark = pytest.mark.slow

GREEDY = {"max_tokens": 12, "temperature": 0}
CASES = {"one-image": [(224, 224, 21)], "text-only": []}
QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def server(demo_models, tmp_path_factory):
    with serving(demo_models["llava"], tmp_path_factory.mktemp("ensemble") / "ws", modes=["e_p_d"],
                 config={"scheduler": "ensemble"}) as srv:
        srv.model_path = demo_models["llava"]
        yield srv


@pytest.fixture(scope="module")
def reference(server):
    return build_reference(server.model_path, CASES, GREEDY["max_tokens"])


def test_start_up_warmed_the_ensemble_up(server):
    ready = next(i for i, line in enumerate(server.log) if line.startswith("[trident] ready"))
    start_up = server.log[:ready]
    assert any(line.startswith("[trident] warmed up e_p_d in ") for line in start_up), start_up
    assert not [line for line in start_up if "warm-up request" in line], start_up


def test_clients_with_no_credential_get_model_generate_s_text(server, reference):
    """gRPC streamed and whole, HTTP generate and infer-free generate_stream alike; a made-up credential changes
    nothing (the front's takes its place)."""
    made_up = {"trident_stage_key": "0" * 64}
    for case, c in reference.items():
        for parameters in (None, made_up):
            assert grpc_generate(server.grpc, "e_p_d", c["text"], c["images"], GREEDY, stream=True,
                                 parameters=parameters).text == c["expected"], case
            assert grpc_generate(server.grpc, "e_p_d", c["text"], c["images"], GREEDY, stream=False,
                                 parameters=parameters).text == c["expected"], case
            status, body = http_generate(server.http, "e_p_d", c["text"], c["images"], GREEDY, parameters=parameters)
            assert status == 200 and body["text_output"] == c["expected"], (case, body)


def test_the_openai_frontend_serves_through_the_ensemble(server, reference):
    import openai
    from transformers import AutoTokenizer

    c = reference["one-image"]
    prompt = AutoTokenizer.from_pretrained(server.model_path).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False, add_generation_prompt=True)
    expected = grpc_generate(server.grpc, "e_p_d", prompt, c["images"], GREEDY, stream=True).text
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model=f"{Path(server.model_path).name}:e_p_d", max_tokens=GREEDY["max_tokens"], temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + c["images"][0]}},
            {"type": "text", "text": QUESTION}]}])
    assert answer.choices[0].message.content == expected


def test_the_fronts_give_the_credential_to_entry_models_alone(server):
    """A stage model called through the public ports is refused with no credential, with a made-up one (a request
    parameter; over HTTP also as a header), and with a gRPC request that names the entry model and then the stage
    model (protobuf keeps a field's last value: the front reads the name Triton reads)."""
    import grpc
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import _utils, service_pb2

    from support.clients import _grpc_inputs

    refused = "Unauthenticated: stage model encode answers only the deployment's own callers"
    image = {"image": strings(b64(png_bytes(make_image(64, 64, 11))))}
    made_up = "0" * 64
    for headers, parameters in (({}, None), ({"trident_stage_key": made_up}, None), ({}, {"trident_stage_key": made_up})):
        body = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": [image["image"][0][0].decode()]}]}
        if parameters:
            body["parameters"] = parameters
        r = requests.post(f"http://{server.http}/v2/models/encode/infer", json=body, headers=headers, timeout=30)
        assert r.status_code != 200 and refused in r.text, (headers, parameters, r.status_code, r.text[:300])

    def request(model: str, parameters: dict | None = None) -> service_pb2.ModelInferRequest:
        return _utils._get_inference_request(model, _grpc_inputs(grpcclient, image), "", "", None, 0, False, False,
                                             0, None, parameters)

    with grpc.insecure_channel(server.grpc) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for raw in (request("encode").SerializeToString(),
                    request("encode", {"trident_stage_key": made_up}).SerializeToString(),
                    service_pb2.ModelInferRequest(model_name="e_p_d").SerializeToString()
                    + request("encode").SerializeToString()):
            with pytest.raises(grpc.RpcError) as refusal:
                infer(raw, timeout=60)
            assert refused in refusal.value.details(), refusal.value.details()


def test_triton_listens_on_no_port_of_its_own(server):
    """Its HTTP, metrics and gRPC servers are on Unix sockets its user alone reaches; the head's fronts listen."""
    triton = [pid for pid in descendants(server.proc.pid)
              if Path(f"/proc/{pid}/comm").read_text().strip() == "tritonserver"]
    assert len(triton) == 1
    out = subprocess.run(["ss", "-H", "-ltnp"], capture_output=True, text=True, check=True).stdout
    assert not [line for line in out.splitlines() if f"pid={triton[0]}," in line], out
    sockets = server.workspace / "sockets"
    assert {p.name for p in sockets.iterdir()} == {"http.sock", "metrics.sock", f"grpc:{server.grpc_port}"}
