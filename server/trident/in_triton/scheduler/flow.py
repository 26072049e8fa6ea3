"""One request's way through its mode, apart from Triton: Trident's scheduler.

Per request, :meth:`RequestFlow.serve`:
1. reads the entry tensors (the vLLM backend's interface) and the media's content ids (:mod:`.request`);
2. plans the path (:mod:`.routing`): its mode's chain, without ``encode`` for a text-only request, with the
   encode on a prefill worker for few media items, or a fallback mode when a stage has no live instance;
3. calls each stage on an instance the router picks, straight at the instance's worker, passing on only the
   records; in E/P/D the prefill call is posted beside the encode call and the encode worker hands its record
   straight to the prefill worker; a short prompt is prefilled on the decode worker (no prefill hop, no KV
   transfer);
4. streams the last stage's responses through (:mod:`.relay`), stopping when the client cancels; a streaming
   client gets its first text as soon as the prefill's ``kv_meta`` tells it, before the decode call;
5. plans the request again when a stage instance went away before the client had anything, and moves it when it
   went away mid-stream (migration, up to ``scheduling.migration_limit``).

It talks to two small interfaces: a :class:`StageCaller` (:class:`trident.core.stagecall.StageClient`) and, per request,
a :class:`Responder` (Triton's response sender in :mod:`.model`, the python-backend adapter). It imports nothing of
Triton; tests/unit/test_request_flow.py drives it with fakes of both.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import numpy as np

from trident.core import drain, tracing
from trident.core.config import SchedulerConfig
from trident.core.errors import Cancelled, TridentError, Unavailable, WorkerLost, as_trident_error
from trident.core.protocol import (
    EMBEDDING_SCOPE, ENCODE_REPORT, ENTRY_OUTPUTS, MODES, RECORD_TENSOR, REQUEST_ID, STAGES, EmbeddingsRecord, HandTo,
    decode_record, instance_name,
)
from trident.in_triton.scheduler.engine_metrics import Answered
from trident.in_triton.scheduler.instances import Instances
from trident.core.prompt_length import PromptLength, text_bytes_limit
from trident.in_triton.scheduler.relay import Migrate, StageGone, relay, send_early
from trident.in_triton.scheduler.request import EntryRequest
from trident.in_triton.scheduler.routing import FALLBACK, LOCAL_ENCODE, Plan, Router, needs_prompt_length, plan, with_local_prefill

MAX_OPEN = 256  # requests an entry model serves at once (each stream has a relay thread); one more gets a 503
DRAIN_POLL_S = 0.1  # how often an entry model looks whether the server drains, and then whether it has drained
_ENTRY_OUTPUT_NAMES = [t.name for t in ENTRY_OUTPUTS]
# outputs the last stage always sends on its last response (the scheduler needs them), passed on only where the
# client asked for them: {flag: output}
_ALWAYS_ASKED = {"return_finish_reason": "finish_reason", "return_num_input_tokens": "num_input_tokens",
                 "return_num_output_tokens": "num_output_tokens"}


class Responder(Protocol):
    """One request's way back to its client."""

    def send(self, outputs: dict[str, np.ndarray]) -> None:
        """One response of the answer."""

    def end(self, error: TridentError | None = None) -> None:
        """The request's last response: ``error``, or none (the answer is complete)."""

    def cancelled(self) -> bool:
        """Whether the client has gone."""


class StageCaller(Protocol):
    """Calls to stage instances (:class:`trident.core.stagecall.StageClient`)."""

    async def call(self, instance: str, inputs: dict[str, np.ndarray], outputs: list[str], parameters: dict | None = None,
                   hand_to: HandTo | None = None, await_record: str | None = None,
                   timeout_s: float | None = None) -> dict[str, np.ndarray] | None: ...

    async def stream(self, instance: str, inputs: dict[str, np.ndarray], outputs: list[str],
                     parameters: dict) -> Iterator | None:
        """The stage's responses as data (:func:`trident.core.stagecall.responses_of`), for a thread to iterate."""

    async def cancel(self, instance: str, request_id: str) -> None: ...

    async def withdraw(self, instance: str, token: str) -> bool: ...

    def close(self) -> None: ...


class Log(Protocol):
    """Where the flow's lines go (``pb_utils.Logger`` in Triton)."""

    def log_info(self, message: str) -> None: ...

    def log_warn(self, message: str) -> None: ...

    def log_error(self, message: str) -> None: ...

    def log_verbose(self, message: str) -> None: ...


