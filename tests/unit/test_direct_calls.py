"""The scheduler's stage calls (:class:`trident.core.stagecall.StageClient`) against a real
:class:`~trident.core.stagecall.StageServer` on real Unix and TCP sockets, in one process: the stage's answer, its error,
an instance with no stage socket, a stopping worker, a worker lost mid-call, control messages, and the limit on
calls at once that keeps the engine's ``calls_at_once``."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from trident.core import auth
from trident.core.errors import InvalidRequest, Unavailable
from trident.core.protocol import Call, encode_message
from trident.core.stagecall import StageClient, StageServer, directory


@pytest.fixture(autouse=True)
def stage_directory(tmp_path, monkeypatch):
    """A stage directory of the test's own (:mod:`trident.core.stagecall.directory`)."""
    monkeypatch.setenv(directory.ENV, str(tmp_path / "stages"))
    (tmp_path / "stages").mkdir()


def _serve(tmp_path: Path, instance: str, infer, control=None):
    """A stage server running ``infer`` (and ``control``), entered in the stage directory as ``instance`` (pid
    123); stopped after the one item it yields."""
    server = StageServer(infer, control or (lambda message: None), "127.0.0.1")
    server.start()
    directory.enter(instance, server.worker_file(123, instance))
    yield {"server": server, "path": server.path}
    server.stop(drain_s=5)
    assert not server._thread.is_alive(), "the stage server did not stop"


@pytest.fixture
def worker(tmp_path):
    """A stage server serving ``calls`` (what each call does, by the request's text) on its sockets, entered in the
    stage directory as instance ``prefill``."""
    async def infer(call):
        text = call.inputs["text_input"][0].decode()
        if text.startswith("sleep"):
            await asyncio.sleep(float(text.split()[1]))
        if text == "refuse":
            raise InvalidRequest("text_input says refuse")
        return {"kv_meta": np.array([f"record of {text}".encode()], dtype=np.object_)}

    hooks = {}
    yield from ({**served, "hooks": hooks} for served in _serve(tmp_path, "prefill", infer, lambda m: hooks["control"](m)))


def _text(value: str) -> dict:
    return {"text_input": np.array([value.encode()], dtype=np.object_)}


def _run(coro):
    return asyncio.run(coro)


def test_a_call_gets_the_stage_answer(worker):
    async def go():
        calls = StageClient()
        try:
            first = await calls.call("prefill", _text("a"), ["kv_meta"])
            second = await calls.call("prefill", _text("b"), ["kv_meta"])  # on the same connection
            return first, second
        finally:
            calls.close()

    first, second = _run(go())
    assert first["kv_meta"].tolist() == [b"record of a"] and second["kv_meta"].tolist() == [b"record of b"]


def test_a_worker_on_another_host_is_called_over_tcp_with_the_same_messages(worker):
    """A worker file with only the TCP stage socket (what a worker that joined from another host uploads): the
    same calls and errors, over TCP after the same handshake."""
    host, port = worker["server"].address
    assert host == "127.0.0.1"  # the data-plane address, never every interface
    directory.enter("prefill-2", {"name": "prefill-2", "tcp": [host, port]})

    async def go():
        calls = StageClient()
        try:
            answer = await calls.call("prefill-2", _text("far"), ["kv_meta"])
            with pytest.raises(InvalidRequest, match="text_input says refuse"):
                await calls.call("prefill-2", _text("refuse"), ["kv_meta"])
            return answer, calls._connections["prefill-2"]._sock.family
        finally:
            calls.close()

    answer, family = _run(go())
    assert answer["kv_meta"].tolist() == [b"record of far"] and family == socket.AF_INET


