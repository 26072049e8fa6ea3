"""Every error class, raised in a real stage worker, reaches the Triton client and the OpenAI client with its
status. A server whose workers load the tests' fault wrapper (`tests/support/faults`) raises the class a prompt's
``[[trident-fault:<Class>@<stage>]]`` marker names; the real conditions behind the transfer errors (a
garbage record, a full pool, a dead producer, an expired lease) are provoked too.

What each client can see is bounded by Triton: the entry models are decoupled, so a gRPC stream carries
only the error message (which names the class) and Triton 2.51's HTTP ``generate`` answers 400 for every
error; the stage models that are not decoupled answer ``infer`` with the class's own Triton status.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import requests

from support import Server, credential, grpc_generate, http_generate, strings
from trident.core import errors
from trident.core.errors import (
    InvalidRequest, LeaseExpired, MalformedRecord, PeerUnavailable, PoolExhausted, TransferTimeout, TridentError,
)

pytestmark = pytest.mark.slow

CLASSES = [InvalidRequest, MalformedRecord, PeerUnavailable, PoolExhausted, TransferTimeout, LeaseExpired, TridentError]
GRPC_STATUS = {400: "StatusCode.INVALID_ARGUMENT", 503: "StatusCode.UNAVAILABLE", 504: "StatusCode.UNAVAILABLE",
               500: "StatusCode.INTERNAL"}
TRITON_HTTP = {400: 400, 503: 503, 504: 503, 500: 500}  # Triton has no timeout status: 504s answer 503
SEND_POOL_MIB = 2  # small enough for a long text prompt's KV cache to exhaust it (~24 KiB per token)
NAME = "demo"
MAX_INFLIGHT = 2  # requests per stage worker
STAGE_TIMEOUT_S = 5  # scheduling.stage_timeout_s


@pytest.fixture(scope="module")
def server(demo_models, tmp_path_factory):
    srv = Server(demo_models["llava"], tmp_path_factory.mktemp("errors") / "ws",
                 # every stage in its own worker, also for short prompts: faults are injected per stage
                 extra=["--served-model-name", NAME],
                 faults=True, config={"transfer": {"send_pool_bytes": SEND_POOL_MIB << 20},
                                      "scheduling": {"local_prefill_tokens": 0, "stage_timeout_s": STAGE_TIMEOUT_S},
                                      "max_inflight": MAX_INFLIGHT})
    try:
        srv.wait_ready()
        yield srv
    finally:
        assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)


def _prompt(text: str) -> str:
    return f"USER: {text} ASSISTANT:"


def _still_serving(server, client) -> None:
    ok = grpc_generate(server.grpc, "e_p_d", _prompt("hello"), [], {"max_tokens": 3, "temperature": 0}, stream=True)
    assert ok.num_output_tokens == 3
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.usage.completion_tokens == 2


def _openai_status(client, model: str, content: str, stream: bool):
    """The error of a request that fails: an ``APIStatusError`` when it failed before the response began, an
    ``APIError`` (an SSE error event) when it failed after."""
    import openai

    with pytest.raises(openai.APIError) as info:
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                           max_tokens=4, stream=stream)
        for _ in r if stream else ():
            pass
    return info.value


def _infer_prefill(server, text: str, embedding_meta: bytes | None = None):
    """The prefill stage (not decoupled) called directly over HTTP and gRPC: (HTTP status, body, gRPC status)."""
    import tritonclient.grpc as grpcclient

    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [text]}]}
    grpc_inputs = {"text_input": strings(text)}
    if embedding_meta is not None:
        # binary data in the JSON body is awkward: send it over gRPC only
        grpc_inputs["embedding_meta"] = strings(embedding_meta)
        body = None
    body = {**body, "parameters": credential()} if body else None  # as the deployment's own callers
    http = requests.post(f"http://{server.http}/v2/models/prefill/infer", json=body, timeout=60) if body else None
    client = grpcclient.InferenceServerClient(server.grpc)
    tensors = []
    for name, (arr, dtype) in grpc_inputs.items():
        t = grpcclient.InferInput(name, arr.shape, dtype)
        t.set_data_from_numpy(arr)
        tensors.append(t)
    with pytest.raises(Exception) as info:
        client.infer("prefill", tensors, parameters=credential())
    return http, info.value


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_error_class_status_through_triton_and_openai(server, client, cls):
    import openai

    name = cls.__name__
    # Triton, decoupled path (the decode stage fails mid-chain): the gRPC stream's message names the class.
    with pytest.raises(Exception) as info:
        grpc_generate(server.grpc, "e_p_d", _prompt(f"hi [[trident-fault:{name}@decode]]"), [], {"max_tokens": 4}, True)
    found = errors.from_message(str(info.value))
    assert type(found) is cls and found.message == f"injected {name} in the decode stage"
    status, body = http_generate(server.http, "ep_d", _prompt(f"hi [[trident-fault:{name}@decode]]"), [], None)
    assert status == 400 and f"{name}: injected {name}" in body["error"]  # Triton's generate: 400 for all
    # Triton, a stage model that is not decoupled: its own status over HTTP and gRPC.
    http, grpc_error = _infer_prefill(server, _prompt(f"hi [[trident-fault:{name}@prefill]]"))
    assert http.status_code == TRITON_HTTP[cls.http_status], http.text
    assert http.json()["error"] == f"{name}: injected {name} in the prefill stage"
    assert str(grpc_error.status()) == GRPC_STATUS[cls.http_status]
    # OpenAI, both in the prefill (before any token) and in the decode stage, streamed or not.
    for stage, stream in (("prefill", False), ("decode", True), ("prefill", True)):
        early = _early_texts(server)
        error = _openai_status(client, f"{NAME}:e_p_d", f"hi [[trident-fault:{name}@{stage}]]", stream)
        assert error.body["message"] == f"injected {name} in the {stage} stage"
        if stage == "decode" and _early_texts(server) > early:
            # the first text left with the prefill's kv_meta: the decode's error follows it in the stream (an
            # SSE error event with the class's status, as for a failure after some tokens)
            assert not isinstance(error, openai.APIStatusError) and error.body["code"] == cls.http_status
            continue
        assert error.status_code == cls.http_status, (stage, stream, error.body)
        retry_after = error.response.headers.get("retry-after")
        assert retry_after == (str(cls.retry_after_s) if cls.retry_after_s is not None else None)
    _still_serving(server, client)


def _early_texts(server) -> float:
    """Requests whose first text an entry model sent from the prefill's kv_meta, before the decode call."""
    import time

    time.sleep(0.3)  # the BLS's metric updates go out after the request's first response
    return sum(v for (name, labels), v in server.metrics().items()
               if name == "trident_decisions_total" and dict(labels).get("decision") == "first_text_from_prefill")


