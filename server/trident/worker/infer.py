"""A stage's handler: a :class:`~trident.core.protocol.Call` -> engine call -> its outputs, and what the handler keeps
per stage (its streams, its admission bound, the prefill's inbox of records handed on by the encode worker).

What a stage does follows from what it hands on (:attr:`~trident.core.protocol.StageSpec.hands_on`):
``embeddings`` -> :meth:`encode`, ``kv`` -> :meth:`prefill`, ``tokens`` -> :meth:`generate` (streamed);
its inputs say which of ``text_input``, the media (``image``, ``video``, ``audio``), ``embedding_meta`` and
``kv_meta`` it reads. The decode stage takes ``kv_meta``, or a short prompt with its ``embedding_meta`` that it
prefills itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from trident.core import tracing
from trident.core.errors import InvalidRequest, ReplayedRecord, TridentError, Unavailable
from trident.core.media import MODALITIES, MediaItem, check_count
from trident.core.output import OutputOptions, entry_responses
from trident.core.processor import SamplingParams
from trident.core.protocol import (
    EMBEDDING_SCOPE, ENCODE_REPORT, RECORD_TENSOR, REQUEST_ID, Call, Cancel, Claim, Control, Deliver, EmbeddingsRecord, HandTo,
    StageSpec, Stats, Withdraw, decode_record, parse_instance,
)



def _parameter(request, name: str) -> str | None:
    value = (getattr(request, "parameters", None) or {}).get(name)
    return str(value) if value not in (None, "") else None


class Streams:
    """The streamed requests of a stage by the scheduler's id, so that a :class:`~trident.core.protocol.Cancel` message
    can stop one: the stream it names ends at its next token, which closes the engine's generation (the hf decoder
    drops it, vLLM aborts it) and frees what it holds."""

    def __init__(self) -> None:
        self._stops: dict[str, asyncio.Event] = {}
        self.cancelled = 0

    def cancel(self, request_id: str) -> bool:
        stop = self._stops.get(request_id)
        if stop is None:
            return False
        stop.set()
        self.cancelled += 1
        return True

    async def relay(self, request_id: str | None, responses):
        """``responses`` (an async iterator) until it ends or ``request_id`` is cancelled."""
        if request_id is None:
            async for item in responses:
                yield item
            return
        stop = self._stops.setdefault(request_id, asyncio.Event())
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while True:
                step = asyncio.ensure_future(anext(responses, None))
                await asyncio.wait({step, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():  # cancelled: the generation's own clean-up runs as the step is cancelled
                    step.cancel()
                    await asyncio.gather(step, return_exceptions=True)
                    return
                item = step.result()
                if item is None:
                    return
                yield item
        finally:
            stopped.cancel()
            self._stops.pop(request_id, None)


def _value(request, name: str):
    return request.inputs.get(name) if isinstance(request, Call) else request.get(name)


def _first(request, name: str):
    value = _value(request, name)
    if value is None:
        return None
    arr = np.asarray(value).reshape(-1)
    return arr[0] if arr.size else None


def text_input(request, required: bool = True) -> str | None:
    value = _first(request, "text_input")
    if value is None:
        if required:
            raise InvalidRequest("text_input is required")
        return None
    try:
        return value.decode("utf-8", errors="strict") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise InvalidRequest("text_input is not valid UTF-8") from None


def record_input(request, name: str) -> bytes | None:
    """A record tensor's bytes; None when absent or empty (an ensemble passes an empty record on)."""
    value = _first(request, name)
    if value is None or (isinstance(value, (bytes, str)) and len(value) == 0):
        return None
    return value if isinstance(value, bytes) else str(value).encode()


def media_items(request) -> list[MediaItem]:
    """The request's images, video clips and audio clips (in that order) as bytes with their content ids;
    not yet decoded (the engine decodes what it needs, off the event loop)."""
    items: list[MediaItem] = []
    for kind in MODALITIES:
        value = _value(request, kind)
        if value is None:
            continue
        values = np.asarray(value).reshape(-1)
        check_count(kind, len(values))
        items += [MediaItem.from_base64(v, i, kind) for i, v in enumerate(values)]
    return items