def test_a_caller_without_the_secret_gets_nothing(worker):
    """A connection to the worker's stage socket that does not prove the deployment secret is closed after the
    worker's random challenge: the call it writes is never run and nothing else comes back (another deployment's
    secret: tests/unit/test_auth.py)."""
    call = encode_message(Call(1, _text("steal" * 20)))  # (longer than a proof: the worker reads that much first)

    def attempt(reply: bytes, tcp: bool = False) -> bytes:
        sock = socket.create_connection(worker["server"].address) if tcp else socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        if not tcp:
            sock.connect(worker["path"])
        got = b""
        try:
            hello = sock.recv(64)
            assert hello.startswith(auth.MAGIC) and len(hello) == auth.HELLO_BYTES
            sock.sendall(reply + call)
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
        finally:
            sock.close()
        return got

    assert attempt(b"") == b""  # straight to the call, no proof
    assert attempt(b"\0" * auth.REPLY_BYTES) == b""  # a proof of nothing
    assert attempt(b"", tcp=True) == b"" and attempt(b"\0" * auth.REPLY_BYTES, tcp=True) == b""  # over TCP alike

def test_the_stage_error_is_raised_as_sent(worker):
    async def go():
        calls = StageClient()
        try:
            with pytest.raises(InvalidRequest, match="text_input says refuse"):
                await calls.call("prefill", _text("refuse"), ["kv_meta"])
            return await calls.call("prefill", _text("after"), ["kv_meta"])  # the connection serves on
        finally:
            calls.close()

    assert _run(go())["kv_meta"].tolist() == [b"record of after"]


def test_an_instance_not_entered_or_not_answering_is_gone(worker, tmp_path):
    """No entry in the stage directory, an entry without an address, or one whose worker does not listen: None
    (the scheduler plans the request again without that instance)."""
    directory.enter("joined", {"pid": 1, "name": "joined"})
    directory.enter("old", {"direct": str(tmp_path / "gone.sock")})
    assert directory.lookup("old") == {"direct": str(tmp_path / "gone.sock")}
    directory.remove("old", {"direct": "another load's"})  # a newer load's entry stays
    assert directory.lookup("old") is not None

    async def go():
        calls = StageClient()
        return [await calls.call(name, _text("x"), ["kv_meta"]) for name in ("missing", "joined", "old")]

    assert _run(go()) == [None, None, None]


def test_a_stopping_worker_finishes_what_it_took_and_takes_no_more(worker):
    async def go():
        calls = StageClient()
        try:
            taken = asyncio.ensure_future(calls.call("prefill", _text("sleep 0.5"), ["kv_meta"]))
            await asyncio.sleep(0.1)
            stopping = threading.Thread(target=worker["server"].stop)  # the worker stops while the call runs
            stopping.start()
            await asyncio.sleep(0.1)
            later = await calls.call("prefill", _text("later"), ["kv_meta"])
            return await taken, later, stopping
        finally:
            calls.close()

    taken, later, stopping = _run(go())
    stopping.join(15)
    assert taken["kv_meta"].tolist() == [b"record of sleep 0.5"]
    assert later is None  # the scheduler tries another instance
    assert not Path(worker["path"]).exists()