def test_garbage_records_are_400(server, client):
    from trident.core.auth import sign

    http, grpc_error = _infer_prefill(server, _prompt("<image>\nhi"), embedding_meta=b"\x93not a record")
    assert str(grpc_error.status()) == "StatusCode.INVALID_ARGUMENT"
    assert "MalformedRecord: transfer record of 13 bytes is not a sealed record" in grpc_error.message()
    # signed (as by a worker of this deployment with a bug): refused as what it is
    http, grpc_error = _infer_prefill(server, _prompt("<image>\nhi"), embedding_meta=sign(b"\x93not a record"))
    assert str(grpc_error.status()) == "StatusCode.INVALID_ARGUMENT"
    assert "MalformedRecord: transfer record is not valid msgpack" in grpc_error.message()
    with pytest.raises(Exception, match="MalformedRecord: "):
        _drain(server, sign(b"\x92\xa7hf_kv/2\x07"))
    _still_serving(server, client)


def _drain(server, kv: bytes) -> None:
    from support import drain_kv

    drain_kv(server.grpc, kv)


def test_pool_exhausted_by_a_real_kv_cache(server, client):
    long_text = "Tell me everything about the sea and the mountains. " * 20  # ~250 tokens: > 2 MiB of KV
    with pytest.raises(Exception, match="PoolExhausted: send pool cannot fit"):
        grpc_generate(server.grpc, "ep_d", _prompt(long_text), [], {"max_tokens": 4}, True)
    error = _openai_status(client, f"{NAME}:e_p_d", long_text, stream=False)
    assert error.status_code == 503 and error.response.headers["retry-after"] == "1"
    assert "send pool cannot fit" in error.body["message"]
    _still_serving(server, client)


