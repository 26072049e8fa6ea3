"""The bad-input corpus (issue 13): one list of hostile or broken requests, over the entry models (gRPC and
HTTP), the stage models called directly (forged, truncated, replayed and mis-typed records, wrong tensors)
and the OpenAI API. Each must get the right 4xx with a message naming the problem, and afterwards a good
request must still return exactly transformers' text.

The server (the LLaVA server of test_serving.py and test_openai.py: :func:`support.shared_llava_server`) runs with small image and body
limits (4 images of at most 4000000 pixels and 2 MiB, an 8 MiB body that must arrive within 2 s), so the limits
are checked as configured, not only as defaulted.

Statuses are what each protocol can carry: HTTP status codes for Triton's HTTP endpoints and the OpenAI API;
for a gRPC ``infer`` the status code's HTTP equivalent; for a gRPC stream (the entry models are decoupled and
Triton sends a stream's error as a message only) the status of the Trident error class the message names.
"""

from __future__ import annotations

import functools
import http.client
import io
import json
import select
import socket
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import requests

from support import (
    b64, build_reference, credential, drain_kv, grpc_generate, http_generate, make_image, png_bytes, shared_llava_server,
    strings,
)
from support.server import SHARED_LLAVA_NAME
from trident.core import auth, errors
from trident.core.protocol import parse_instance

pytestmark = pytest.mark.slow

MiB = 1 << 20
GREEDY = {"max_tokens": 6, "temperature": 0}
NAME = SHARED_LLAVA_NAME
GRPC_TO_HTTP = {"StatusCode.INVALID_ARGUMENT": 400, "StatusCode.NOT_FOUND": 404, "StatusCode.PERMISSION_DENIED": 403,
                "StatusCode.UNAVAILABLE": 503, "StatusCode.INTERNAL": 500, "StatusCode.RESOURCE_EXHAUSTED": 429}


@pytest.fixture(scope="module")
def server(demo_models, tmp_path_factory, shared_servers):
    """The LLaVA server this module shares with test_serving.py, test_openai.py and test_trust.py (its limits: :func:`support.shared_llava_server`)."""
    return shared_llava_server(shared_servers, demo_models["llava"], tmp_path_factory)


@pytest.fixture(scope="module")
def ref(server):
    return build_reference(server.model_path, {"one-image": [(224, 224, 1)]}, GREEDY["max_tokens"])["one-image"]


@dataclass
class Got:
    wire: int | None  # the status the protocol carried (None: a gRPC stream's error has none)
    message: str

    @property
    def status(self) -> int | None:
        """The status of the Trident error class the message names, else the protocol's."""
        named = errors.from_message(self.message)
        return named.http_status if named is not None else self.wire


# -- ways in ---------------------------------------------------------------------------------------------
def _grpc_tensors(inputs: dict) -> list:
    import tritonclient.grpc as grpcclient

    from support.clients import _grpc_inputs

    return _grpc_inputs(grpcclient, inputs)


def _proof(model: str, proof) -> dict | None:
    """The parameters a call of ``model`` carries: a stage model's, the stage credential (``proof``: True, the
    deployment's own; a string, that value; False, none), an entry model's, none."""
    if parse_instance(model) is None or proof is False:
        return None
    return credential() if proof is True else {auth.CREDENTIAL: proof}


def stream(server, model: str, inputs: dict, proof=True) -> Got:
    """A decoupled model (an entry model, the decode stage) over a gRPC stream, to its end or first error."""
    import queue

    import tritonclient.grpc as grpcclient

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(model, _grpc_tensors(inputs), enable_empty_final_response=True,
                                  parameters=_proof(model, proof))
        while True:
            result, error = q.get(timeout=60)
            if error is not None:
                return Got(None, error.message())
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return Got(200, "served")
    finally:
        client.stop_stream()
        client.close()


def entry_grpc(server, ref, text=None, images=None, params=GREEDY, model="e_p_d") -> Got:
    text = ref["text"] if text is None else text
    images = ref["images"] if images is None else images
    inputs = {"text_input": strings(text)}
    if images:
        inputs["image"] = strings(*images)
    if params is not None:
        inputs["sampling_parameters"] = strings(params if isinstance(params, str) else json.dumps(params))
    inputs["stream"] = (np.array([True]), "BOOL")
    return stream(server, model, inputs)