@dataclass
class _Posted:
    """A prefill call posted beside the encode call, waiting for the record the encode worker hands it
    (the record hand-off in :mod:`trident.worker.infer`)."""

    instance: str
    token: str
    hand_to: HandTo  # where the encode call's record goes
    call: asyncio.Future  # the call's outputs (arrays), or None when its worker did not take it


class RequestFlow:
    """The requests of one entry model (``mode``)."""

    def __init__(self, mode: str, cfg: SchedulerConfig, stages: StageCaller, instances: Instances, router: Router,
                 metrics: Any, observe: Callable[[Answered], None], log: Log, model_path: str | None = None) -> None:
        self.mode, self.cfg, self.stages, self.instances, self.router = mode, cfg, stages, instances, router
        self.metrics, self._observe, self.log = metrics, observe, log
        # the checkpoint's tokenizer (``model_path``) bounds the prompt's text, and measures prompts for local prefill
        self._text_limit = text_bytes_limit(model_path) if model_path else None
        self._measure: PromptLength | None = None
        if cfg.local_prefill_tokens and model_path and any("decode" in MODES[m] for m in FALLBACK[mode]):
            self._measure = PromptLength(model_path)
        self._streams = ThreadPoolExecutor(max_workers=MAX_OPEN, thread_name_prefix="trident-bls-stream")
        self.open = 0  # requests being served
        self._closed = threading.Event()  # set by close(): watch_drain ends

    @staticmethod
    def stages_of(mode: str) -> list[str]:
        """The stages an entry model of ``mode`` may call (its own, and its fallback modes')."""
        return sorted({s for m in FALLBACK[mode] for s in MODES[m] + LOCAL_ENCODE.get(m, ())})

    def check_route(self) -> None:
        """Raise unless a request with media would be served now: the plan (this mode's stages, or a fallback
        mode's) has a live instance of every stage it calls."""
        self.instances.refresh(force=True)
        live = self.instances.stages()
        if plan(self.mode, 1, live, self.cfg.local_encode_images) is None:
            missing = sorted(set(MODES[self.mode]) - live)
            raise RuntimeError(f"{self.mode}: no live instance of stage(s) {', '.join(missing)}; start their workers, "
                               f"then load {self.mode}")

    def watch_drain(self) -> None:
        """Once the server drains (:mod:`trident.core.drain`): say when this entry model has no request left in flight."""
        while not drain.draining():
            if self._closed.wait(DRAIN_POLL_S):
                return
        while self.open:
            if self._closed.wait(DRAIN_POLL_S):
                return
        drain.mark_drained(self.mode)

    def close(self) -> None:
        """The entry model unloads: its threads end here, before its stub's Python does (a thread left running while
        the embedded interpreter finalizes is a way for the stub to crash on its way out, which takes Triton down)."""
        self._closed.set()
        self.stages.close()
        self._streams.shutdown(wait=False, cancel_futures=True)

    def _line(self, text: str) -> str:
        return f"[trident] {self.mode}: {text}"

    # -- a request -----------------------------------------------------------------------------------------
    async def serve(self, inputs: dict[str, np.ndarray], responder: Responder, arrived_ns: int,
                    traceparent: str | None = None) -> None:
        """Serve one request, its entry tensors ``inputs``, answering through ``responder``; never raises."""
        with tracing.request("request", traceparent, mode=self.mode):
            tracing.mark("execute", arrived_ns)
            if drain.draining():
                return self._refuse(responder, Unavailable(
                    "the server is shutting down: it serves the requests it has and takes no new ones; retry on "
                    "another replica"))
            if self.open >= MAX_OPEN:  # each holds a relay thread for its stream: one more would wait for one, unseen
                return self._refuse(responder, Unavailable(
                    f"the {self.mode} mode has {self.open} requests in flight, its limit; retry later"))
            # its metric updates are held until its first response is out
            req = EntryRequest(responder, self.metrics.held(asyncio.get_running_loop()), arrived_ns=arrived_ns)
            self.open += 1
            try:
                with tracing.step("inputs"):
                    req.read(inputs, self._text_limit)
                await self._run(req)
            except Exception as e:  # a bug here must not leave the client waiting (nor show it the bug's text)
                error = as_trident_error(e, log=False)
                if not isinstance(e, TridentError):
                    self.log.log_error(self._line(f"scheduler failed: {type(e).__name__}: {e} ({error.message})"))
                self.metrics.add("trident_scheduler_errors_total", code=error.triton_code)
                responder.end(error)
            finally:
                self.open -= 1
                if req.answered is not None and req.first_ns is not None:
                    prompt, generated, last, responses = req.answered
                    req.held.later(self._observe, Answered(prompt, generated, (req.first_ns - arrived_ns) / 1e9,
                                                           (last - arrived_ns) / 1e9, responses, req.n))
                req.held.apply()

    def _refuse(self, responder: Responder, error: Unavailable) -> None:
        """Answer with ``error`` at once, before anything of the request is read."""
        self.metrics.add("trident_scheduler_errors_total", code=error.triton_code)
        responder.end(error)

    def _plan(self, num_images: int) -> Plan:
        self.instances.refresh()
        p = plan(self.mode, num_images, self.instances.stages(), self.cfg.local_encode_images)
        if p is None:
            self.instances.refresh(force=True)
            p = plan(self.mode, num_images, self.instances.stages(), self.cfg.local_encode_images)
        if p is None:
            needed = " or ".join("+".join(MODES[m]) for m in FALLBACK[self.mode])
            raise Unavailable(f"the {self.mode} mode has no live stage instances (it needs {needed})")
        return p

    async def _run(self, req: EntryRequest) -> None:
        """The request's attempts: planned again when an instance went away before the client had anything
        (up to 3 times), moved when one went away mid-stream (up to ``migration_limit`` times)."""
        retries, moved = 3, None
        while True:
            try:
                p = self._plan(len(req.image_ids))
            except Unavailable as e:
                if moved is None:
                    raise
                raise Unavailable(f"{moved.message.removeprefix('WorkerLost: ')}; the request could not move on: "
                                  f"{e.message}") from None
            try:
                await self._follow(p, req)
                return
            except StageGone as gone:
                retries -= 1
                self.instances.mark_gone(str(gone))
                if retries == 0:
                    raise Unavailable(f"stage instance {gone} went away while serving the request") from None
                self.instances.refresh(force=True)
            except Migrate as move:
                self.instances.mark_gone(move.instance)
                if req.migrations >= self.cfg.migration_limit:
                    raise Unavailable(f"stage instance {move.instance} stopped before the end of the answer (its "
                                      f"worker exited or was cut off), after {req.migrations} migration(s) "
                                      "(scheduling.migration_limit)") from None
                req.migrations, moved = req.migrations + 1, move
                self.metrics.add("trident_migrations_total", stage=move.stage, reason=move.reason)
                tracing.mark(f"migration:{move.stage}", time.monotonic_ns())
                self.log.log_warn(self._line(f"{move.instance} went away mid-stream ({move.reason}); moving the "
                                             f"request (migration {req.migrations}), {req.sent_tokens} token(s) "
                                             "already sent"))
                self.instances.refresh(force=True)

    async def _follow(self, p: Plan, req: EntryRequest) -> None:
        """One attempt at the request along plan ``p``."""
        records = req.records = {}
        stages = list(p.stages)
        embeddings = RECORD_TENSOR["embeddings"]
        posted = None
        if stages[0] == "encode":
            posted = await self._post_prefill(p, req)
            try:
                outputs = await self._call("encode", req, [embeddings, ENCODE_REPORT],
                                           posted.hand_to if posted else None, keys=req.image_ids)
            except BaseException:
                if posted is not None:
                    await self._withdraw(posted)
                raise
            records[embeddings] = outputs[embeddings]
            stages.pop(0)
            if posted is not None and not json.loads(outputs[ENCODE_REPORT] or b"{}").get("handed"):
                await self._withdraw(posted)
                posted = None
        if posted is None and needs_prompt_length(p, self.cfg.local_prefill_tokens):  # (a handed record: too long)
            token_counts = decode_record(records[embeddings], EmbeddingsRecord).token_counts if embeddings in records else []
            length = await self._prompt_length(req, token_counts)
            if length is not None:
                p = with_local_prefill(p, length, self.cfg.local_prefill_tokens, bool(req.image_ids))
                stages = [s for s in p.stages if s != "encode"]
        req.held.request(p.path, p.decisions, p.runs_as)
        req.held.later(self.log.log_verbose, f"[trident] {self.mode} request: path {p.path} {' '.join(p.decisions)}".rstrip())
        for stage in stages[:-1]:  # record stages
            out = RECORD_TENSOR[STAGES[stage].hands_on]
            if posted is not None and stage == "prefill":  # running since the record came: no cancel check here
                # (a client gone now still has its KV freed at once: see _stream)
                arrays = await posted.call
                if arrays is None:  # its worker did not take the call (stopping): plan the request again
                    raise StageGone(posted.instance)
                records[out] = _bytes_of(arrays, [out])[out]
                continue
            if req.cancelled():
                return _cancelled(req)
            outputs = await self._call(stage, req, [out])
            records[out] = outputs[out]
        await self._stream(stages[-1], req, p)

    async def _post_prefill(self, p: Plan, req: EntryRequest) -> _Posted | None:
        """E/P/D: the prefill call, posted now, to wait on its worker for the record the encode worker will hand it
        (the encode's answer, this model's turn and the prefill call's way in are then off the path). The encode
        worker hands it on only for a prompt too long for the decode worker to prefill (``local_prefill_tokens``):
        more embedding rows than ``above``."""
        if list(p.stages[:2]) != ["encode", "prefill"]:
            return None
        above = -1
        if needs_prompt_length(p, self.cfg.local_prefill_tokens):
            text_tokens = await self._prompt_length(req, [0] * len(req.kinds))  # less its media's rows
            if text_tokens is not None:
                above = self.cfg.local_prefill_tokens - text_tokens
        instance = self._route("prefill", req.keys, req.held)
        token = uuid.uuid4().hex
        call = asyncio.ensure_future(self._posted_call(instance, req.inputs, token, req.held))
        return _Posted(instance, token, HandTo(instance, token, above), call)

    async def _posted_call(self, instance: str, inputs: dict, token: str, held) -> dict | None:
        out = RECORD_TENSOR["kv"]
        self._begin("prefill", instance, held)
        try:
            with tracing.step("call:prefill"):
                return await self.stages.call(instance, _arrays("prefill", inputs, None), [out], await_record=token,
                                              timeout_s=self.cfg.stage_timeout_s)
        except WorkerLost:
            return None  # (its worker went away mid-call: the request is planned again)
        finally:
            self._end("prefill", instance, held)

    async def _withdraw(self, posted: _Posted) -> None:
        """The posted prefill call gets no record: its worker ends it (its error is nobody's)."""
        posted.call.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await self.stages.withdraw(posted.instance, posted.token)
        except Exception as e:  # the call still ends, at the latest when its wait does
            self.log.log_warn(self._line(f"could not withdraw a prefill call on {posted.instance}: {e}"))

    async def _prompt_length(self, req: EntryRequest, token_counts: list[int]) -> int | None:
        """The prompt's token count with media expanded; None when it cannot be told here (the stage that
        prefills will name the problem). Its text is encoded once, off the event loop."""
        if self._measure is None or (req.kinds and not token_counts):
            return None
        if req.text_ids is None:
            req.text_ids = await asyncio.to_thread(self._measure.ids, req.text)
        return self._measure.count(req.text_ids, token_counts, req.kinds)

    # -- stage calls -------------------------------------------------------------------------------------
    def _route(self, stage: str, keys: list[str], held) -> str:
        instances = self.instances.live.get(stage) or []
        if not instances:
            raise StageGone(instance_name(stage, 1))
        instance, _ = self.router.choose(stage, instances, keys)
        held.add("trident_routed_total", stage=stage, instance=instance)
        return instance

    def _begin(self, stage: str, instance: str, held) -> None:
        """A call of ``instance`` begins: counted in flight (the gauge is set with ``held``'s updates)."""
        self.router.begin(instance)
        held.later(self._inflight_gauge, stage, instance)

    def _end(self, stage: str, instance: str, held) -> None:
        self.router.end(instance)
        held.later(self._inflight_gauge, stage, instance)

    def _inflight_gauge(self, stage: str, instance: str) -> None:
        """``trident_stage_inflight`` of ``instance``: its calls in flight from this entry model when it is set."""
        self.metrics.set("trident_stage_inflight", self.router.inflight.get(instance, 0), stage=stage, instance=instance)

    async def _call(self, stage: str, req: EntryRequest, outputs: list[str], hand_to: HandTo | None = None,
                    keys: list[str] | None = None) -> dict:
        """One non-streaming stage call for ``req`` (routed by ``keys``, default its prefix keys); its outputs as
        bytes."""
        held = req.held
        instance = self._route(stage, req.keys if keys is None else keys, held)
        record = _record_for(stage, req.records)
        private = stage == "encode" and self.cfg.embedding_cache_scope == "request"
        self._begin(stage, instance, held)
        try:
            with tracing.step(f"call:{stage}"):
                arrays = await self.stages.call(instance, _arrays(stage, req.inputs, record), outputs,
                                                {EMBEDDING_SCOPE: "request"} if private else None, hand_to=hand_to,
                                                timeout_s=self.cfg.stage_timeout_s)
        except WorkerLost:  # mid-call: nothing of the answer was out, the request is planned again elsewhere
            raise StageGone(instance) from None
        finally:
            self._end(stage, instance, held)
        if arrays is None:
            raise StageGone(instance)
        result = _bytes_of(arrays, outputs)
        if stage == "encode" and result.get(ENCODE_REPORT):
            held.encode_report(instance, json.loads(result[ENCODE_REPORT]))
        return result

    async def _stream(self, stage: str, req: EntryRequest, p: Plan) -> None:
        """Call the stage that hands on tokens and pass its responses to the client as they come; the first text
        goes out before the call when the prefill's record tells it (once per request: an attempt after a stage
        instance went away finds it sent)."""
        record = _record_for(stage, req.records, p.local_prefill)  # a decode prefilling: the embeddings
        if req.early is None and not req.sent_responses:  # before anything else: this text is the client's first token
            req.early = send_early(record, req)
        instance = self._route(stage, req.keys, req.held)
        request_id = uuid.uuid4().hex
        self._begin(stage, instance, req.held)
        # the stage always says why it stopped (a stream that ends without a finish_reason was cut off) and how many
        # tokens the answer took (the vllm:* metrics count them)
        unasked = {out for flag, out in _ALWAYS_ASKED.items() if not req.asked(flag)}
        inputs = {**req.inputs, **{flag: np.array([True]) for flag in _ALWAYS_ASKED}}
        try:
            # with the first text out, or a prefill's KV in hand, the decode is called even if the client has gone
            # (a check here would be an IPC round trip before that text; dropped, the KV would wait for its lease):
            # the relay's cancel check at the decode's first response then stops the decode stage, which frees
            # the prefill's KV at once
            holds_kv = record is not None and record[0] == RECORD_TENSOR["kv"]
            if req.early is None and not holds_kv and req.cancelled():
                return _cancelled(req)
            t0 = time.monotonic_ns()
            stream = await self.stages.stream(instance, _arrays(stage, inputs, record), _ENTRY_OUTPUT_NAMES,
                                              {REQUEST_ID: request_id})
            if stream is None:
                raise StageGone(instance)
            log_error = lambda text: self.log.log_error(self._line(text))  # noqa: E731
            outcome = await asyncio.get_running_loop().run_in_executor(
                self._streams, tracing.carry(relay), stream, instance, req, unasked, log_error, f"call:{stage}", t0)
            if outcome == "cancelled":
                await self._cancel_stream(stage, instance, request_id)
                _cancelled(req)
        finally:
            self._end(stage, instance, req.held)

    async def _cancel_stream(self, stage: str, instance: str, request_id: str) -> None:
        """Stop a stage's stream whose client went away (a :class:`~trident.core.protocol.Cancel` message)."""
        try:
            await self.stages.cancel(instance, request_id)
        except Exception as e:  # the stream still ends with its max_tokens
            self.log.log_warn(self._line(f"could not cancel a {stage} stream on {instance}: {e}"))