def _producer(conn, lease_s: float) -> None:
    """Publishes one image's worth of embeddings, sends the record, and waits to be told to exit."""
    import torch

    from trident.core.config import MiB, TransferConfig
    from trident.core.protocol import EmbeddingsRecord
    from trident.core.transfer import TransferEndpoint

    ep = TransferEndpoint(TransferConfig(send_pool_bytes=MiB, recv_pool_bytes=MiB, lease_s=lease_s))
    transfer = ep.publish([torch.zeros(196, 512)])
    conn.send(EmbeddingsRecord(transfer=transfer, token_counts=[196], image_ids=["x" * 32]).encode())
    conn.recv()
    ep.close()


def _record_from_a_producer(lease_s: float, keep_alive: bool):
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child, lease_s), daemon=True)
    proc.start()
    assert conn.poll(60)
    record = conn.recv()
    if not keep_alive:
        proc.kill()
        proc.join()
    return record, proc, conn


def test_dead_producer_is_503(server, client):
    record, _, _ = _record_from_a_producer(lease_s=60, keep_alive=False)
    _, grpc_error = _infer_prefill(server, _prompt("<image>\nWhat is it?"), embedding_meta=record)
    assert str(grpc_error.status()) == "StatusCode.UNAVAILABLE"
    assert "PeerUnavailable: " in grpc_error.message()
    _still_serving(server, client)


def test_expired_lease_is_refused(server, client):
    record, proc, conn = _record_from_a_producer(lease_s=0.2, keep_alive=True)
    try:
        _, grpc_error = _infer_prefill(server, _prompt("<image>\nWhat is it?"), embedding_meta=record)
    finally:
        conn.send("exit")
        proc.join(10)
    assert str(grpc_error.status()) == "StatusCode.UNAVAILABLE"
    assert "LeaseExpired: lease" in grpc_error.message()
    _still_serving(server, client)


# -- signed, single-use, bounded records -----------------------------------------------------------------
IMAGE_PROMPT = _prompt("<image>\nWhat is it?")


def _embedding_meta(server) -> bytes:
    """A real record: the encode stage called directly, as any client can."""
    from support import b64, make_image, png_bytes, stage_output

    return stage_output(server.grpc, "encode", {"image": strings(b64(png_bytes(make_image(224, 224, 7))))})


def _resigned(data: bytes, change) -> bytes:
    """``data`` with ``change`` applied to its decoded record, signed with this deployment's key (as a worker
    with a bug, or an attacker holding the key, would)."""
    from trident.core.protocol import decode_record

    return change(decode_record(data)).encode()


def _read_ok(server, embedding_meta: bytes) -> None:
    """Use a real record: two tokens from the prefill_decode stage (its KV cache stays in that worker)."""
    import json
    import queue

    import tritonclient.grpc as grpcclient

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    tensors = []
    for name, (arr, dtype) in {"text_input": strings(IMAGE_PROMPT), "embedding_meta": strings(embedding_meta),
                               "sampling_parameters": strings(json.dumps({"max_tokens": 2}))}.items():
        t = grpcclient.InferInput(name, arr.shape, dtype)
        t.set_data_from_numpy(arr)
        tensors.append(t)
    try:
        client.async_stream_infer("prefill_decode", tensors, parameters=credential())
        result, error = q.get(timeout=60)
        assert error is None, error.message()
    finally:
        client.stop_stream()
        client.close()