def output_options(request) -> OutputOptions:
    def flag(name: str) -> bool:
        value = _first(request, name)
        return False if value is None else bool(value)

    return OutputOptions(**{f: flag(f) for f in OutputOptions.__dataclass_fields__})


def record_output(spec: StageSpec, record: bytes | None) -> dict[str, np.ndarray]:
    """The stage's record as its STRING[1] output; an empty one when there is nothing to pass on."""
    return {RECORD_TENSOR[spec.hands_on]: np.array([record or b""], dtype=np.object_)}


class Admission:
    """At most ``limit`` requests in a worker at once: one more is refused at once (503 with Retry-After)
    rather than queued, so overload shows up as a quick retryable error, not as memory and latency growth."""

    def __init__(self, stage: str, limit: int) -> None:
        self.stage, self.limit, self.inflight = stage, limit, 0

    def enter(self) -> None:
        if self.inflight >= self.limit:
            raise Unavailable(
                f"the {self.stage} stage has {self.inflight} requests in flight, its limit (max_inflight); retry later"
            )
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1


# -- the record hand-off: E/P/D's embeddings record, from the encode worker straight to the prefill worker ---------
# Without it the record goes encode worker -> scheduler -> prefill worker: the encode's answer, the scheduler's turn
# and the prefill call's way in, each a process hand-off (`make bench-hops`). With it the scheduler posts the prefill
# call beside the encode call (its `Call.await_record`: a token instead of the record) and tells the encode worker
# where the record goes (the encode call's `hand_to`). The encode worker writes the record to that prefill worker's
# stage socket (a `Deliver` message) before it answers the scheduler, and the prefill call, waiting for it before it
# takes its slot, then runs as if it had brought the record itself.
#
# Who frees what: a delivered record belongs to the prefill worker's `Inbox`, which reads it (the call waiting for
# it) or discards it (its producer frees it at once): a record whose call does not come within `EARLY_S`, one pushed
# out of a full inbox, or one whose token was withdrawn. The scheduler withdraws (a `Withdraw` message) every posted
# call whose record will not come: the encode failed, or did not hand the record on (a prompt short enough for the
# decode worker to prefill, or no socket to write to). A call whose token was withdrawn or whose record was
# discarded fails at once (503); one that waits longer than `WAIT_S` fails too, a backstop only.
#
# The two fields are honoured only on a worker's stage socket: the stub's connection, which carries the calls of
# Triton's clients, clears them, so no client can make a prefill call wait or an encode worker hand its record
# elsewhere; they are still checked (a token's length, a target that is a prefill instance).
EARLY_S = 30.0  # how long a record waits for its call (the two come on different sockets, in either order)
WAIT_S = 300.0  # how long a call waits for its record at most (the scheduler withdraws it before, as a rule)
MAX_EARLY = 64  # records waiting for their calls; one more pushes the oldest out
MAX_REFUSED = 4096  # tokens remembered as refused (each for EARLY_S); one more forgets the oldest
MAX_TOKEN = 64  # characters of a token


def check_hand_to(hand: HandTo) -> HandTo:
    """An encode call's :class:`~trident.core.protocol.HandTo`, checked: a prefill instance's name and a token."""
    parsed = parse_instance(hand.instance)
    if parsed is None or parsed[0] != "prefill":
        raise InvalidRequest(f"hand_to names {hand.instance!r}, not a prefill stage instance")
    check_token(hand.token)
    return hand


def check_token(token: str) -> str:
    if not token or len(token) > MAX_TOKEN:
        raise InvalidRequest(f"a record token must be 1-{MAX_TOKEN} characters")
    return token


async def hand_on(calls, hand: HandTo, record: bytes) -> bool:
    """The encode worker's side: write ``record`` to ``hand.instance``'s worker (``calls``: a
    :class:`~trident.core.stagecall.StageClient`) when the prompt is long enough for a prefill worker. True
    when written: the prefill worker's inbox has it from then on (its answer is not waited for: that worker's
    event loop may be in a prefill for the next 100 ms, and this encode worker has the next image to encode)."""
    if sum(decode_record(record, EmbeddingsRecord).token_counts) <= hand.above:
        return False
    return await calls.deliver(hand.instance, hand.token, record)


