"""The scheduler's request flow (trident/in_triton/scheduler/flow.py, relay.py) driven with plain fakes of its two interfaces,
a stage caller and a responder, and nothing of Triton: the path a request takes through its mode's stages, what the
client gets, the retries and the migration of a stream whose worker went away, and the early first text. The real
path, through Triton's python backend and real workers, is in tests/e2e/test_scheduler.py, test_migration.py and
test_supervision.py."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
import pytest

from trident.core.config import SchedulerConfig
from trident.core.errors import Cancelled, InvalidRequest, TridentError, Unavailable, WorkerLost
from trident.core.protocol import EMBEDDING_SCOPE, ENCODE_REPORT, RECORD_TENSOR, REQUEST_ID
from trident.in_triton.scheduler.flow import MAX_OPEN, RequestFlow
from trident.in_triton.scheduler.instances import Instances
from trident.in_triton.metrics import SchedulerMetrics
from trident.in_triton.scheduler.relay import Migrate, StageGone, counts, finish_reason, relay
from trident.in_triton.scheduler.request import EntryRequest, choices
from trident.in_triton.scheduler.routing import Router

EMB, KV = RECORD_TENSOR["embeddings"], RECORD_TENSOR["kv"]


# -- fakes -------------------------------------------------------------------------------------------------------
class Responder:
    """What the client gets: ("send", outputs) and ("end", error or None)."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.got: list[tuple[str, object]] = []
        self.cancel_after = cancel_after  # the client goes after this many responses

    def send(self, outputs: dict) -> None:
        assert not any(kind == "end" for kind, _ in self.got), "a response after the last"
        self.got.append(("send", outputs))

    def end(self, error: TridentError | None = None) -> None:
        assert not any(kind == "end" for kind, _ in self.got), "two last responses"
        self.got.append(("end", error))

    def cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.texts) >= self.cancel_after

    @property
    def texts(self) -> list[bytes]:
        return [o["text_output"][0] for kind, o in self.got if kind == "send"]

    @property
    def last(self):
        kind, error = self.got[-1]
        assert kind == "end"
        return error


class Stages:
    """Stage workers: each call answers its record (the encode's report says whether it handed its record on, as
    an encode worker does when asked to); each stream is the next of ``streams`` (a list of responses as data)."""

    def __init__(self, live: set[str], streams: list[list] | None = None, gone: set[str] = frozenset(),
                 failing: dict[str, TridentError] | None = None) -> None:
        self.live, self.streams, self.gone, self.failing = set(live), list(streams or []), set(gone), failing or {}
        self.calls: list[tuple] = []  # (stage instance, its inputs' names, the record it got, how)
        self.parameters: list[dict | None] = []  # of each one-answer call
        self.cancelled: list[tuple[str, str]] = []
        self.withdrawn: list[str] = []
        self.closed = False

    async def call(self, instance, inputs, outputs, parameters=None, hand_to=None, await_record=None, timeout_s=None):
        record = next((v[0] for k, v in inputs.items() if k in (EMB, KV)), None)
        self.calls.append((instance, sorted(inputs), record, "posted" if await_record else "call"))
        self.parameters.append(parameters)
        if instance in self.gone:
            return None
        if instance in self.failing:
            raise self.failing[instance]
        if EMB in outputs:
            return {EMB: np.array([f"emb from {instance}".encode()], dtype=np.object_),
                    ENCODE_REPORT: np.array([json.dumps({"handed": hand_to is not None}).encode()], dtype=np.object_)}
        return {KV: np.array([f"kv from {instance}".encode()], dtype=np.object_)}

    async def stream(self, instance, inputs, outputs, parameters):
        record = next((v[0] for k, v in inputs.items() if k in (EMB, KV)), None)
        self.calls.append((instance, sorted(inputs), record, parameters[REQUEST_ID]))
        if instance in self.gone:
            return None
        return iter(self.streams.pop(0))  # (a list, or a generator)

    async def cancel(self, instance, request_id):
        self.cancelled.append((instance, request_id))

    async def withdraw(self, instance, token):
        self.withdrawn.append(instance)
        return True

    def close(self) -> None:
        self.closed = True


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def __getattr__(self, level):  # log_info, log_warn, log_error, log_verbose
        return lambda message: self.lines.append((level.removeprefix("log_"), message))


class _Metric:
    def __init__(self, values: dict, key) -> None:
        self._values, self._key = values, key

    def increment(self, value) -> None:
        self._values[self._key] = self._values.get(self._key, 0) + value

    def set(self, value) -> None:
        self._values[self._key] = value


