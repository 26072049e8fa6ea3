"""The stub <-> worker channel (trident.workers.channel): both ends in this process, a real Unix socket between
them, PyTriton's request objects and Trident's inline wire; no Triton."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from trident.errors import InvalidRequest, from_wire
from trident.workers import channel
from trident.workers.wire import InlineSerializer


class _Validator:
    def __init__(self, decoupled: bool) -> None:
        self._model_config = SimpleNamespace(decoupled=decoupled)

    def validate_responses(self, requests, responses) -> None:
        assert len(responses) == len(requests)


class _Ends:
    """A stub end and a worker end over one socket, serving ``infer``."""

    def __init__(self, tmp_path, infer, decoupled: bool) -> None:
        from pytriton.proxy.types import Request

        self.Request = Request
        url = f"ipc://{tmp_path}/stage_0_0-server.sock"
        self.serializer = InlineSerializer()
        self.stub = channel.StubChannel(url, lambda: b'{"error": "Unavailable", "message": "worker gone"}')
        self.reader = threading.Thread(target=self.stub.run, daemon=True)
        self.reader.start()
        self.worker = channel.WorkerChannel(url, self.serializer)
        self.handler = channel.ChannelInference(infer, self.worker, _Validator(decoupled))
        self.worker.start()
        self.handler.start()

    def call(self, text: bytes, timeout: float = 10.0) -> list[tuple[int, bytes]]:
        """Send one request; every (flags, payload) it gets, up to the end."""
        got: list[tuple[int, bytes]] = []
        done = threading.Event()

        def on_response(flags: int, payload: bytes) -> None:
            got.append((flags, payload))
            if flags & channel.EOS:
                done.set()

        request = self.Request(data={"text_input": np.array([text], dtype=np.object_)}, parameters={})
        self.stub.send(self.serializer.serialize_requests([request]), on_response)
        assert done.wait(timeout), f"no end of the call after {timeout} s: {got}"
        return got

    def texts(self, payload: bytes) -> list[bytes]:
        return [r.data["text_output"][0] for r in self.serializer.deserialize_responses(payload)]

    def close(self) -> None:
        self.handler.stop()
        self.handler.join(5)
        self.stub.close()
        self.reader.join(5)
        self.stub.finish()


@pytest.fixture
def ends(tmp_path):
    made = []

    def make(infer, decoupled=False):
        e = _Ends(tmp_path, infer, decoupled)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


async def _echo(requests):
    return [{"text_output": np.array([r.data["text_input"][0].upper()], dtype=np.object_)} for r in requests]


def test_a_one_answer_call_comes_back_as_one_message(ends):
    e = ends(_echo)
    got = e.call(b"hello")
    assert [flags for flags, _ in got] == [channel.EOS]  # the response and its end together
    assert e.texts(got[0][1]) == [b"HELLO"]
    many = [e.call(f"call {i}".encode()) for i in range(20)]  # calls on one connection keep their ids
    assert [e.texts(g[0][1]) for g in many] == [[f"CALL {i}".encode()] for i in range(20)]


def test_a_decoupled_call_streams_each_response_then_the_end(ends):
    async def stream(requests):
        for i in range(3):
            yield [{"text_output": np.array([b"t%d" % i], dtype=np.object_)}]

    e = ends(stream, decoupled=True)
    got = e.call(b"x")
    assert [flags for flags, _ in got] == [0, 0, 0, channel.EOS]
    assert [e.texts(p) for _, p in got[:3]] == [[b"t0"], [b"t1"], [b"t2"]]
    assert got[3][1] == b""


def test_an_error_ends_the_call_with_its_envelope_and_the_channel_serves_on(ends):
    async def picky(requests):
        if requests[0].data["text_input"][0] == b"bad":
            raise InvalidRequest("bad input")
        return await _echo(requests)

    e = ends(picky)
    (flags, payload), = e.call(b"bad")
    assert flags == channel.EOS | channel.ERROR
    error = from_wire(payload.decode())
    assert isinstance(error, InvalidRequest) and "bad input" in str(error)
    assert e.texts(e.call(b"good")[0][1]) == [b"GOOD"]


def test_calls_waiting_on_a_worker_that_goes_away_fail_at_once(ends):
    started = threading.Event()

    async def hang(requests):
        started.set()
        import asyncio

        await asyncio.sleep(60)

    e = ends(hang)
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(e.call(b"x", timeout=20)))
    waiter.start()
    assert started.wait(10)
    t0 = time.monotonic()
    e.handler.stop()  # the worker's end closes (as when its process exits)
    waiter.join(20)
    assert time.monotonic() - t0 < 5
    (flags, payload), = result[0]
    assert flags & channel.ERROR and flags & channel.EOS
    assert b"worker" in payload


def test_a_call_with_no_worker_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(channel, "SEND_TIMEOUT_S", 0.2)
    stub = channel.StubChannel(f"ipc://{tmp_path}/lonely_0_0-server.sock", lambda: b"")
    reader = threading.Thread(target=stub.run, daemon=True)
    reader.start()
    try:
        with pytest.raises(channel.NoWorker):
            stub.send(b"payload", lambda flags, payload: None)
    finally:
        stub.close()
        reader.join(5)
        stub.finish()
    assert not (tmp_path / "lonely_0_0-stage.sock").exists()