class Inbox:
    """The prefill worker's side: records delivered for posted calls, and the calls waiting for them, by token.
    ``discard(record)`` frees a record no call will read. Runs on one event loop."""

    def __init__(self, discard: Callable[[bytes], None]) -> None:
        self._discard = discard
        self._calls: dict[str, asyncio.Future] = {}
        self._records: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # token -> (record, when it goes)
        self._refused: OrderedDict[str, float] = OrderedDict()  # token -> when it goes: withdrawn, or freed unread
        self.delivered = self.withdrawn = self.discarded = 0

    def deliver(self, token: str, record: bytes) -> None:
        """A record for ``token``'s call: to the call if it waits, else kept for it (the inbox owns it either way)."""
        self._expire()
        self.delivered += 1
        call = self._calls.pop(check_token(token), None)
        if call is not None and not call.done():
            call.set_result(record)
            return
        if token in self._records or token in self._refused:  # a second record under one token, or a refused one
            self._drop(record)
            return
        if len(self._records) >= MAX_EARLY:  # push the oldest out
            oldest, (dropped, _) = self._records.popitem(last=False)
            self._drop(dropped)
            self._refuse(oldest)
        self._records[token] = (record, time.monotonic() + EARLY_S)
        asyncio.get_running_loop().call_later(EARLY_S + 0.1, self._expire)  # even if nothing else comes

    def withdraw(self, token: str) -> None:
        """``token``'s call gets no record: it fails at once, or when it comes."""
        self._expire()
        self.withdrawn += 1
        call = self._calls.pop(check_token(token), None)
        if call is not None and not call.done():
            call.set_exception(Unavailable("the record this prefill call waited for will not come (withdrawn)"))
            return
        if token in self._records:
            self._drop(self._records.pop(token)[0])
        self._refuse(token)

    async def take(self, token: str, wait_s: float = WAIT_S) -> bytes:
        """``token``'s record, once delivered."""
        self._expire()
        if check_token(token) in self._records:
            return self._records.pop(token)[0]
        if self._refused.pop(token, None) is not None:
            raise Unavailable("the record this prefill call waits for will not come (withdrawn, or pushed out "
                              "of a full inbox)")
        if token in self._calls:
            raise InvalidRequest("another prefill call waits on this record token")
        call = self._calls[token] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(asyncio.shield(call), wait_s)
        except asyncio.TimeoutError:
            self._refuse(token)  # a record that comes now is freed at once
            raise Unavailable(f"no record came for this prefill call within {wait_s:.0f} s") from None
        except asyncio.CancelledError:  # the call went away (its connection closed, the worker stops)
            if call.done() and not call.cancelled() and call.exception() is None:
                self._drop(call.result())  # delivered as it went: nobody will read it
            else:
                self._refuse(token)
            raise
        finally:
            if self._calls.get(token) is call:
                del self._calls[token]

    def stats(self) -> dict:
        return {"delivered": self.delivered, "withdrawn": self.withdrawn, "discarded": self.discarded,
                "waiting_calls": len(self._calls), "early_records": len(self._records)}

    def _refuse(self, token: str) -> None:
        """Remember ``token`` as refused for :data:`EARLY_S` (at most :data:`MAX_REFUSED` tokens: the oldest go)."""
        self._refused.pop(token, None)
        while len(self._refused) >= MAX_REFUSED:
            self._refused.popitem(last=False)
        self._refused[token] = time.monotonic() + EARLY_S

    def _expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, (_, deadline) in self._records.items() if deadline <= now]:
            self._drop(self._records.pop(token)[0])
        for token in [t for t, deadline in self._refused.items() if deadline <= now]:
            del self._refused[token]

    def _drop(self, record: bytes) -> None:
        self.discarded += 1
        try:
            self._discard(record)
        except TridentError:  # not a record of ours to free: nothing to give back
            pass