class MetricFamily:
    """Triton's metrics API (``pb_utils.MetricFamily``), kept in ``values``."""

    COUNTER, GAUGE = "counter", "gauge"
    values: dict = {}

    def __init__(self, name, description, kind) -> None:
        self.name = name

    def Metric(self, labels):
        return _Metric(MetricFamily.values, (self.name, tuple(sorted(labels.items()))))


class Pb:
    MetricFamily = MetricFamily


def _metric(name: str, **labels) -> float | None:
    return MetricFamily.values.get((name, tuple(sorted({"mode": "e_p_d", **labels}.items()))))


def _flow(tmp_path, stages: Stages, mode: str = "e_p_d", **settings) -> RequestFlow:
    MetricFamily.values = {}
    cfg = SchedulerConfig(**settings)
    router = Router(cfg.routing, cfg.affinity_slack)
    instances = Instances(RequestFlow.stages_of(mode), tmp_path, lambda name: name in stages.live, cfg.refresh_s,
                          router.forget, lambda line: None)
    return RequestFlow(mode, cfg, stages, instances, router, SchedulerMetrics(mode, Pb), lambda answered: None, Log())


def _inputs(text: bytes = b"describe", image: bytes | None = b"\x89PNG fake", stream: bool = True) -> dict:
    inputs = {"text_input": np.array([text], dtype=np.object_), "stream": np.array([stream])}
    if image is not None:
        inputs["image"] = np.array([base64.b64encode(image)], dtype=np.object_)
    return inputs


def _serve(flow: RequestFlow, inputs: dict, responder: Responder) -> Responder:
    async def go():
        try:
            await flow.serve(inputs, responder, 0)
        finally:
            flow.close()
    asyncio.run(go())
    return responder


def _r(text: bytes, reason: bytes = b"None", tokens: int = 1, prompt: int = 9) -> dict:
    """A stage's response as data, in the vLLM backend's shape, with everything the scheduler asks for."""
    return {"text_output": np.array([text], dtype=np.object_), "finish_reason": np.array([reason], dtype=np.object_),
            "num_input_tokens": np.array([prompt], dtype=np.uint32),
            "num_output_tokens": np.array([tokens], dtype=np.uint32)}


E_P_D = {"encode", "prefill", "decode"}


# -- the flow ----------------------------------------------------------------------------------------------------
def test_e_p_d_calls_each_stage_once_with_the_record_before_it_and_streams_the_decode(tmp_path):
    stages = Stages(E_P_D, [[_r(b" a"), _r(b" b"), _r(b" c", b"length")]])
    got = _serve(_flow(tmp_path, stages), _inputs(), Responder())
    assert got.texts == [b" a", b" b", b" c"] and got.last is None
    (encode, *_, e_record, e_how), (prefill, *_, p_record, p_how), (decode, d_inputs, d_record, _) = stages.calls
    assert (encode, e_record, e_how) == ("encode", None, "call")
    # the prefill call was posted beside the encode call, waiting for the record the encode worker hands it
    assert (prefill, p_record, p_how) == ("prefill", None, "posted") and not stages.withdrawn
    assert (decode, d_record) == ("decode", b"kv from prefill") and "text_input" in d_inputs
    # what the client did not ask for (finish_reason, the counts) is not passed on
    assert all(set(o) == {"text_output"} for kind, o in got.got if kind == "send")
    assert _metric("trident_requests_total", path="encode>prefill>decode") == 1
    assert stages.closed


def test_with_embedding_cache_scope_request_the_encode_call_says_so(tmp_path):
    for scope, parameters in (("shared", None), ("request", {EMBEDDING_SCOPE: "request"})):
        stages = Stages(E_P_D, [[_r(b" a", b"stop")]])
        _serve(_flow(tmp_path, stages, embedding_cache_scope=scope), _inputs(), Responder())
        assert stages.calls[0][0] == "encode" and stages.parameters == [parameters, None]  # (the prefill's: none)


def test_a_text_only_request_skips_the_encode(tmp_path):
    stages = Stages(E_P_D, [[_r(b" a", b"stop")]])
    got = _serve(_flow(tmp_path, stages), _inputs(image=None, stream=False), Responder())
    assert got.texts == [b" a"] and [c[0] for c in stages.calls] == ["prefill", "decode"]
    assert _metric("trident_decisions_total", decision="skip_encode") == 1


