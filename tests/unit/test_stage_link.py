"""A stage model's stub side (:class:`trident.core.stagecall.StageLink`) against a real
:class:`~trident.core.stagecall.StageServer`: both in this process, a real Unix socket between them, Trident's stage
messages (:data:`trident.core.protocol.StageMessage`); no Triton."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from trident.core.errors import InvalidRequest
from trident.core.protocol import WORKER_FILE, Call, Failure, Reply, error_of
from trident.core.stagecall import NoWorker, StageLink, StageServer
from trident.core.stagecall.frames import ends


class _Ends:
    """A link (the stub's end) and a stage server serving ``infer``, found through a worker file."""

    def __init__(self, tmp_path, infer) -> None:
        self.server = StageServer(infer, lambda message: None, "127.0.0.1")
        self.server.start()
        self.file = tmp_path / WORKER_FILE
        self.file.write_text(json.dumps(self.server.worker_file(123, "stage")))
        self.link = StageLink("stage", self.file)

    def call(self, text: bytes, timeout: float = 10.0) -> list:
        """Send one call; every message it gets, up to the end."""
        got: list = []
        done = threading.Event()

        def on_message(message) -> None:
            got.append(message)
            if ends(message):
                done.set()

        self.link.send(Call(0, {"text_input": np.array([text], dtype=np.object_)}), on_message)
        assert done.wait(timeout), f"no end of the call after {timeout} s: {got}"
        return got

    @staticmethod
    def text(message) -> bytes:
        return message.outputs["text_output"][0]

    def close(self) -> None:
        self.link.close()
        self.server.stop(drain_s=1)


@pytest.fixture
def ends_(tmp_path):
    made = []

    def make(infer):
        e = _Ends(tmp_path, infer)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


async def _echo(call):
    return {"text_output": np.array([call.inputs["text_input"][0].upper()], dtype=np.object_)}


def test_a_one_answer_call_comes_back_as_one_message(ends_):
    e = ends_(_echo)
    got = e.call(b"hello")
    assert [type(m) for m in got] == [Reply] and got[0].end  # the response and its end together
    assert e.text(got[0]) == b"HELLO"
    many = [e.call(f"call {i}".encode()) for i in range(20)]  # calls on one connection keep their ids
    assert [e.text(g[0]) for g in many] == [f"CALL {i}".encode() for i in range(20)]


def test_a_decoupled_call_streams_each_response_then_the_end(ends_):
    async def stream(call):
        for i in range(3):
            yield {"text_output": np.array([b"t%d" % i], dtype=np.object_)}

    e = ends_(stream)
    got = e.call(b"x")
    assert [m.end for m in got] == [False, False, False, True]
    assert [e.text(m) for m in got[:3]] == [b"t0", b"t1", b"t2"]
    assert got[3].outputs == {}


def test_an_error_ends_the_call_with_its_class_and_the_channel_serves_on(ends_):
    async def picky(call):
        if call.inputs["text_input"][0] == b"bad":
            raise InvalidRequest("bad input")
        return await _echo(call)

    e = ends_(picky)
    (message,) = e.call(b"bad")
    assert isinstance(message, Failure) and message.error == "InvalidRequest"
    error = error_of(message)
    assert isinstance(error, InvalidRequest) and "bad input" in str(error)
    assert e.text(e.call(b"good")[0]) == b"GOOD"


def test_calls_waiting_on_a_worker_that_goes_away_fail_at_once(ends_):
    started = threading.Event()

    async def hang(call):
        started.set()
        import asyncio

        await asyncio.sleep(60)

    e = ends_(hang)
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(e.call(b"x", timeout=20)))
    waiter.start()
    assert started.wait(10)
    t0 = time.monotonic()
    e.server.stop(drain_s=0)  # the worker's end closes (as when its process exits)
    waiter.join(20)
    assert time.monotonic() - t0 < 5
    (message,) = result[0]
    assert isinstance(message, Failure) and message.error in ("WorkerLost", "Unavailable")
    assert "worker" in message.message


def test_a_call_with_no_worker_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(StageLink, "SEND_TIMEOUT_S", 0.2)
    link = StageLink("lonely", tmp_path / WORKER_FILE)  # no worker file: no worker
    try:
        with pytest.raises(NoWorker):
            link.send(Call(0, {}), lambda message: None)
    finally:
        link.close()
