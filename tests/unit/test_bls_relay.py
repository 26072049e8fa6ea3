"""The BLS entry model's relay of a decode stream after it sent the first text itself (from the prefill's
``kv_meta``): the decode's copy of that text is dropped, a decode gone before anything else is retried, and a
retry that begins differently ends the client's stream with a 503; a decode whose worker went away mid-stream moves
the request (Migrate), and the new stream replays what the client has, dropped, before it goes on. The python backend's ``pb_utils`` is faked
(the relay is plain Python around it); the real path is in tests/e2e/test_scheduler.py and test_supervision.py (its soak)."""

from __future__ import annotations

import numpy as np
import pytest

from trident.scheduler.request import EntryRequest
from trident.scheduler.model import Migrate, StageError, StageGone, TritonPythonModel

FINAL = 1


class Tensor:
    def __init__(self, name: str, value: np.ndarray) -> None:
        self._name, self._value = name, value

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._value


class Error:
    UNAVAILABLE, INTERNAL = "UNAVAILABLE", "INTERNAL"

    def __init__(self, message: str, code: str = "INTERNAL") -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> str:
        return self._code


class Response:
    def __init__(self, output_tensors: list | None = None, error: Error | None = None) -> None:
        self.tensors, self._error = output_tensors or [], error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> Error:
        return self._error

    def output_tensors(self) -> list:
        return self.tensors


class Pb:
    Tensor, TritonError, InferenceResponse = Tensor, Error, Response
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL

    @staticmethod
    def get_output_tensor_by_name(response: Response, name: str):
        return next((t for t in response.tensors if t.name() == name), None)


class Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[Response | None, int]] = []

    def send(self, response: Response | None = None, flags: int = 0) -> None:
        self.sent.append((response, flags))


class Request:
    def is_cancelled(self) -> bool:
        return False


class Logger:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def log_error(self, message: str) -> None:
        self.errors.append(message)


def _text(value: bytes, reason: bytes | None = None) -> Response:
    tensors = [Tensor("text_output", np.array([value], dtype=np.object_))]
    if reason is not None:
        tensors.append(Tensor("finish_reason", np.array([reason], dtype=np.object_)))
    return Response(tensors)


@pytest.fixture
def bls() -> TritonPythonModel:
    model = TritonPythonModel.__new__(TritonPythonModel)  # what initialize() would set that the relay uses
    model.pb, model.mode, model.logger = Pb, "e_p_d", Logger()
    return model


EXTRAS = {"finish_reason", "num_input_tokens", "num_output_tokens"}  # what the BLS always asks the stage for


def _relay(bls, stream: list[Response], early: bytes | None, unasked: set[str] = EXTRAS,
           req: EntryRequest | None = None) -> tuple[str, list]:
    sender = Sender()
    req = req or EntryRequest(Request(), sender, None, early=early)  # (no metric updates held)
    if early is not None and not req.sent_responses:  # (as _send_early leaves it)
        req.sent_text, req.sent_tokens, req.sent_responses = early, 1, 1
    req.sender = sender
    outcome = bls._relay(iter(stream), "decode", req, unasked, "call:decode", 0)
    return outcome, sender.sent


def _counted(value: bytes, reason: bytes, tokens: int) -> Response:
    """A stage response in the vLLM backend's shape, with everything asked for."""
    return Response([Tensor("text_output", np.array([value], dtype=np.object_)),
                     Tensor("finish_reason", np.array([reason], dtype=np.object_)),
                     Tensor("num_input_tokens", np.array([9], dtype=np.uint32)),
                     Tensor("num_output_tokens", np.array([tokens], dtype=np.uint32))])