def test_forged_records_are_refused_before_any_read(server, client, monkeypatch):
    import msgspec

    from trident.core import auth
    from trident.core.protocol import decode_record

    good = _embedding_meta(server)
    fetched = server.stats()["prefill"]["fetched"]
    flipped = bytearray(good)
    flipped[40] ^= 0x01  # one byte of the agent metadata or regions changed
    record = decode_record(good)
    monkeypatch.setenv(auth.ENV, "another deployment's secret")
    other_key = record.encode()
    monkeypatch.undo()
    forged = "ForgedRecord: transfer record is not sealed with this deployment's key"
    cases = [
        (bytes(flipped), forged),
        (other_key, forged),
        (good[: -auth.MAC_BYTES], forged),  # without its tag
        (msgspec.msgpack.encode(["embeddings/3", []]) + b"\0" * 40, "MalformedRecord: transfer record of 55 bytes is "
                                                                     "not a sealed record"),  # hand-made msgpack
    ]
    for data, says in cases:
        _, grpc_error = _infer_prefill(server, IMAGE_PROMPT, embedding_meta=data)
        assert str(grpc_error.status()) == "StatusCode.INVALID_ARGUMENT"
        assert says in grpc_error.message()
    assert server.stats()["prefill"]["fetched"] == fetched  # nothing was read
    _read_ok(server, good)  # the real record still works (the peer was not dropped)
    _still_serving(server, client)


def test_a_replayed_record_is_refused(server, client):
    record = _embedding_meta(server)
    _read_ok(server, record)
    with pytest.raises(AssertionError) as info:  # the same consumer again
        _read_ok(server, record)
    assert "ReplayedRecord: record of lease" in str(info.value) and "already used" in str(info.value)
    _still_serving(server, client)


def test_regions_outside_the_producers_pool_are_refused(server, client):
    good = _embedding_meta(server)
    fetched = server.stats()["prefill"]["fetched"]

    def elsewhere(record):  # the same bytes, one pool-length further on: another process's memory
        t = record.transfer
        regions = tuple((addr + t.pool[1], n) for addr, n in t.regions)
        return msgspec_replace(record, transfer=msgspec_replace(t, regions=regions))

    _, grpc_error = _infer_prefill(server, IMAGE_PROMPT, embedding_meta=_resigned(good, elsewhere))
    assert "ForgedRecord: transfer record regions" in grpc_error.message()
    assert "outside the producer's pool" in grpc_error.message()
    assert server.stats()["prefill"]["fetched"] == fetched
    _read_ok(server, good)
    _still_serving(server, client)


def msgspec_replace(struct, **changes):
    import msgspec

    return msgspec.structs.replace(struct, **changes)


@pytest.mark.parametrize("change, message", [
    ({"first_token": 10**6}, "first_token 1000000 is outside the vocabulary"),
    ({"rope_delta": 10**15}, "rope_delta"),
], ids=["first token out of vocabulary", "huge rope_delta"])
def test_a_bad_kv_record_fails_only_its_own_request(server, client, change, message):
    """A decode record that the model cannot continue is refused before it joins the batch, while another
    request streams through the same decode worker, which gets exactly its own text."""
    import threading

    from support import stage_output

    kv = stage_output(server.grpc, "prefill", {"text_input": strings(_prompt("hi"))})  # (small: the pool is too)
    params = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    expected = grpc_generate(server.grpc, "e_p_d", _prompt("Tell me a story."), [], params, stream=True).text
    got: dict = {}
    other = threading.Thread(target=lambda: got.update(
        r=grpc_generate(server.grpc, "e_p_d", _prompt("Tell me a story."), [], params, stream=True)))
    other.start()
    with pytest.raises(Exception) as info:
        from support import drain_kv

        drain_kv(server.grpc, _resigned(kv, lambda r: msgspec_replace(r, **change)))
    other.join(60)
    assert "MalformedRecord: kv record" in str(info.value) and message in str(info.value)
    assert got["r"].text == expected
    _still_serving(server, client)