def entry_http(server, ref, text=None, images=None, params=GREEDY, model="e_p_d") -> Got:
    status, body = http_generate(server.http, model, ref["text"] if text is None else text,
                                 ref["images"] if images is None else images, params, timeout=60)
    return Got(status, body.get("error", "served"))


def infer_grpc(server, model: str, inputs: dict, proof=True) -> Got:
    """A stage model (not decoupled) called with ``infer``, as the deployment's own callers do (``proof``: see
    :func:`_proof`)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        result = client.infer(model, _grpc_tensors(inputs), client_timeout=60, parameters=_proof(model, proof))
    except Exception as e:  # noqa: BLE001 - the error is what the case checks
        return Got(GRPC_TO_HTTP.get(str(e.status())), e.message())
    finally:
        client.close()
    kv = result.as_numpy("kv_meta")
    if kv is not None:  # a prefill that was served: decode its KV so that nothing waits for the lease
        drain_kv(server.grpc, kv.reshape(-1)[0])
    return Got(200, "served")


def infer_http(server, model: str, body: dict, proof=True) -> Got:
    if _proof(model, proof):
        body = {**body, "parameters": _proof(model, proof)}
    r = requests.post(f"http://{server.http}/v2/models/{model}/infer", json=body, timeout=60)
    return Got(r.status_code, r.json().get("error", "served"))


def decode_stream(server, kv: bytes) -> Got:
    return stream(server, "decode", {"kv_meta": strings(kv), "sampling_parameters": strings(json.dumps(GREEDY))})


def openai(server, body: dict | None = None, raw: bytes | None = None, path: str = "/chat/completions") -> Got:
    data = raw if raw is not None else json.dumps(body).encode()
    r = requests.post(f"{server.openai_url}{path}", data=data, headers={"content-type": "application/json"}, timeout=60)
    try:
        return Got(r.status_code, r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return Got(r.status_code, r.text)


def chat(content, **extra) -> dict:
    return {"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": content}], **extra}


def image_part(url: str) -> list:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]


def openai_declared_too_big(server) -> Got:
    """Headers that declare a 9 MiB body; none of it is sent: the answer must come at once."""
    conn = http.client.HTTPConnection(server.openai_host, server.openai_port, timeout=10)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(9 * MiB))
    conn.endheaders()
    r = conn.getresponse()
    return Got(r.status, json.loads(r.read())["error"]["message"])


def _answer(s: socket.socket) -> Got:
    """The HTTP answer on ``s`` (its status and the start of its body); the socket is closed."""
    answer = b""
    try:
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < 10:
            part = s.recv(65536)
            if not part:
                break
            answer += part
    finally:
        s.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return Got(int(head.split()[1]), body.decode(errors="replace"))


def openai_slow_body(server) -> Got:
    """A body that trickles in, a byte every half second: answered 408 at the deadline (2 s here), not held open."""
    s = socket.create_connection((server.openai_host, server.openai_port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 8 and not select.select([s], [], [], 0.5)[0]:
        s.sendall(b" ")
    got = _answer(s)
    assert time.monotonic() - t0 < 5, "the slow body was held past its deadline"
    return got


def openai_slow_headers(server) -> Got:
    """Headers that trickle in, a byte every half second: answered 408 at the deadline (2 s here), not held open."""
    s = socket.create_connection((server.openai_host, server.openai_port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 8 and not select.select([s], [], [], 0.5)[0]:
        s.sendall(b"a")
    got = _answer(s)
    assert 1.5 < time.monotonic() - t0 < 5, "the slow headers were not held to their deadline"
    return got


def openai_chunked_too_big(server) -> Got:
    """A chunked body with no declared size that goes on past the limit."""
    s = socket.create_connection((server.openai_host, server.openai_port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (MiB, b" " * MiB)
    for _ in range(16):
        s.sendall(chunk)
        if select.select([s], [], [], 0.05)[0]:
            break
    return _answer(s)


# -- what the cases send -----------------------------------------------------------------------------------
def _png(w: int, h: int, seed: int = 3) -> str:
    return b64(png_bytes(make_image(w, h, seed)))


@functools.cache
def _bomb() -> str:
    """A 20000x20000 PNG of one colour: ~0.4 MB on the wire, 1.2 GB once decoded."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (20000, 20000)).save(buf, format="PNG", optimize=True)
    return b64(buf.getvalue())