def test_bad_input_is_refused_before_any_stage_is_called(tmp_path):
    stages = Stages(E_P_D)
    got = _serve(_flow(tmp_path, stages), {"stream": np.array([True])}, Responder())
    assert isinstance(got.last, InvalidRequest) and "text_input is required" in got.last.message
    got = _serve(_flow(tmp_path, stages), _inputs(image=b""), Responder())
    assert isinstance(got.last, InvalidRequest)
    huge = {**_inputs(), "sampling_parameters": np.array([b'{"n": 1, "stop": "' + b"x" * (64 << 10) + b'"}'],
                                                         dtype=np.object_)}
    got = _serve(_flow(tmp_path, stages), huge, Responder())  # (looked at before the media are decoded)
    assert got.last.message == f"sampling_parameters has {(64 << 10) + 20} bytes; at most {64 << 10}"
    assert stages.calls == [] and _metric("trident_scheduler_errors_total", code="INVALID_ARG") == 1


def test_without_a_live_instance_the_request_gets_a_503_naming_what_the_mode_needs(tmp_path):
    stages = Stages({"encode", "prefill"})
    got = _serve(_flow(tmp_path, stages), _inputs(), Responder())
    assert isinstance(got.last, Unavailable) and "no live stage instances" in got.last.message
    assert [c[0] for c in stages.calls] == []


def test_an_instance_gone_before_the_answer_is_retried_on_another(tmp_path):
    stages = Stages(E_P_D | {"prefill-2"}, [[_r(b" a", b"stop")]], gone={"prefill"})
    got = _serve(_flow(tmp_path, stages, routing="round_robin"), _inputs(image=None), Responder())
    assert got.texts == [b" a"] and got.last is None
    assert [c[0] for c in stages.calls] == ["prefill", "prefill-2", "decode"]
    assert stages.calls[-1][2] == b"kv from prefill-2"


def test_a_stage_s_error_before_anything_is_the_request_s(tmp_path):
    stages = Stages(E_P_D, failing={"prefill": InvalidRequest("the prompt is longer than the context window")})
    got = _serve(_flow(tmp_path, stages), _inputs(image=None), Responder())
    assert isinstance(got.last, InvalidRequest) and got.texts == []
    assert got.last.message == "the prompt is longer than the context window"
    stages = Stages(E_P_D, [[InvalidRequest("kv_meta was refused")]])
    got = _serve(_flow(tmp_path, stages), _inputs(image=None), Responder())
    assert isinstance(got.last, InvalidRequest) and got.last.message == "kv_meta was refused"


def test_a_decode_worker_lost_mid_stream_moves_the_request_and_the_client_sees_one_stream(tmp_path):
    lost = WorkerLost("the decode stage's worker (pid 7) exited; the request was lost with it")
    stages = Stages(E_P_D | {"decode-2"}, [[_r(b" a"), _r(b" bc", tokens=2), lost],
                                          [_r(b" a"), _r(b" bc", tokens=2), _r(b" d"), _r(b" e", b"length")]])
    flow = _flow(tmp_path, stages)
    got = _serve(flow, _inputs(), Responder())
    assert got.texts == [b" a", b" bc", b" d", b" e"] and got.last is None
    first, second = [c[0] for c in stages.calls if c[0].startswith("decode")]
    assert first != second  # the lost one is held out
    assert _metric("trident_migrations_total", stage="decode", reason="worker_lost") == 1
    assert any(level == "warn" and "moving the request (migration 1), 3 token(s) already sent" in line
               for level, line in flow.log.lines)


def test_past_the_migration_limit_the_client_gets_a_503_after_what_it_has(tmp_path):
    stages = Stages(E_P_D | {"decode-2"}, [[_r(b" a"), _r(b" b")]])  # cut off: no last response
    got = _serve(_flow(tmp_path, stages, migration_limit=0), _inputs(), Responder())
    assert got.texts == [b" a", b" b"]
    assert isinstance(got.last, Unavailable) and "after 0 migration(s) (scheduling.migration_limit)" in got.last.message


def test_a_moved_request_that_cannot_go_on_names_why_it_moved(tmp_path):
    lost = WorkerLost("the decode stage's worker (pid 7) exited")
    stages = Stages(E_P_D, [[_r(b" a"), lost]])  # no other decode instance
    got = _serve(_flow(tmp_path, stages), _inputs(), Responder())
    assert got.texts == [b" a"] and isinstance(got.last, Unavailable)
    assert got.last.message.startswith("the decode stage's worker (pid 7) exited; the request could not move on")


def test_a_client_that_goes_stops_the_decode_stream(tmp_path):
    def paced():  # a token every 2 ms, for 2 s
        for _ in range(1000):
            time.sleep(0.002)
            yield _r(b" x")
        yield _r(b" z", b"length")

    stages = Stages(E_P_D, [paced()])
    got = _serve(_flow(tmp_path, stages), _inputs(), Responder(cancel_after=1))
    assert isinstance(got.last, Cancelled) and len(got.texts) < 1000
    (instance, request_id), = stages.cancelled
    assert instance == "decode" and request_id == stages.calls[-1][3]


