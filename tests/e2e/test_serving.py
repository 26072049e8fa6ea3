"""End to end through a real Triton server: `trident serve` with every mode, tritonclient over gRPC and HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import chat_prompt, make_image, png_bytes
from triton_client import b64, grpc_generate, http_generate
from trident.netutil import free_ports

pytestmark = pytest.mark.slow

MODES = ["epd", "e_pd", "e_p_d", "ep_d"]
NEW_TOKENS = 24
GREEDY = {"max_tokens": NEW_TOKENS, "temperature": 0}
IMAGE_SPECS = {"one-image": [(224, 224, 1)], "two-images": [(224, 224, 1), (300, 200, 2)], "text-only": []}


class Server:
    """`trident serve` in a subprocess on free ports; stopped with SIGTERM like a user's Ctrl-C."""

    def __init__(
        self, model: str, workspace: Path, modes: list[str] | None = None, load: list[str] | None = None,
        extra: list[str] | None = None,
    ) -> None:
        self.http_port, self.grpc_port, self.metrics_port, self.openai_port = free_ports(4)
        self.model_path = model
        self.workspace = workspace
        self.token = "test-token-123"
        cmd = [
            sys.executable, "-m", "trident.cli", "serve", "--model", model,
            "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
            "--metrics-port", str(self.metrics_port), "--openai-port", str(self.openai_port),
            "--workspace", str(workspace), *(extra or []),
            "--access-token", self.token, "--mode", *(modes or ["all"]),
        ]
        if load is not None:
            cmd += ["--load", *load]
        self.log: list[str] = []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, HF_HUB_OFFLINE="1"))
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            if line.startswith("[trident] ready"):
                self._ready.set()

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server did not start:\n" + "\n".join(self.log[-40:]))

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def stats(self) -> dict[str, dict]:
        return {p.stem: json.loads(p.read_text()) for p in (self.workspace / "stats").glob("*.json")}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


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
        assert "[trident] stopped" in srv.log
        for line in srv.log:
            if "started worker" in line:
                pid = int(line.rsplit("pid ", 1)[1].rstrip(")"))
                with pytest.raises(ProcessLookupError):
                    os.kill(pid, 0)


def build_reference(model_path: str, arch: str, specs_by_case: dict, new_tokens: int) -> dict:
    """The prompt, images and model.generate() text of each case on a checkpoint."""
    from transformers import AutoProcessor

    from trident.engines.hf import load_model

    model, processor = load_model(model_path, arch), AutoProcessor.from_pretrained(model_path)
    cases = {}
    for case, specs in specs_by_case.items():
        images = [make_image(*s) for s in specs]
        text = chat_prompt(processor.tokenizer, len(images), "Describe the picture in detail, please.")
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        ids = out[0, inputs["input_ids"].shape[1]:].tolist()
        cases[case] = {
            "text": text,
            "images": [b64(png_bytes(i)) for i in images],
            "expected": processor.tokenizer.decode(ids, skip_special_tokens=True),
            "num_input_tokens": inputs["input_ids"].shape[1],
        }
    return cases


@pytest.fixture(scope="module")
def reference(server):
    return build_reference(server.model_path, server.arch, IMAGE_SPECS, NEW_TOKENS)


def test_add_mode_while_serving(server, reference):
    import tritonclient.http as httpclient

    admin = httpclient.InferenceServerClient(server.http)
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


def _stage_output(server, model: str, inputs: dict) -> bytes:
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc)
    tensors = []
    for name, (arr, dtype) in inputs.items():
        t = grpcclient.InferInput(name, arr.shape, dtype)
        t.set_data_from_numpy(arr)
        tensors.append(t)
    out_name = "embedding_meta" if model == "encode" else "kv_meta"
    result = client.infer(model, tensors)
    value = result.as_numpy(out_name).reshape(-1)[0]
    assert isinstance(value, bytes) and np is not None
    return value