@functools.cache
def _flat(w: int, h: int, grey: int = 0) -> str:
    """A PNG of one colour: small on the wire, ``w * h`` pixels once decoded."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (grey,) * 3).save(buf, format="PNG", optimize=True)
    return b64(buf.getvalue())


@functools.cache
def _big_png() -> str:
    """More than media_limits.max_bytes (2 MiB) once base64-decoded (noise does not compress)."""
    from PIL import Image

    noise = np.random.default_rng(0).integers(0, 256, (1000, 1000, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="PNG")
    assert len(buf.getvalue()) > 2 * MiB
    return b64(buf.getvalue())


def _encode_record(server) -> bytes:
    from support import stage_output

    return stage_output(server.grpc, "encode", {"image": strings(_png(224, 224, 9))})


def _kv_record(server) -> bytes:
    from support import stage_output

    return stage_output(server.grpc, "prefill", {"text_input": strings("USER: hi ASSISTANT:")})


def _resigned(data: bytes, **changes) -> bytes:
    import msgspec

    from trident.core.protocol import decode_record

    return msgspec.structs.replace(decode_record(data), **changes).encode()


def _other_deployment(data: bytes) -> bytes:
    import os

    from trident.core import auth
    from trident.core.protocol import decode_record

    record = decode_record(data)
    saved = os.environ[auth.ENV]
    os.environ[auth.ENV] = "another deployment's secret"
    try:
        return record.encode()
    finally:
        os.environ[auth.ENV] = saved


def _replayed(server) -> Got:
    record = _encode_record(server)
    prompt = "USER: <image>\nWhat is it? ASSISTANT:"
    first = infer_grpc(server, "prefill", {"text_input": strings(prompt), "embedding_meta": strings(record)})
    assert first.status == 200, first
    return infer_grpc(server, "prefill", {"text_input": strings(prompt), "embedding_meta": strings(record)})


def _outside_pool(server) -> Got:
    import msgspec

    from trident.core.protocol import decode_record

    record = decode_record(_encode_record(server))
    t = record.transfer
    moved = msgspec.structs.replace(t, regions=tuple((addr + t.pool[1], n) for addr, n in t.regions))
    return _prefill_with(server, msgspec.structs.replace(record, transfer=moved).encode())


def _prefill_inputs() -> dict:
    return {"text_input": strings("USER: What is it? ASSISTANT:"), "sampling_parameters": strings(json.dumps(GREEDY))}


def _prefill_with(server, record: bytes) -> Got:
    return infer_grpc(server, "prefill", {"text_input": strings("USER: <image>\nWhat is it? ASSISTANT:"),
                                          "embedding_meta": strings(record)})


def _flipped(data: bytes) -> bytes:
    b = bytearray(data)
    b[40] ^= 1
    return bytes(b)


@dataclass(frozen=True)
class Bad:
    name: str
    send: Callable  # (server, ref) -> Got
    status: int
    says: str


IMAGE_PROMPT = "USER: <image>\nWhat is it? ASSISTANT:"
CORPUS = [
    # the entry models over gRPC (streams)
    Bad("grpc: empty text", lambda s, r: entry_grpc(s, r, text="", images=[]), 400, "text_input is empty"),
    Bad("grpc: text not UTF-8", lambda s, r: entry_grpc(s, r, text=b"USER: \xff\xfe hi", images=[]), 400, "not valid UTF-8"),
    Bad("grpc: huge text", lambda s, r: entry_grpc(s, r, text="USER: " + "word " * 5000, images=[]), 400, "context window"),
    Bad("grpc: text past any prompt's bytes", lambda s, r: entry_grpc(s, r, text="USER: " + "word " * 400_000, images=[]),
        400, "bytes: more than any prompt that fits the model's context window can have"),
    Bad("grpc: invalid base64", lambda s, r: entry_grpc(s, r, images=["@@@ not base64 @@@"]), 400, "not valid base64"),
    Bad("grpc: not an image", lambda s, r: entry_grpc(s, r, images=[b64(b"plain text, no image")]), 400,
        "could not be decoded as an image"),
    Bad("grpc: empty image", lambda s, r: entry_grpc(s, r, images=[""]), 400, "image 0 is empty"),
    Bad("grpc: 20000x20000 bomb", lambda s, r: entry_grpc(s, r, images=[_bomb()]), 400,
        "20000x20000 pixels, more than 4000000 (media_limits.max_pixels)"),
    Bad("grpc: images over media_limits.max_request_pixels",  # (6,000,000 here: the second 2000x2000 goes past it)
        lambda s, r: entry_grpc(s, r, text=IMAGE_PROMPT.replace("<image>", "<image>" * 2),
                                images=[_flat(2000, 2000, 0), _flat(2000, 2000, 1)]), 400,
        "image 1 (2000x2000) would bring the request's decoded media to 8000000 pixels, more than 6000000 "
        "(media_limits.max_request_pixels)"),
    Bad("grpc: image over media_limits.max_bytes", lambda s, r: entry_grpc(s, r, images=[_big_png()]), 400,
        "larger than 2097152 bytes (media_limits.max_bytes)"),
    Bad("grpc: too many images", lambda s, r: entry_grpc(s, r, text=IMAGE_PROMPT.replace("<image>", "<image>" * 5),
                                                         images=[_png(32, 32)] * 5), 400,
        "carries 5 images; at most 4 are accepted (media_limits.max_images)"),
    Bad("grpc: placeholder count mismatch", lambda s, r: entry_grpc(s, r, images=r["images"] * 2), 400,
        "1 image placeholder(s) '<image>' but the request carries 2 image(s)"),
    Bad("grpc: sampling not JSON", lambda s, r: entry_grpc(s, r, params="{max_tokens: 3"), 400,
        "sampling_parameters is not valid JSON"),
    Bad("grpc: sampling not an object", lambda s, r: entry_grpc(s, r, params="[1, 2]"), 400,
        "sampling_parameters must be a JSON object"),
    Bad("grpc: NaN temperature", lambda s, r: entry_grpc(s, r, params='{"temperature": NaN}'), 400, "temperature"),
    Bad("grpc: negative max_tokens", lambda s, r: entry_grpc(s, r, params={"max_tokens": -4}), 400, "max_tokens"),
    Bad("grpc: top_p above 1", lambda s, r: entry_grpc(s, r, params={"top_p": 2}), 400, "top_p"),
    Bad("grpc: unknown sampling field", lambda s, r: entry_grpc(s, r, params={"max_tokenz": 3}), 400, "max_tokenz"),
    Bad("grpc: unknown model", lambda s, r: infer_grpc(s, "no_such_mode", {"text_input": strings("hi")}), 404,
        "unknown model"),
    # the entry models over HTTP (Triton's generate endpoint answers 400 for every error)
    Bad("http: unknown model", lambda s, r: entry_http(s, r, model="no_such_mode"), 404, "unknown model"),
    Bad("http: invalid base64", lambda s, r: entry_http(s, r, images=["%%%"]), 400, "not valid base64"),
    Bad("http: sampling not JSON", lambda s, r: entry_http(s, r, params="{"), 400, "sampling_parameters is not valid JSON"),
    Bad("http: text not UTF-8", lambda s, r: _http_raw(s, "e_p_d", b'{"text_input": "USER: \xff hi"}'), 400, "UTF-8"),
    # the stage models called directly: closed to callers without the deployment's stage credential
    Bad("stage: no credential, prefill over gRPC", lambda s, r: infer_grpc(s, "prefill", _prefill_inputs(), proof=False),
        401, "carries no valid trident_stage_key"),
    Bad("stage: wrong credential, encode over gRPC",
        lambda s, r: infer_grpc(s, "encode", {"image": strings(_png(32, 32))}, proof="0" * 64), 401, "Unauthenticated"),
    Bad("stage: no credential, encode over HTTP", lambda s, r: infer_http(s, "encode", {"inputs": [
        {"name": "image", "shape": [1], "datatype": "BYTES", "data": [_png(32, 32)]}]}, proof=False), 401,
        "answers only the deployment's own callers"),
    Bad("stage: no credential, decode stream", lambda s, r: stream(s, "decode", {"kv_meta": strings(b"x"),
        "text_input": strings("hi")}, proof=False), 401, "Unauthenticated"),
    Bad("stage: no credential, prefill_decode stream", lambda s, r: stream(s, "prefill_decode", {
        "text_input": strings("hi")}, proof=False), 401, "Unauthenticated"),
    Bad("stage: wrong dtype", lambda s, r: infer_grpc(s, "prefill", {"text_input": (np.array([1], np.int32), "INT32")}),
        400, "data-type is 'INT32', but model 'prefill' expects 'BYTES'"),
    Bad("stage: wrong shape", lambda s, r: infer_http(s, "encode", {"inputs": [
        {"name": "image", "shape": [1, 2], "datatype": "BYTES", "data": ["a", "b"]}]}), 400, "shape"),
    Bad("stage: prefill, empty prompt", lambda s, r: infer_grpc(s, "prefill", {"text_input": strings("")}), 400,
        "the prompt is empty"),
    Bad("stage: missing input", lambda s, r: infer_http(s, "prefill", {"inputs": []}), 400, "text_input"),
    Bad("stage: encode, not an image", lambda s, r: infer_grpc(s, "encode", {"image": strings(b64(b"no image"))}), 400,
        "could not be decoded as an image"),
    Bad("stage: encode, too many images", lambda s, r: infer_grpc(s, "encode", {"image": strings(*[_png(32, 32)] * 5)}),
        400, "at most 4 are accepted"),
    Bad("stage: garbage record", lambda s, r: _prefill_with(s, b"\x93not a record"), 400, "not a sealed record"),
    Bad("stage: forged record (a byte changed)", lambda s, r: _prefill_with(s, _flipped(_encode_record(s))), 403,
        "not sealed with this deployment's key"),
    Bad("stage: another deployment's key", lambda s, r: _prefill_with(s, _other_deployment(_encode_record(s))), 403,
        "not sealed with this deployment's key"),
    Bad("stage: truncated record", lambda s, r: _prefill_with(s, _encode_record(s)[:-7]), 403, "not sealed with this deployment's key"),
    Bad("stage: replayed record", lambda s, r: _replayed(s), 403, "already used"),
    Bad("stage: regions outside the pool", lambda s, r: _outside_pool(s), 403, "outside the producer's pool"),
    Bad("stage: kv record given as embeddings", lambda s, r: _prefill_with(s, _kv_record(s)), 400, "MalformedRecord"),
    Bad("stage: embeddings record given to decode", lambda s, r: decode_stream(s, _encode_record(s)), 400,
        "MalformedRecord"),
    Bad("stage: kv first_token out of vocabulary", lambda s, r: decode_stream(s, _resigned(_kv_record(s), first_token=10**6)),
        400, "outside the vocabulary"),
    Bad("stage: kv record, forged", lambda s, r: decode_stream(s, _flipped(_kv_record(s))), 403, "not sealed with this deployment's key"),
    # the OpenAI API
    Bad("openai: unknown model", lambda s, r: openai(s, {**chat("hi"), "model": "gpt-17"}), 404, "'gpt-17' does not exist"),
    Bad("openai: unknown mode", lambda s, r: openai(s, {**chat("hi"), "model": f"{NAME}:xyz"}), 404, "does not exist"),
    Bad("openai: not JSON", lambda s, r: openai(s, raw=b"{\"model\": "), 400, "JSON"),
    Bad("openai: no messages", lambda s, r: openai(s, {"model": NAME, "messages": []}), 400, "messages"),
    Bad("openai: lone surrogate", lambda s, r: openai(s, raw=b'{"model": "demo", "messages": [{"role": "user", '
                                                             b'"content": "hi \\ud800"}]}'), 400, "not valid UTF-8"),
    Bad("openai: NaN temperature", lambda s, r: openai(s, raw=b'{"model": "demo", "temperature": NaN, "messages": '
                                                              b'[{"role": "user", "content": "hi"}]}'), 400, "temperature"),
    Bad("openai: negative max_tokens", lambda s, r: openai(s, chat("hi", max_tokens=-1)), 400, "max_tokens"),
    Bad("openai: n=17", lambda s, r: openai(s, chat("hi", n=17)), 400, "n: Input should be less than or equal to 16"),
    Bad("openai: best_of=2", lambda s, r: openai(s, chat("hi", best_of=2)), 400, "best_of"),
    Bad("openai: invalid base64 data URL", lambda s, r: openai(s, chat(image_part("data:image/png;base64,@@@"))), 400,
        "not valid base64"),
    Bad("openai: data URL of no image", lambda s, r: openai(s, chat(image_part("data:image/png;base64," + b64(b"text")))),
        400, "could not be decoded as an image"),
    Bad("openai: bomb data URL", lambda s, r: openai(s, chat(image_part("data:image/png;base64," + _bomb()))), 400,
        "more than 4000000"),
    Bad("openai: too many images", lambda s, r: openai(s, chat(image_part("data:image/png;base64," + _png(32, 32)) * 5)),
        400, "carries 5 images; at most 4 are accepted"),
    Bad("openai: loopback URL", lambda s, r: openai(s, chat(image_part("http://127.0.0.1:8080/a.png"))), 400,
        "non-public address 127.0.0.1"),
    Bad("openai: URL port not allowed", lambda s, r: openai(s, chat(image_part("http://127.0.0.1:1/a.png"))), 400,
        "names port 1; media URLs may name ports 80, 443, 8080, 8443 (frontend.media.allowed_ports)"),
    Bad("openai: site-local IPv6 URL", lambda s, r: openai(s, chat(image_part("http://[fec0::1]/a.png"))), 400,
        "non-public address fec0::1"),
    Bad("openai: private URL", lambda s, r: openai(s, chat(image_part("http://10.1.2.3/a.png"))), 400,
        "non-public address 10.1.2.3"),
    Bad("openai: IPv6 loopback URL", lambda s, r: openai(s, chat(image_part("http://[::1]:443/a.png"))), 400,
        "non-public address ::1"),
    Bad("openai: IPv4-mapped URL", lambda s, r: openai(s, chat(image_part("http://[::ffff:127.0.0.1]/a.png"))), 400,
        "non-public address"),
    Bad("openai: decimal-IP URL", lambda s, r: openai(s, chat(image_part("http://2130706433/a.png"))), 400,
        "non-public address 127.0.0.1"),
    Bad("openai: file URL", lambda s, r: openai(s, chat(image_part("file:///etc/passwd"))), 400, "/etc/passwd"),
    Bad("openai: ftp URL", lambda s, r: openai(s, chat(image_part("ftp://example.com/a.png"))), 400,
        "scheme 'ftp' is not supported"),
    Bad("openai: body declared over frontend.max_body_bytes", lambda s, r: openai_declared_too_big(s), 413,
        "larger than 8388608 bytes"),
    Bad("openai: chunked body over frontend.max_body_bytes", lambda s, r: openai_chunked_too_big(s), 413,
        "larger than 8388608 bytes"),
    Bad("openai: body slower than frontend.body_timeout_s", lambda s, r: openai_slow_body(s), 408,
        "did not arrive within 2 s"),
    Bad("openai: headers slower than frontend.header_timeout_s", lambda s, r: openai_slow_headers(s), 408,
        "request headers did not arrive within 2 s"),
]


def _http_raw(server, model: str, body: bytes) -> Got:
    r = requests.post(f"http://{server.http}/v2/models/{model}/generate", data=body, timeout=60)
    return Got(r.status_code, r.json().get("error", "served"))


def test_the_corpus_has_forty_cases_over_every_way_in():
    assert len(CORPUS) >= 40
    assert len({b.name for b in CORPUS}) == len(CORPUS)
    assert {b.name.split(":")[0] for b in CORPUS} == {"grpc", "http", "stage", "openai"}


@pytest.mark.parametrize("bad", CORPUS, ids=lambda b: b.name)
def test_bad_input_gets_its_4xx_and_the_server_still_answers_right(server, ref, bad):
    got = bad.send(server, ref)
    assert got.status == bad.status and bad.says in got.message, (got, got.status)
    assert got.wire is None or 400 <= got.wire < 500, got  # a client error on the wire too
    after = grpc_generate(server.grpc, "e_p_d", ref["text"], ref["images"], GREEDY, stream=True)
    assert after.text == ref["expected"]