def _cancelled(req: EntryRequest) -> None:
    req.responder.end(Cancelled("request cancelled"))


def _record_for(stage: str, records: dict[str, bytes], local_prefill: bool = False) -> tuple[str, bytes] | None:
    """The one record a stage gets: what it takes (a decode stage prefilling itself: the embeddings)."""
    kind = "embeddings" if local_prefill else STAGES[stage].takes
    name = RECORD_TENSOR.get(kind) if kind else None
    return (name, records[name]) if name in records else None


def _arrays(stage: str, inputs: dict[str, np.ndarray], record: tuple[str, bytes] | None) -> dict[str, np.ndarray]:
    """The inputs ``stage`` takes, in its order: the record it takes (a STRING[1] array), else the entry's tensor
    of that name as it came."""
    out = {}
    for name in STAGES[stage].input_names:
        if record is not None and name == record[0]:
            out[name] = np.array([record[1]], dtype=np.object_)
        elif name in inputs:
            out[name] = inputs[name]
    return out


def _bytes_of(arrays: dict, outputs: list[str]) -> dict[str, bytes]:
    """A one-answer stage's STRING[1] outputs as bytes (b"" where absent)."""
    result = {}
    for name in outputs:
        value = arrays[name].reshape(-1)[0] if name in arrays else b""
        result[name] = value if isinstance(value, bytes) else str(value).encode()
    return result