def test_the_counts_of_every_response_are_summed_and_passed_on_only_where_asked(bls):
    stream = [_counted(b" a", b"None", 1), _counted(b" bc", b"None", 2), _counted(b" d", b"length", 1)]
    req = EntryRequest(Request(), None, None)
    outcome, sent = _relay(bls, stream, None, unasked={"num_input_tokens"}, req=req)
    assert outcome == "done" and req.answered[:2] == (9, 4)
    assert [[t.name() for t in r.output_tensors()] for r, _ in sent[:-1]] == [["text_output", "finish_reason",
                                                                                 "num_output_tokens"]] * 3
    assert [r.output_tensors()[1].as_numpy()[0] for r, _ in sent[:-1]] == [b"None", b"None", b"length"]
    # after an early first text (which carried the first response's outputs), the decode's copy is dropped whole
    req = EntryRequest(Request(), None, None, early=b" a")
    _, sent = _relay(bls, stream, b" a", unasked={"num_input_tokens"}, req=req)
    assert _texts(sent) == [b" bc", b" d", None] and req.answered[:2] == (9, 4)


def _texts(sent: list) -> list[bytes | None]:
    return [r.output_tensors()[0].as_numpy()[0] if r is not None and not r.has_error() else None for r, _ in sent]


def test_the_decode_s_copy_of_the_first_text_is_not_sent_again(bls):
    outcome, sent = _relay(bls, [_text(b" a"), _text(b" b"), _text(b" c", b"length")], early=b" a")
    assert outcome == "done"
    assert _texts(sent) == [b" b", b" c", None] and sent[-1] == (None, FINAL)
    assert [t.name() for t in sent[1][0].output_tensors()] == ["text_output"]  # finish_reason: not asked for
    assert not bls.logger.errors


def test_a_first_response_that_goes_on_past_the_first_text_sends_the_rest(bls):
    _, sent = _relay(bls, [_text(b" a b"), _text(b" c", b"length")], early=b" a")
    assert _texts(sent) == [b" b", b" c", None]


def test_a_decode_gone_before_anything_else_is_retried(bls):
    with pytest.raises(StageGone):  # nothing sent at all: the instance is gone, the request planned again
        _relay(bls, [], early=None)
    with pytest.raises(Migrate):  # a stream cut off right after the copy of the first text: the request moves
        _relay(bls, [_text(b" a")], early=b" a")
    lost = Response(error=Error("Unavailable: the decode stage's worker exited; the request was lost with it",
                                Error.UNAVAILABLE))
    with pytest.raises(StageError, match="lost with it") as failed:  # the stage's own error: the request's (503)
        _relay(bls, [lost], early=b" a")
    assert failed.value.code == Error.UNAVAILABLE


def test_a_retry_that_begins_differently_ends_with_a_503(bls):
    outcome, sent = _relay(bls, [_text(b" z"), _text(b" y", b"length")], early=b" a")
    assert outcome == "done"
    (error, flags), final = sent
    assert error.has_error() and error.error().code() == Error.UNAVAILABLE and flags == 0
    assert "began differently" in error.error().message()
    assert final == (None, FINAL)
    assert bls.logger.errors


def test_an_error_after_the_first_text_is_a_response_of_its_own(bls):
    failed = Response(error=Error("InvalidRequest: kv_meta was refused", "INVALID_ARG"))
    with pytest.raises(Exception, match="kv_meta was refused"):  # nothing from the stage yet: the caller ends it
        _relay(bls, [failed], early=b" a")
    outcome, sent = _relay(bls, [_text(b" a"), _text(b" b"), failed], early=b" a")
    assert outcome == "done" and _texts(sent) == [b" b", None, None]
    assert sent[1][0].has_error() and sent[1][1] == 0 and sent[2] == (None, FINAL)


def test_without_an_early_text_the_first_response_is_sent(bls):
    outcome, sent = _relay(bls, [_text(b" a"), _text(b" b", b"length")], early=None)
    assert _texts(sent) == [b" a", b" b", None]
    with pytest.raises(StageGone):  # ended before anything, without a finish_reason
        _relay(bls, [], early=None)