def test_past_its_open_requests_an_entry_model_answers_503_at_once(tmp_path):
    """Each request's stream has a relay thread (``MAX_OPEN`` of them): one request more is refused with a 503 at
    once, where it used to wait, unseen, for a thread."""
    stages = Stages(E_P_D)
    flow = _flow(tmp_path, stages)
    flow.open = MAX_OPEN
    got = _serve(flow, _inputs(), Responder())
    assert got.got == [("end", got.last)] and isinstance(got.last, Unavailable)
    assert got.last.message == f"the e_p_d mode has {MAX_OPEN} requests in flight, its limit; retry later"
    assert flow.open == MAX_OPEN and stages.calls == []
    assert _metric("trident_scheduler_errors_total", code="UNAVAILABLE") == 1


# -- the relay of one stream -------------------------------------------------------------------------------------
EXTRAS = {"finish_reason", "num_input_tokens", "num_output_tokens"}  # what the scheduler always asks the stage for


def _relay(stream: list, early: bytes | None, unasked: set[str] = EXTRAS,
           req: EntryRequest | None = None) -> tuple[str, Responder, list]:
    responder = Responder()
    req = req or EntryRequest(responder, None, early=early)  # (no metric updates held)
    if early is not None and not req.sent_responses:  # (as send_early leaves it)
        req.sent_text, req.sent_tokens, req.sent_responses = early, 1, 1
    req.responder = responder
    errors: list[str] = []
    outcome = relay(iter(stream), "decode", req, unasked, errors.append, "call:decode", 0)
    return outcome, responder, errors


def _text(value: bytes, reason: bytes | None = None) -> dict:
    outputs = {"text_output": np.array([value], dtype=np.object_)}
    if reason is not None:
        outputs["finish_reason"] = np.array([reason], dtype=np.object_)
    return outputs


def test_the_counts_of_every_response_are_summed_and_passed_on_only_where_asked():
    stream = [_r(b" a"), _r(b" bc", tokens=2), _r(b" d", b"length")]
    req = EntryRequest(None, None)
    outcome, got, _ = _relay(stream, None, unasked={"num_input_tokens"}, req=req)
    assert outcome == "done" and req.answered[:2] == (9, 4)
    assert [list(o) for kind, o in got.got if kind == "send"] == [["text_output", "finish_reason",
                                                                   "num_output_tokens"]] * 3
    assert [o["finish_reason"][0] for kind, o in got.got if kind == "send"] == [b"None", b"None", b"length"]
    # after an early first text (which carried the first response's outputs), the decode's copy is dropped whole
    req = EntryRequest(None, None, early=b" a")
    _, got, _ = _relay(stream, b" a", unasked={"num_input_tokens"}, req=req)
    assert got.texts == [b" bc", b" d"] and got.last is None and req.answered[:2] == (9, 4)


def test_the_decode_s_copy_of_the_first_text_is_not_sent_again():
    outcome, got, errors = _relay([_text(b" a"), _text(b" b"), _text(b" c", b"length")], early=b" a")
    assert outcome == "done" and got.texts == [b" b", b" c"] and got.last is None
    assert list(got.got[0][1]) == ["text_output"]  # finish_reason: not asked for
    assert not errors


def test_a_first_response_that_goes_on_past_the_first_text_sends_the_rest():
    _, got, _ = _relay([_text(b" a b"), _text(b" c", b"length")], early=b" a")
    assert got.texts == [b" b", b" c"]


def test_a_decode_gone_before_anything_else_is_retried():
    with pytest.raises(StageGone):  # nothing sent at all: the instance is gone, the request planned again
        _relay([], early=None)
    with pytest.raises(Migrate):  # a stream cut off right after the copy of the first text: the request moves
        _relay([_text(b" a")], early=b" a")
    lost = Unavailable("the decode stage's worker exited; the request was lost with it")
    with pytest.raises(Unavailable, match="lost with it"):  # the stage's own error: the request's (503)
        _relay([lost], early=b" a")


def test_a_retry_that_begins_differently_ends_with_a_503():
    outcome, got, errors = _relay([_text(b" z"), _text(b" y", b"length")], early=b" a")
    assert outcome == "done" and got.texts == []
    assert isinstance(got.last, Unavailable) and "began differently" in got.last.message
    assert errors


