"""A stage model's inference function: a :class:`~trident.protocol.Call` -> engine call -> its outputs.

What a stage does follows from what it hands on (:attr:`~trident.protocol.StageSpec.hands_on`):
``embeddings`` -> :meth:`encode`, ``kv`` -> :meth:`prefill`, ``tokens`` -> :meth:`generate` (streamed);
its inputs say which of ``text_input``, the media (``image``, ``video``, ``audio``), ``embedding_meta`` and
``kv_meta`` it reads. The decode
stage takes ``kv_meta``, or a short prompt with its ``embedding_meta`` that it prefills itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import tracing
from ..errors import InvalidRequest, Unavailable
from ..media import MODALITIES, MediaItem, check_count
from ..output import OutputOptions, entry_responses
from ..processor import SamplingParams
from ..protocol import (
    ENCODE_REPORT, RECORD_TENSOR, REQUEST_ID, Call, Cancel, Claim, Control, Deliver, StageSpec, Stats, Withdraw,
)
from . import record_handoff



def _parameter(request, name: str) -> str | None:
    value = (getattr(request, "parameters", None) or {}).get(name)
    return str(value) if value not in (None, "") else None


class Streams:
    """The streamed requests of a stage by the scheduler's id, so that a :class:`~trident.protocol.Cancel` message
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


async def _await_record(inbox: record_handoff.Inbox, call: Call) -> None:
    """Before a prefill call posted ahead of its record takes its slot: its record, from ``inbox`` once the encode
    worker has delivered it."""
    embeddings = RECORD_TENSOR["embeddings"]
    if call.await_record is not None:
        token = record_handoff.check_token(call.await_record)
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
    inbox: record_handoff.Inbox | None = None  # a prefill stage's records delivered by the encode worker
    streams: Streams | None = None  # a streaming stage's streams, by the scheduler's request id
    counters: Callable[[], dict] | None = None  # the engine's (``StageEngine.stats``)
    claims: Callable[[str], None] | None = None  # a KV producer's that consumers claim its KV at (the vllm engine's)

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
        """A control message from a caller on the stage socket (:data:`trident.protocol.Control`); a
        :class:`~trident.protocol.Stats` is answered with :meth:`stats`."""
        if isinstance(message, Stats):
            return self.stats()
        if isinstance(message, Cancel) and self.streams is not None:
            self.streams.cancel(message.request_id)
        elif isinstance(message, Deliver) and self.inbox is not None:
            self.inbox.deliver(message.token, message.record)
        elif isinstance(message, Withdraw) and self.inbox is not None:
            self.inbox.withdraw(message.token)
        elif isinstance(message, Claim) and self.claims is not None:
            self.claims(message.claim)
        else:
            raise InvalidRequest(f"the {self.spec.name} stage takes no {type(message).__name__} message")


def make_handler(spec: StageSpec, engine, max_inflight: int = 64) -> StageHandler:
    """The :class:`StageHandler` of ``spec`` over ``engine``. The encode stage finds the prefill worker it hands a
    record to in the stage directory (:mod:`trident.stagecall.directory`, :mod:`.record_handoff`)."""
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
            hand = record_handoff.check_hand_to(request.hand_to) if request.hand_to is not None else None
            items = kwargs["media"]
            # a text-only request through an ensemble: nothing to encode, the next stage gets an empty record
            encoded = await engine.encode(items) if items else None
            report = dict(encoded.report) if encoded else {}
            if hand is not None:
                handed = False
                if encoded is not None:
                    from ..stagecall import StageClient

                    calls = calls or StageClient()
                    with tracing.step("hand_on"):
                        handed = await record_handoff.hand_on(calls, hand, encoded.record)
                report["handed"] = handed
            outputs = record_output(spec, encoded.record if encoded else None)
            outputs[ENCODE_REPORT] = np.array([json.dumps(report).encode()], dtype=np.object_)
            tracing.mark("infer", t0)
            return outputs

        return StageHandler(spec, encode, admit, admission.leave, counters=engine.stats)

    if spec.hands_on == "kv":
        async def prefill(request):
            t0 = time.monotonic_ns()
            text, params, kwargs = await read(request)
            outputs = record_output(spec, await engine.prefill(text, params, **kwargs))
            tracing.mark("infer", t0)
            return outputs

        inbox = record_handoff.Inbox(engine.discard) if spec.takes == "embeddings" else None
        return StageHandler(spec, prefill, admit, admission.leave, inbox=inbox, counters=engine.stats,
                            claims=getattr(engine, "take_claim", None))

    streams = Streams()

    async def generate(request: Call):
        t0, first = time.monotonic_ns(), True
        admit(request)
        try:
            text, params, kwargs = await read(request)
            opts = output_options(request)
            generation = await engine.generate(text, params, **kwargs)
            responses = entry_responses(generation, opts, None if opts.exclude_input_in_output else text)
            async for item in streams.relay(_parameter(request, REQUEST_ID), responses):
                if first:
                    tracing.mark("infer_first", t0)
                    first = False
                yield item
        finally:
            admission.leave()
        tracing.mark("infer", t0)

    return StageHandler(spec, generate, streams=streams, counters=engine.stats)