def test_a_worker_lost_mid_call_fails_it_with_503(tmp_path):
    path = str(tmp_path / "w.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def take_and_die() -> None:
        conn, _ = listener.accept()
        auth.accept(conn, auth.identity(path))
        conn.recv(65536)
        conn.close()

    threading.Thread(target=take_and_die, daemon=True).start()
    directory.enter("encode", {"pid": 77, "direct": path})

    async def go():
        with pytest.raises(Unavailable, match=r"the encode stage's worker \(pid 77\) exited; the request was lost"):
            await StageClient().call("encode", _text("x"), ["embedding_meta"])

    _run(go())
    listener.close()


def test_at_most_keeps_calls_at_once():
    from trident.core.stagecall.server import at_most as _at_most

    state = {"running": 0, "most": 0}

    async def infer(call):
        state["running"] += 1
        state["most"] = max(state["most"], state["running"])
        await asyncio.sleep(0.02)
        state["running"] -= 1
        return call

    async def go(count: int):
        limited = _at_most(infer, count)
        return await asyncio.gather(*(limited(i) for i in range(6)))

    assert _run(go(1)) == list(range(6)) and state["most"] == 1
    state["most"] = 0
    _run(go(2))
    assert state["most"] == 2


def test_a_one_answer_stage_refuses_past_max_inflight_at_once_instead_of_queueing():
    """``max_inflight`` counts the calls waiting for the engine's slot as well as the one in it: past it a call is
    refused at once (503, the record it brought freed), not queued without bound."""
    from trident.core.protocol import STAGES, Call
    from trident.core.stagecall.server import at_most
    from trident.worker.infer import make_handler

    class Engine:
        discarded: list[bytes] = []
        kv_claims = None

        async def prefill(self, text, params, **kwargs):
            await asyncio.sleep(0.2)
            return b"kv of " + text.encode()

        def discard(self, record: bytes) -> None:
            self.discarded.append(record)

        def stats(self) -> dict:
            return {}

    engine = Engine()
    handler = make_handler(STAGES["prefill"], engine, max_inflight=2)
    infer = at_most(handler.infer, 1, handler.entry)  # one slot: the engine's calls_at_once

    def call(i: int) -> Call:
        return Call(i, {"text_input": np.array([f"p{i}".encode()], dtype=np.object_),
                        "embedding_meta": np.array([f"record {i}".encode()], dtype=np.object_)}, ["kv_meta"], {})

    async def go():
        t0 = time.monotonic()
        results = await asyncio.gather(*(infer(call(i)) for i in range(4)), return_exceptions=True)
        return results, time.monotonic() - t0

    results, _ = _run(go())
    refused = [r for r in results if isinstance(r, Unavailable)]
    assert len(refused) == 2 and "limit (max_inflight)" in str(refused[0])
    assert [r["kv_meta"].tolist() for r in results if isinstance(r, dict)] == [[b"kv of p0"], [b"kv of p1"]]
    assert engine.discarded == [b"record 2", b"record 3"]
    assert _run(infer(call(5)))["kv_meta"].tolist() == [b"kv of p5"]  # counted out again


@pytest.fixture
def streaming(tmp_path):
    """A decoupled stage's stage server: ``n`` tokens a call (the text's number), an error after two with
    ``fail``, and the scheduler's Cancel message (:class:`trident.worker.infer.Streams`)."""
    from trident.core.protocol import REQUEST_ID
    from trident.worker.infer import Streams

    streams = Streams()

    async def tokens(text: str):
        for i in range(int(text) if text.isdigit() else 3):
            if text == "fail" and i == 2:
                raise Unavailable("the decode ran out of KV blocks")
            await asyncio.sleep(0.01 if text != "forever" else 0.05)
            yield {"text_output": np.array([f"t{i}".encode()], dtype=np.object_)}
        if text == "forever":
            await asyncio.sleep(30)

    async def generate(call):
        async for item in streams.relay(call.parameters.get(REQUEST_ID), tokens(call.inputs["text_input"][0].decode())):
            yield item

    # (the control hook as StageHandler.control calls it)
    for served in _serve(tmp_path, "decode", generate, lambda message: streams.cancel(message.request_id)):
        yield {**served, "streams": streams}


def _stream(text: str, request_id: str = "r1", stop_after: int | None = None):
    """The stream's items as the relay thread reads them (in a thread, as the BLS does)."""
    from trident.core.protocol import REQUEST_ID

    async def go():
        calls = StageClient()
        try:
            stream = await calls.stream("decode", _text(text), ["text_output"], {REQUEST_ID: request_id})
            items = []

            def relay():
                for item in stream:  # (each response's text, or the stage's error)
                    items.append(item if isinstance(item, Exception) else item["text_output"][0])
                    if stop_after is not None and len(items) == stop_after:
                        return

            await asyncio.get_running_loop().run_in_executor(None, relay)
            if stop_after is not None:
                await calls.cancel("decode", request_id)
                await asyncio.get_running_loop().run_in_executor(None, lambda: items.extend(
                    i if isinstance(i, Exception) else i["text_output"][0] for i in stream))
            return items
        finally:
            calls.close()

    return _run(go())


def test_a_stream_relays_every_response_then_ends(streaming):
    assert _stream("4") == [b"t0", b"t1", b"t2", b"t3"]


def test_a_stage_error_ends_the_stream_after_what_was_sent(streaming):
    items = _stream("fail")
    assert items[:2] == [b"t0", b"t1"] and len(items) == 3
    assert isinstance(items[2], Unavailable) and "ran out of KV blocks" in str(items[2])


def test_a_cancelled_stream_stops_at_the_cancel(streaming):
    started = time.monotonic()
    items = _stream("forever", request_id="gone", stop_after=1)
    assert items[0] == b"t0" and len(items) < 3 and streaming["streams"].cancelled == 1
    assert time.monotonic() - started < 10


def test_control_messages_reach_the_stage_hooks(worker):
    """Deliver and Withdraw are messages of their own on the stage socket, handed to the stage's hooks (here a
    prefill's record inbox); a message the stage has no hook for is refused by name, and so is an answer sent as
    if it were a call."""
    from trident.core.errors import InvalidRequest
    from trident.core.protocol import STAGES, Failure, Reply
    from trident.core.stagecall.frames import recv_message
    from trident.worker.infer import StageHandler
    from trident.worker.infer import Inbox

    freed: list[bytes] = []
    handler = StageHandler(STAGES["prefill"], infer=None, inbox=Inbox(freed.append))
    worker["hooks"]["control"] = handler.control

    async def go():
        calls = StageClient()
        try:
            assert await calls.deliver("prefill", "tok-1", b"record one")
            assert await calls.withdraw("prefill", "tok-2")
            with pytest.raises(InvalidRequest, match="the prefill stage takes no Cancel message"):
                await calls.cancel("prefill", "r1")  # (answered in order: the two posts are in by now)
            return await handler.inbox.take("tok-1", wait_s=5)
        finally:
            calls.close()

    assert _run(go()) == b"record one"
    assert handler.inbox.stats()["delivered"] == 1 and handler.inbox.stats()["withdrawn"] == 1
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(worker["path"])
    session = auth.connect(sock, auth.identity(worker["path"]))
    sock.settimeout(5)
    sock.sendall(encode_message(Reply(7, {}), session))
    answer = recv_message(sock, session)
    sock.close()
    assert isinstance(answer, Failure) and answer.id == 7 and answer.error == "InvalidRequest", answer
    assert "does not send Reply" in answer.message


def test_a_stats_message_is_answered_with_the_worker_s_counters_and_they_become_the_stage_s_metrics(worker, tmp_path):
    """The stage model's stub asks its worker for its counters over the stage link (a Stats message, as it would over
    TCP from another host) and sets vLLM's stage gauges and counters from them: a counter follows the worker's total,
    and a worker that restarts from 0 adds its new count."""
    import json

    from trident.core.protocol import STAGES, Reply, Stats
    from trident.core.stagecall import StageLink
    from trident.worker.infer import StageHandler
    from trident.in_triton.stage_metrics import StageMetrics

    from pydantic import ByteSize

    counters = {"vllm_running": 3, "vllm_waiting": 1, "kv_cache_usage": 0.25, "prefix_cache_queries": 40,
                "prefix_cache_hits": 16, "read_bytes_from_DRAM_to_DRAM": 4096, "read_seconds_from_DRAM_to_DRAM": 0.5,
                "read_bytes_from_VRAM_to_DRAM": 512}
    capacity = ByteSize(1 << 20)  # (an embedding cache's capacity is one: msgpack takes plain numbers only)
    handler = StageHandler(STAGES["decode"], infer=None, counters=lambda: {**counters, "cache_capacity": capacity})
    worker["hooks"]["control"] = handler.control
    worker_file = tmp_path / "worker.json"
    worker_file.write_text(json.dumps(directory.lookup("prefill")))
    link = StageLink("prefill", worker_file)
    try:
        got, answered = [], threading.Event()
        link.send(Stats(), lambda m: (got.append(m), answered.set()))
        assert answered.wait(5)
        message = got[0]
    finally:
        link.close()
    assert isinstance(message, Reply)
    assert message.outputs["stats"] == {**counters, "cache_capacity": int(capacity), "pid": os.getpid()}

    class Metric:
        def __init__(self) -> None:
            self.value, self.incremented = None, []

        def set(self, v):
            self.value = v

        def increment(self, v):
            self.incremented.append(v)

    class Family:
        GAUGE, COUNTER = "gauge", "counter"
        made: dict = {}

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels):
            memory = {k: v for k, v in labels.items() if k not in ("model", "version")}
            assert {k: labels[k] for k in ("model", "version")} == {"model": "decode-2", "version": "1"}
            assert set(memory) in (set(), {"from_memory", "to_memory"}), labels
            name = self.name + "".join(f"{{{memory[k]}}}" for k in ("from_memory", "to_memory") if k in memory)
            return Family.made.setdefault(name, Metric())

    class PbUtils:
        MetricFamily = Family

    metrics = StageMetrics("decode-2", lambda: None, PbUtils)
    metrics.stop()
    metrics.update(message.outputs["stats"])
    made = Family.made
    assert made["vllm:num_requests_running"].value == 3 and made["vllm:num_requests_waiting"].value == 1
    assert made["vllm:kv_cache_usage_perc"].value == 0.25
    assert made["vllm:prefix_cache_queries_total"].incremented == [40]
    # the READs by the memory they came from and went to (labels from_memory, to_memory)
    assert made["trident_transfer_read_bytes_total{DRAM}{DRAM}"].incremented == [4096]
    assert made["trident_transfer_read_bytes_total{VRAM}{DRAM}"].incremented == [512]
    assert made["trident_transfer_read_seconds_total{DRAM}{DRAM}"].incremented == [0.5]
    assert "vllm:mm_cache_queries_total" not in made  # (no series for what this engine does not count)
    metrics.update({**counters, "prefix_cache_queries": 50})
    metrics.update({**counters, "prefix_cache_queries": 7})  # restarted
    assert made["vllm:prefix_cache_queries_total"].incremented == [40, 10, 7]
    assert made["vllm:prefix_cache_hits_total"].incremented == [16]
    metrics.update({"cache_hits": 2, "cache_misses": 3})  # an hf encode worker's embedding cache
    assert made["vllm:mm_cache_queries_total"].incremented == [5] and made["vllm:mm_cache_hits_total"].incremented == [2]


def test_a_call_past_its_deadline_is_a_stage_timeout_and_the_worker_stops_it(worker):
    """A call not answered within ``timeout_s`` raises StageTimeout naming the instance (and scheduling.stage_timeout_s);
    the worker is told (an Abandon message) and stops the call at once; the connection serves on."""
    from trident.core.errors import StageTimeout

    async def go():
        calls = StageClient()
        try:
            t0 = time.monotonic()
            with pytest.raises(StageTimeout, match=r"stage instance prefill did not answer within 0.3 s "
                                                   r"\(scheduling.stage_timeout_s\)"):
                await calls.call("prefill", _text("sleep 30"), ["kv_meta"], timeout_s=0.3)
            assert time.monotonic() - t0 < 2
            deadline = time.monotonic() + 2
            while worker["server"]._calls and time.monotonic() < deadline:  # the abandoned call stops
                await asyncio.sleep(0.02)
            assert not worker["server"]._calls
            return await calls.call("prefill", _text("a"), ["kv_meta"], timeout_s=5)
        finally:
            calls.close()

    assert _run(go())["kv_meta"].tolist() == [b"record of a"]