def test_an_error_after_the_first_text_ends_the_stream_after_what_the_client_has():
    failed = InvalidRequest("kv_meta was refused")
    with pytest.raises(InvalidRequest, match="kv_meta was refused"):  # nothing from the stage yet: the caller ends it
        _relay([failed], early=b" a")
    outcome, got, _ = _relay([_text(b" a"), _text(b" b"), failed], early=b" a")
    assert outcome == "done" and got.texts == [b" b"] and got.last is failed


def test_without_an_early_text_the_first_response_is_sent():
    _, got, _ = _relay([_text(b" a"), _text(b" b", b"length")], early=None)
    assert got.texts == [b" a", b" b"] and got.last is None


def test_a_worker_lost_mid_stream_moves_the_request_with_what_the_client_has():
    req = EntryRequest(None, None)
    lost = WorkerLost("the decode stage's worker (pid 7) exited; the request was lost with it")
    with pytest.raises(Migrate) as moved:
        _relay([_r(b" a"), _r(b" bc", tokens=2), lost], None, req=req)
    assert (moved.value.instance, moved.value.stage, moved.value.reason) == ("decode", "decode", "worker_lost")
    assert "the decode stage's worker (pid 7) exited" in moved.value.message
    assert (req.sent_text, req.sent_tokens, req.sent_responses) == (b" a bc", 3, 2)
    with pytest.raises(Migrate) as cut:  # a stream that just ends, with no last response
        _relay([_r(b" a")], None, req=EntryRequest(None, None))
    assert cut.value.reason == "cut_off"
    with pytest.raises(StageGone):  # lost before the client had anything: planned again, not moved
        _relay([lost], None)


def test_the_moved_request_s_new_stream_replays_what_the_client_has_then_goes_on():
    stream = [_r(b" a"), _r(b" bc", tokens=2), _r(b" d"), _r(b" e", b"length")]
    req = EntryRequest(None, None, sent_text=b" a bc", sent_tokens=3, sent_responses=2, migrations=1)
    outcome, got, _ = _relay(stream, None, unasked={"num_input_tokens"}, req=req)
    assert outcome == "done" and got.texts == [b" d", b" e"] and got.last is None
    assert req.answered[:2] == (9, 5) and (req.sent_text, req.sent_tokens) == (b" a bc d e", 5)
    # a response that straddles what the client has: the rest of it goes on, its count and logprobs cut to match
    straddle = {"text_output": np.array([b" bc d"], dtype=np.object_),
                "num_output_tokens": np.array([3], dtype=np.uint32),
                "logprobs": np.array([b'[{"1": 0}, {"2": 0}, {"3": 0}]'], dtype=np.object_)}
    req = EntryRequest(None, None, sent_text=b" a bc", sent_tokens=3, sent_responses=2, migrations=1)
    _, got, _ = _relay([_r(b" a"), straddle, _r(b" e", b"length")], None, unasked={"num_input_tokens"}, req=req)
    first = {name: value.reshape(-1)[0] for name, value in got.got[0][1].items()}
    assert first == {"text_output": b" d", "num_output_tokens": 1, "logprobs": b'[{"3": 0}]'}


def test_a_moved_request_whose_new_stream_differs_ends_with_a_503():
    req = EntryRequest(None, None, sent_text=b" a bc", sent_tokens=3, sent_responses=2, migrations=1)
    outcome, got, _ = _relay([_r(b" a"), _r(b" xy", tokens=2)], None, req=req)
    assert outcome == "done" and got.texts == [] and "began differently" in got.last.message


def test_a_stream_ends_when_every_choice_has_ended_and_n_is_read_for_the_metrics():
    def response(*reasons):
        return {"finish_reason": np.array([r.encode() for r in reasons], dtype=np.object_)}

    assert finish_reason(response("None")) is None and finish_reason(response("stop")) == b"stop"
    assert finish_reason(response("stop", "None")) is None
    assert finish_reason(response("stop", "length")) is not None
    assert counts({"num_input_tokens": np.array([7]), "num_output_tokens": np.array([2, 0, 3])}) == (7, 5)
    # n, for the metrics: the stages refuse what is wrong (a deep JSON is a 400 there, not a failure here)
    for raw, n in ((b'{"n": 3}', 3), (b"{}", 1), (b'{"n": 99}', 1), (b'{"n": true}', 1), (b'[' * 20_000 + b']' * 20_000, 1),
                   (b'{"n": ' + b'[' * 20_000 + b']' * 20_000 + b'}', 1), (b"not json", 1)):
        assert choices(np.array([raw], dtype=np.object_)) == n, raw[:20]
    assert choices(None) == 1