def test_past_its_open_requests_an_entry_model_answers_503_at_once(bls):
    """Each request's stream has a relay thread (``MAX_OPEN`` of them): one request more is refused with a 503 at
    once, where it used to wait, unseen, for a thread."""
    import asyncio

    from trident.scheduler.model import MAX_OPEN

    class Metrics:
        added: list = []

        def add(self, name, **labels):
            self.added.append((name, labels))

    class Entry:
        def __init__(self) -> None:
            self.sender = Sender()

        def get_response_sender(self):
            return self.sender

    bls.metrics, bls._open = Metrics(), MAX_OPEN
    entry = Entry()
    asyncio.run(bls._serve(entry))
    (response, flags), = entry.sender.sent
    assert flags == FINAL and response.error().code() == "UNAVAILABLE"
    assert response.error().message() == f"Unavailable: the e_p_d mode has {MAX_OPEN} requests in flight, its limit; retry later"
    assert bls._open == MAX_OPEN and Metrics.added == [("trident_scheduler_errors_total", {"code": "UNAVAILABLE"})]


def _lost() -> Response:
    return Response(error=Error("WorkerLost: the decode stage's worker (pid 7) exited; the request was lost with it",
                                Error.UNAVAILABLE))


def test_a_worker_lost_mid_stream_moves_the_request_with_what_the_client_has(bls):
    req = EntryRequest(Request(), None, None)
    with pytest.raises(Migrate) as moved:
        _relay(bls, [_counted(b" a", b"None", 1), _counted(b" bc", b"None", 2), _lost()], None, req=req)
    assert (moved.value.instance, moved.value.stage, moved.value.reason) == ("decode", "decode", "worker_lost")
    assert "the decode stage's worker (pid 7) exited" in moved.value.message
    assert (req.sent_text, req.sent_tokens, req.sent_responses) == (b" a bc", 3, 2)
    with pytest.raises(Migrate) as cut:  # a stream that just ends, with no last response
        _relay(bls, [_counted(b" a", b"None", 1)], None, req=EntryRequest(Request(), None, None))
    assert cut.value.reason == "cut_off"
    with pytest.raises(StageGone):  # lost before the client had anything: planned again, not moved
        _relay(bls, [_lost()], None)


def test_the_moved_request_s_new_stream_replays_what_the_client_has_then_goes_on(bls):
    stream = [_counted(b" a", b"None", 1), _counted(b" bc", b"None", 2), _counted(b" d", b"None", 1),
              _counted(b" e", b"length", 1)]
    req = EntryRequest(Request(), None, None, sent_text=b" a bc", sent_tokens=3, sent_responses=2, migrations=1)
    outcome, sent = _relay(bls, stream, None, unasked={"num_input_tokens"}, req=req)
    assert outcome == "done" and _texts(sent) == [b" d", b" e", None]
    assert req.answered[:2] == (9, 5) and (req.sent_text, req.sent_tokens) == (b" a bc d e", 5)
    # a response that straddles what the client has: the rest of it goes on, its count and logprobs cut to match
    straddle = Response([Tensor("text_output", np.array([b" bc d"], dtype=np.object_)),
                         Tensor("num_output_tokens", np.array([3], dtype=np.uint32)),
                         Tensor("logprobs", np.array([b'[{"1": 0}, {"2": 0}, {"3": 0}]'], dtype=np.object_))])
    req = EntryRequest(Request(), None, None, sent_text=b" a bc", sent_tokens=3, sent_responses=2, migrations=1)
    _, sent = _relay(bls, [_counted(b" a", b"None", 1), straddle, _counted(b" e", b"length", 1)], None,
                     unasked={"num_input_tokens"}, req=req)
    first = {t.name(): t.as_numpy().reshape(-1)[0] for t in sent[0][0].output_tensors()}
    assert first == {"text_output": b" d", "num_output_tokens": 1, "logprobs": b'[{"3": 0}]'}


def test_a_moved_request_whose_new_stream_differs_ends_with_a_503(bls):
    req = EntryRequest(Request(), None, None, sent_text=b" a bc", sent_tokens=3, sent_responses=2, migrations=1)
    outcome, sent = _relay(bls, [_counted(b" a", b"None", 1), _counted(b" xy", b"None", 2)], None, req=req)
    (error, _), final = sent
    assert outcome == "done" and "began differently" in error.error().message() and final == (None, FINAL)