# -- the stage handler ---------------------------------------------------------------------------------------------
async def _await_record(inbox: Inbox, call: Call) -> None:
    """Before a prefill call posted ahead of its record takes its slot: its record, from ``inbox`` once the encode
    worker has delivered it."""
    embeddings = RECORD_TENSOR["embeddings"]
    if call.await_record is not None:
        token = check_token(call.await_record)
        if record_input(call, embeddings) is not None:
            raise InvalidRequest(f"a prefill call waiting for its record (await_record) brings no {embeddings}")
        with tracing.step("await_record"):
            record = await inbox.take(token)
        call.inputs[embeddings] = np.array([record], dtype=np.object_)


@dataclass
class StageHandler:
    """A stage's handling in its worker: ``infer``, the stage function (one answer, or a stream for a stage that
    hands on tokens), and the hooks the worker's stage server calls: :meth:`entry` around a one-answer call,
    before it takes its slot, and :meth:`control` for each control message."""

    spec: StageSpec
    infer: Callable
    admission: Callable[[Call], None] | None = None  # a one-answer stage's: counts a call in, or refuses it
    leave: Callable[[], None] | None = None  # ... and out
    inbox: Inbox | None = None  # a prefill stage's records delivered by the encode worker
    streams: Streams | None = None  # a streaming stage's streams, by the scheduler's request id
    counters: Callable[[], dict] | None = None  # the engine's (``StageEngine.stats``)
    claims: Callable[[str, bool], None] | None = None  # a producer's: consumers claim what its records point to

    @contextlib.asynccontextmanager
    async def entry(self, call: Call):
        """What a one-answer call goes through before it waits for a slot (``at_most``): it is counted in, or
        refused at once past ``max_inflight`` (503, not queued); a prefill call posted ahead of its record waits
        for it here. It is counted out when it ends."""
        try:
            self.admission(call)
        except Unavailable:
            if self.inbox is not None and call.await_record is not None:  # its record is freed when it comes
                self.inbox.withdraw(call.await_record)
            raise
        try:
            if self.inbox is not None:
                await _await_record(self.inbox, call)
            yield
        finally:
            self.leave()

    def stats(self) -> dict:
        """The worker's counters: its engine's (transfers, decode, caches), its record inbox's (``handoff_*``)
        and its pid; what the stage model's metrics and the worker's stats file show."""
        out = dict(self.counters()) if self.counters is not None else {}
        if self.inbox is not None:
            out.update({f"handoff_{k}": v for k, v in self.inbox.stats().items()})
        out["pid"] = os.getpid()
        # plain numbers, as a stage message carries them (a setting's ``ByteSize`` is an int of its own class)
        return {k: float(v) if isinstance(v, float) else int(v) if isinstance(v, int) and not isinstance(v, bool) else v
                for k, v in out.items()}

    def control(self, message: Control) -> dict | None:
        """A control message from a caller on the stage socket (:data:`trident.core.protocol.Control`); a
        :class:`~trident.core.protocol.Stats` is answered with :meth:`stats`."""
        if isinstance(message, Stats):
            return self.stats()
        if isinstance(message, Cancel) and self.streams is not None:
            self.streams.cancel(message.request_id)
        elif isinstance(message, Deliver) and self.inbox is not None:
            self.inbox.deliver(message.token, message.record)
        elif isinstance(message, Withdraw) and self.inbox is not None:
            self.inbox.withdraw(message.token)
        elif isinstance(message, Claim) and self.claims is not None:
            self.claims(message.claim, message.lease)
        else:
            raise InvalidRequest(f"the {self.spec.name} stage takes no {type(message).__name__} message")


def _claims(engine) -> Callable[[str, bool], None]:
    """A producer's answer to its consumers' claims (:class:`~trident.core.protocol.Claim`): a transfer lease of its
    endpoint's, or the vllm engine's KV claim."""

    def take(claim: str, lease: bool) -> None:
        endpoint = getattr(engine, "endpoint", None)
        if lease and endpoint is not None:
            endpoint.sender.take(claim)
        elif not lease and engine.kv_claims is not None:
            engine.kv_claims.take(claim)
        else:
            raise ReplayedRecord("this worker holds no such record; a record is good for one read")

    return take