@pytest.mark.parametrize("size", [(64, 64), (224, 224), (1024, 768), (2048, 2048)])
def test_stage_records_are_small(server, reference, size):
    import numpy as np

    from trident.protocol import TransferRecord

    text = reference["one-image"]["text"]
    image = np.array([b64(png_bytes(make_image(*size, 5))).encode()], dtype=np.object_)
    prompt = np.array([text.encode()], dtype=np.object_)
    emb = _stage_output(server, "encode", {"image": (image, "BYTES")})
    assert 0 < len(emb) <= 1024
    kv = _stage_output(server, "prefill", {"text_input": (prompt, "BYTES"),
                                           "embedding_meta": (np.array([emb], dtype=np.object_), "BYTES")})
    assert 0 < len(kv) <= 1024
    kv2 = _stage_output(server, "encode_prefill", {"text_input": (prompt, "BYTES"), "image": (image, "BYTES")})
    assert 0 < len(kv2) <= 1024
    # Consume the KV through decode so nothing is left to expire.
    for record in (kv, kv2):
        assert TransferRecord.decode(record).layout == "kv"
        _drain_kv(server, record)


def _drain_kv(server, kv: bytes, text: str | None = None) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient

    q = __import__("queue").Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    t = grpcclient.InferInput("kv_meta", [1], "BYTES")
    t.set_data_from_numpy(np.array([kv], dtype=np.object_))
    s = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    s.set_data_from_numpy(np.array([json.dumps({"max_tokens": 2, "temperature": 0}).encode()], dtype=np.object_))
    inputs = [t, s]
    if text is not None:  # the vllm decode stage needs the prompt
        p = grpcclient.InferInput("text_input", [1], "BYTES")
        p.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        inputs.append(p)
    client.async_stream_infer("decode", inputs)
    result, error = q.get(timeout=60)
    assert error is None, error
    client.stop_stream()


def test_sixteen_concurrent_streams_and_pools_drain(server, reference):
    cases = [reference[c] for c in IMAGE_SPECS]

    def one(i: int):
        c = cases[i % len(cases)]
        return grpc_generate(server.grpc, "e_p_d", c["text"], c["images"], GREEDY, stream=True).text, c["expected"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    for got, expected in results:
        assert got == expected
    _assert_pools_drained(server)


def _assert_pools_drained(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        busy = {k: v for k, v in stats.items() if v.get("send_regions_in_use") or v.get("recv_regions_in_use")}
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert {"encode", "prefill", "decode"} <= set(stats)
    assert not busy, busy
    assert all(v.get("expired", 0) == 0 for v in stats.values()), stats


BAD = {
    "undecodable image": ({"images": [b64(b"this is not an image at all")]}, "could not be decoded as an image"),
    "not base64": ({"images": ["@@@ not base64 @@@"]}, "not valid base64"),
    "image count": ({"images": "two"}, "image placeholder"),
    "bad json": ({"params": "{max_tokens: 3"}, "sampling_parameters is not valid JSON"),
    "bad value": ({"params": {"max_tokens": -4}}, "max_tokens"),
    "too long": ({"suffix": " word" * 5000}, "context window"),
}


@pytest.mark.parametrize("problem", list(BAD))
@pytest.mark.parametrize("mode", MODES)
def test_bad_requests_are_clear_errors(server, reference, mode, problem):
    change, message = BAD[problem]
    c = reference["one-image"]
    text = c["text"] + change.get("suffix", "")
    images = c["images"] * 2 if change.get("images") == "two" else change.get("images", c["images"])
    params = change.get("params", GREEDY)
    status, body = http_generate(server.http, mode, text, images, params)
    assert status == 400, body
    assert message in body["error"]
    with pytest.raises(Exception, match=message):
        grpc_generate(server.grpc, mode, text, images, params, stream=True)
    # still serving
    ok = grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True)
    assert ok.text == c["expected"]


def test_swap_entry_model_while_streaming(server, reference):
    import tritonclient.http as httpclient

    admin = httpclient.InferenceServerClient(server.http)
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