def test_a_full_stage_refuses_at_once_with_503_and_retry_after(server, client):
    """With max_inflight 2, a third concurrent stream through the decode worker is refused at once (not
    queued), over Triton and over the OpenAI API; the two admitted streams finish with their full output."""
    import threading
    import time

    import openai

    params = {"max_tokens": 160, "temperature": 0, "ignore_eos": True}
    done: list = []
    streams = [threading.Thread(target=lambda: done.append(
        grpc_generate(server.grpc, "e_p_d", _prompt("Tell me a long story."), [], params, stream=True)))
        for _ in range(MAX_INFLIGHT)]
    for t in streams:
        t.start()
    deadline = time.monotonic() + 30
    while server.stats().get("decode", {}).get("decode_active", 0) < MAX_INFLIGHT and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    with pytest.raises(Exception, match=f"Unavailable: the decode stage has {MAX_INFLIGHT} requests in flight"):
        grpc_generate(server.grpc, "e_p_d", _prompt("One more?"), [], {"max_tokens": 4}, stream=True)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=f"{NAME}:e_p_d", messages=[{"role": "user", "content": "And me?"}],
                                       max_tokens=4)
    assert time.monotonic() - t0 < 5
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
    assert "requests in flight, its limit (max_inflight)" in info.value.body["message"]
    for t in streams:
        t.join(120)
    assert [r.num_output_tokens for r in done] == [160] * MAX_INFLIGHT
    from support import wait_drained

    wait_drained(server, {"prefill", "decode"})  # the refused requests' KV caches were freed, not left to expire
    _still_serving(server, client)


def test_a_stage_that_does_not_answer_in_time_is_a_504_naming_it_and_is_told_to_stop(server, client):
    """scheduling.stage_timeout_s (5 s here): a prefill held in its worker (``[[trident-stall@prefill]]``: a minute)
    ends its request at the deadline with StageTimeout naming the instance (over gRPC its message, over the OpenAI
    API 504); the worker is told to stop the call (an Abandon), so its one slot is free at once and the next
    request is served right away."""
    import time

    stalled = _prompt("[[trident-stall@prefill]] hi")
    t0 = time.monotonic()
    with pytest.raises(Exception, match=f"StageTimeout: stage instance prefill did not answer within {STAGE_TIMEOUT_S} s"):
        grpc_generate(server.grpc, "e_p_d", stalled, [], {"max_tokens": 2}, stream=True, timeout=60)
    assert STAGE_TIMEOUT_S - 0.5 < time.monotonic() - t0 < STAGE_TIMEOUT_S + 4
    error = _openai_status(client, f"{NAME}:e_p_d", "[[trident-stall@prefill]] hi", stream=False)
    assert error.status_code == 504 and "(scheduling.stage_timeout_s)" in error.body["message"], error.body
    t0 = time.monotonic()
    _still_serving(server, client)
    assert time.monotonic() - t0 < STAGE_TIMEOUT_S  # (a stall still holding the prefill's slot would time it out)


def test_a_stage_failing_mid_stream_ends_the_stream_with_its_error(server, client):
    """A failure after some tokens reaches the client as the stage's error (Triton 2.51 drops an error response
    that follows others on its way to a BLS caller: the stream used to hang, or end as if complete)."""
    import openai

    params = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    text = _prompt("Tell me a story. [[trident-fault:Unavailable@decode#3]]")
    with pytest.raises(Exception, match="Unavailable: injected Unavailable in the decode stage"):
        grpc_generate(server.grpc, "e_p_d", text, [], params, stream=True)
    stream = client.chat.completions.create(model=f"{NAME}:e_p_d", stream=True, max_tokens=40,
                                            messages=[{"role": "user", "content": text}])
    chunks = []
    with pytest.raises(openai.APIError, match="injected Unavailable in the decode stage"):
        for chunk in stream:
            chunks.append(chunk)
    assert len(chunks) == 3
    from support import wait_drained

    wait_drained(server, {"prefill", "decode"})
    _still_serving(server, client)