def make_handler(spec: StageSpec, engine, max_inflight: int = 64) -> StageHandler:
    """The :class:`StageHandler` of ``spec`` over ``engine``. The encode stage finds the prefill worker it hands a
    record to in the stage directory (:mod:`trident.core.stagecall.directory`, the record hand-off above)."""
    names = spec.input_names
    admission = Admission(spec.name, max_inflight)
    record_names = [RECORD_TENSOR[kind] for kind in (spec.takes, spec.also_takes) if kind is not None]

    def admit(request) -> None:
        """Count the request in, or refuse it (a record it brought is discarded: its producer frees it now)."""
        try:
            admission.enter()
        except Unavailable:
            for name in record_names:
                if (record := record_input(request, name)) is not None:
                    engine.discard(record)
            raise

    async def read(request) -> tuple[str | None, SamplingParams, dict]:
        """The request's text, sampling parameters and engine arguments; a record it brought is discarded
        when the request is refused here."""
        with tracing.step("inputs"):
            return await _read(request)

    async def _read(request) -> tuple[str | None, SamplingParams, dict]:
        kwargs: dict = {}
        records = {name: r for name in record_names if (r := record_input(request, name)) is not None}
        try:
            text = text_input(request, required=spec.takes != "kv") if "text_input" in names else None
            if spec.takes == "kv" and RECORD_TENSOR["kv"] not in records:
                if spec.also_takes is None:
                    raise InvalidRequest("kv_meta is required")
                if text is None:
                    raise InvalidRequest("kv_meta, or text_input to prefill here, is required")
            if len(records) > 1:
                raise InvalidRequest(f"send one of {' or '.join(record_names)}, not both")
            params = SamplingParams.from_json(_first(request, "sampling_parameters"))
            if "image" in names:
                kwargs["media"] = media_items(request)
        except Exception:
            for record in records.values():  # refused before the engine saw it: the producer may free it now
                engine.discard(record)
            raise
        kwargs.update(records)
        return text, params, kwargs

    if spec.hands_on == "embeddings":
        calls = None  # to the prefill workers records are handed to, opened on first use

        async def encode(request):
            nonlocal calls
            t0 = time.monotonic_ns()
            _, _, kwargs = await read(request)
            hand = check_hand_to(request.hand_to) if request.hand_to is not None else None
            items = kwargs["media"]
            # a text-only request through an ensemble: nothing to encode, the next stage gets an empty record
            private = _parameter(request, EMBEDDING_SCOPE) == "request"  # (the scheduler's: see EMBEDDING_SCOPE)
            encoded = await engine.encode(items, private=private) if items else None
            report = dict(encoded.report) if encoded else {}
            if hand is not None:
                handed = False
                if encoded is not None:
                    from trident.core.stagecall import StageClient

                    calls = calls or StageClient()
                    with tracing.step("hand_on"):
                        handed = await hand_on(calls, hand, encoded.record)
                report["handed"] = handed
            outputs = record_output(spec, encoded.record if encoded else None)
            outputs[ENCODE_REPORT] = np.array([json.dumps(report).encode()], dtype=np.object_)
            tracing.mark("infer", t0)
            return outputs

        return StageHandler(spec, encode, admit, admission.leave, counters=engine.stats, claims=_claims(engine))

    if spec.hands_on == "kv":
        async def prefill(request):
            t0 = time.monotonic_ns()
            text, params, kwargs = await read(request)
            outputs = record_output(spec, await engine.prefill(text, params, **kwargs))
            tracing.mark("infer", t0)
            return outputs

        inbox = Inbox(engine.discard) if spec.takes == "embeddings" else None
        return StageHandler(spec, prefill, admit, admission.leave, inbox=inbox, counters=engine.stats,
                            claims=_claims(engine))

    streams = Streams()

    async def generate(request: Call):
        t0, first = time.monotonic_ns(), True
        admit(request)
        try:
            text, params, kwargs = await read(request)
            opts = output_options(request)
            generation = await engine.generate(text, params, **kwargs)
            responses = entry_responses(generation, opts, None if opts.exclude_input_in_output else text, params.n)
            async for item in streams.relay(_parameter(request, REQUEST_ID), responses):
                if first:
                    tracing.mark("infer_first", t0)
                    first = False
                yield item
        finally:
            admission.leave()
        tracing.mark("infer", t0)

    return StageHandler(spec, generate, streams=streams, counters=engine.stats)
