"""The BLS entry model of one mode (python backend, decoupled): Trident's scheduler inside Triton.

Per request it:
1. reads the entry tensors (the vLLM backend's interface) and the images' content ids;
2. plans the path (:mod:`.plan`): its mode's chain, without ``encode`` for a text-only request, with the
   encode on a prefill worker for few images, or a fallback mode when a stage has no live instance;
3. calls each stage on an instance the router picks (:mod:`.routing`) in the stage protocol, straight at the
   instance's worker (:mod:`trident.stagecall`), passing on only the records; in E/P/D the prefill call is posted
   beside the encode call and the encode worker hands its record straight to the prefill worker; a short prompt
   is prefilled on the decode worker (no prefill hop, no KV transfer);
4. streams the last stage's responses through, stopping when the client cancels; a streaming client gets its
   first text as soon as the prefill's ``kv_meta`` tells it (``first_text``), before the decode call.

Stage instances are the Triton models ``<stage>`` and ``<stage>-<n>`` that are ready; the scheduler looks
again every ``refresh_s`` and whenever a call finds an instance gone, so workers can join and leave a
running server. Decisions are counted on Triton's metrics port (:mod:`.metrics`) and logged per request at
verbose level (``--log-verbose 1``).

The python backend imports this through the ``model.py`` that :mod:`trident.repository` writes.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import drain, tracing
from ..config import MODEL_ENV, SCHEDULING_ENV, SchedulerConfig
from ..errors import InvalidRequest, TridentError, Unavailable, WorkerLost, as_trident_error, client_message, from_message
from ..media import MODALITIES, check_count, content_id, decode_base64
from ..protocol import (
    ENCODE_REPORT, REQUEST_ID, HandTo, ENTRY_INPUTS, ENTRY_OUTPUTS, MODES, RECORD_TENSOR, STAGES, EmbeddingsRecord,
    MAX_CHOICES, HFKVRecord, VLLMKVRecord, decode_record, instance_name,
)
from ..stagecall import StageClient, responses_of
from .instances import Instances
from .engine_metrics import Answered, EngineMetrics
from .metrics import SchedulerMetrics
from .prompt_length import PromptLength, context_length, model_family, text_bytes_limit
from .request import EntryRequest
from .routing import (
    FALLBACK, LOCAL_ENCODE, Plan, Router, needs_prompt_length, plan, prefix_keys, with_local_prefill,
)

_ENTRY_INPUT_NAMES = tuple(t.name for t in ENTRY_INPUTS)
_ENTRY_OUTPUT_NAMES = [t.name for t in ENTRY_OUTPUTS]
_KV_RECORDS = (HFKVRecord, VLLMKVRecord)
MAX_OPEN = 256  # requests an entry model serves at once (each stream has a relay thread); one more gets a 503
DRAIN_POLL_S = 0.1  # how often an entry model looks whether the server drains, and then whether it has drained
_CANCEL_CHECK_S = 0.05  # how often a stream looks for a cancelled client (an IPC call to Triton each time)
# outputs the last stage always sends on its last response (the scheduler needs them), passed on only where the
# client asked for them: {flag: output}
_ALWAYS_ASKED = {"return_finish_reason": "finish_reason", "return_num_input_tokens": "num_input_tokens",
                 "return_num_output_tokens": "num_output_tokens"}


@dataclass
class _Posted:
    """A prefill call posted beside the encode call, waiting for the record the encode worker hands it
    (the record hand-off in :mod:`trident.workers.infer`)."""

    instance: str
    token: str
    hand_to: HandTo  # where the encode call's record goes
    call: asyncio.Future  # the call's outputs (arrays), or None when its worker did not take it


class StageGone(Exception):
    """The chosen instance is not there any more (its worker does not answer, or is stopping): try another."""


class Migrate(Exception):
    """The stage instance streaming the request went away after the client had some of its answer: the request is
    planned again and its new stream replays what the client has (dropped, checked to be the same) before it goes on
    (:meth:`TritonPythonModel._relay`)."""

    def __init__(self, instance: str, stage: str, reason: str, message: str) -> None:
        super().__init__(instance)
        self.instance, self.stage, self.reason, self.message = instance, stage, reason, message


class StageError(Exception):
    """A stage answered with an error: passed to the client with the stage's code and message."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _traceparent(request) -> str | None:
    """The parent of the scheduler's span: Triton's span of the request, when Triton traces it (its OpenTelemetry
    mode) and the request's ``traceparent`` parameter (a client's, or the OpenAI frontend's) names no other trace;
    else that parameter, if it has one. (Triton continues a ``traceparent`` header, not a parameter: a client that
    sends only the parameter keeps its trace, Triton's span then being apart.)"""
    try:
        value = json.loads(request.parameters() or "{}").get(tracing.PARAMETER)
    except (ValueError, AttributeError):
        value = None
    asked = value if isinstance(value, str) else None
    triton = tracing.triton_context(request)
    if triton is not None and (asked is None or triton.split("-")[1:2] == asked.split("-")[1:2]):
        return triton
    return asked


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils  # provided by the python-backend stub

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.mode: str = params["mode"]
        tracing.start(f"bls-{self.mode}")
        # the server's settings, with the fields an operator's config override names
        self.cfg = SchedulerConfig.model_validate(
            json.loads(os.environ.get(SCHEDULING_ENV) or "{}") | json.loads(params.get("scheduler") or "{}"))
        self.model_path = os.environ.get(MODEL_ENV) or None
        self.store = Path(args["model_repository"]).parent  # the server's model store
        self.router = Router(self.cfg.routing, self.cfg.affinity_slack)
        self.metrics = SchedulerMetrics(self.mode, pb_utils)
        if self.model_path:
            family = model_family(self.model_path)
            self.metrics.model_info(family.name, family.model_type, family.listed)
        self.engine_metrics = EngineMetrics(args["model_name"], str(args.get("model_version") or 1),
                                            context_length(self.model_path) if self.model_path else None, pb_utils)
        self.logger = pb_utils.Logger
        self.stages = sorted({s for m in FALLBACK[self.mode] for s in MODES[m] + LOCAL_ENCODE.get(m, ())})
        self.instances = Instances(self.stages, self.store, self._ready, self.cfg.refresh_s, self.router.forget,
                                   lambda line: self.logger.log_info(f"[trident] {self.mode}: {line}"))
        self._streams = ThreadPoolExecutor(max_workers=MAX_OPEN, thread_name_prefix="trident-bls-stream")
        self._open = 0  # requests being served
        self._stages = StageClient()
        self._text_limit = text_bytes_limit(self.model_path) if self.model_path else None
        self._measure: PromptLength | None = None  # measures prompts for local prefill
        if self.cfg.local_prefill_tokens and self.model_path and any("decode" in MODES[m] for m in FALLBACK[self.mode]):
            self._measure = PromptLength(self.model_path)
        self._wait_for_a_route()
        threading.Thread(target=self._watch_drain, name="trident-bls-drain", daemon=True).start()

    def _wait_for_a_route(self) -> None:
        """Load only when a request with media would be served: Triton reports this entry model READY only if its
        plan (its own stages, or a fallback mode's) has a live instance of every stage it calls; otherwise the load
        fails at once, naming the stages missing. (It does not wait: Triton serializes loads, and a load that waited
        here would hold up the stage models' own.)"""
        self.instances.refresh(force=True)
        live = self.instances.stages()
        if plan(self.mode, 1, live, self.cfg.local_encode_images) is None:
            missing = sorted(set(MODES[self.mode]) - live)
            raise RuntimeError(f"{self.mode}: no live instance of stage(s) {', '.join(missing)}; start their workers, "
                               f"then load {self.mode}")

    # -- stage instances -------------------------------------------------------------------------------
    def _ready(self, name: str) -> bool:
        try:
            return bool(self.pb.is_model_ready(name))
        except Exception:
            return False

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

    # -- requests ----------------------------------------------------------------------------------------
    async def execute(self, requests):
        await asyncio.gather(*(self._serve(request) for request in requests))
        return None

    async def _serve(self, request) -> None:
        arrived = time.monotonic_ns()
        with tracing.request("request", _traceparent(request) if tracing.enabled() else None, mode=self.mode):
            tracing.mark("execute", arrived)
            await self._serve_traced(request, arrived)

    def _refuse(self, request, error: Unavailable) -> None:
        """Answer ``request`` with ``error`` at once, before anything of it is read."""
        pb = self.pb
        self.metrics.add("trident_scheduler_errors_total", code=str(pb.TritonError.UNAVAILABLE))
        request.get_response_sender().send(
            pb.InferenceResponse(error=pb.TritonError(client_message(error), pb.TritonError.UNAVAILABLE)),
            flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _watch_drain(self) -> None:
        """Once the server drains (:mod:`trident.drain`): say when this entry model has no request left in flight."""
        while not drain.draining():
            time.sleep(DRAIN_POLL_S)
        while self._open:
            time.sleep(DRAIN_POLL_S)
        drain.mark_drained(self.mode)

    async def _serve_traced(self, request, arrived: int) -> None:
        pb = self.pb
        if drain.draining():
            return self._refuse(request, Unavailable(
                "the server is shutting down: it serves the requests it has and takes no new ones; retry on another "
                "replica"))
        if self._open >= MAX_OPEN:  # each holds a relay thread for its stream: one more would wait for one, unseen
            return self._refuse(request, Unavailable(
                f"the {self.mode} mode has {self._open} requests in flight, its limit; retry later"))
        # its metric updates are held until its first response is out
        req = EntryRequest(request, request.get_response_sender(), self.metrics.held(asyncio.get_running_loop()),
                           arrived_ns=arrived)
        self._open += 1
        try:
            await self._run(req)
        except (StageError, TridentError) as e:
            code = e.code if isinstance(e, StageError) else getattr(pb.TritonError, e.triton_code, pb.TritonError.INTERNAL)
            message = str(e) if isinstance(e, StageError) else f"{type(e).__name__}: {e}"
            self.metrics.add("trident_scheduler_errors_total", code=str(code))
            self._end_with_error(req, pb.TritonError(message, code))
        except Exception as e:  # a bug here must not leave the client waiting (nor show it the bug's text)
            error = as_trident_error(e, log=False)
            self.logger.log_error(f"[trident] {self.mode}: scheduler failed: {type(e).__name__}: {e} ({error.message})")
            self.metrics.add("trident_scheduler_errors_total", code="INTERNAL")
            self._end_with_error(req, pb.TritonError(client_message(error), pb.TritonError.INTERNAL))
        finally:
            self._open -= 1
            if req.answered is not None and req.first_ns is not None:
                prompt, generated, last, responses = req.answered
                req.held.later(self.engine_metrics.observe, Answered(
                    prompt, generated, (req.first_ns - arrived) / 1e9, (last - arrived) / 1e9, responses, req.n))
            req.held.apply()

    def _end_with_error(self, req: EntryRequest, error) -> None:
        """The request's last response: ``error``; after a first text, as a response of its own (an error on the
        final response after others is dropped)."""
        pb = self.pb
        if req.early is None:
            req.sender.send(pb.InferenceResponse(error=error), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            req.sender.send(pb.InferenceResponse(error=error))
            req.sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _inputs(self, request) -> dict:
        inputs = {}
        for name in _ENTRY_INPUT_NAMES:
            tensor = self.pb.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor
        return inputs

    async def _run(self, req: EntryRequest) -> None:
        with tracing.step("inputs"):
            req.inputs = self._inputs(req.triton)
            req.text = _text(req.inputs.get("text_input"), self._text_limit)
            req.image_ids, req.kinds = _media_ids(req.inputs)
            req.keys = prefix_keys(req.text, req.image_ids)
            req.n = _choices(req.inputs.get("sampling_parameters"))
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
                    error = Unavailable(f"stage instance {move.instance} stopped before the end of the answer (its "
                                        f"worker exited or was cut off), after {req.migrations} migration(s) "
                                        "(scheduling.migration_limit)")
                    self.metrics.add("trident_scheduler_errors_total", code=str(self.pb.TritonError.UNAVAILABLE))
                    return self._end_with_error(req, self.pb.TritonError(client_message(error),
                                                                         self.pb.TritonError.UNAVAILABLE))
                req.migrations, moved = req.migrations + 1, move
                self.metrics.add("trident_migrations_total", stage=move.stage, reason=move.reason)
                tracing.mark(f"migration:{move.stage}", time.monotonic_ns())
                self.logger.log_warn(f"[trident] {self.mode}: {move.instance} went away mid-stream ({move.reason}); "
                                     f"moving the request (migration {req.migrations}), {req.sent_tokens} token(s) "
                                     "already sent")
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
        req.held.later(self.logger.log_verbose,
                       f"[trident] {self.mode} request: path {p.path} {' '.join(p.decisions)}".rstrip())
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
                return self._cancelled(req.sender)
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
        hand_to = HandTo(instance, token, above)
        call = asyncio.ensure_future(self._posted_call(instance, req.inputs, token, req.held))
        return _Posted(instance, token, hand_to, call)

    async def _posted_call(self, instance: str, inputs: dict, token: str, held) -> dict | None:
        out = RECORD_TENSOR["kv"]
        self._begin("prefill", instance, held)
        try:
            with tracing.step("call:prefill"):
                return await self._stages.call(instance, _arrays("prefill", inputs, None), [out], await_record=token,
                                               timeout_s=self.cfg.stage_timeout_s)
        except WorkerLost:
            return None  # (its worker went away mid-call: the request is planned again)
        finally:
            self._end("prefill", instance, held)

    async def _withdraw(self, posted: _Posted) -> None:
        """The posted prefill call gets no record: its worker ends it (its error is nobody's)."""
        posted.call.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await self._stages.withdraw(posted.instance, posted.token)
        except Exception as e:  # the call still ends, at the latest when its wait does
            self.logger.log_warn(f"[trident] {self.mode}: could not withdraw a prefill call on {posted.instance}: {e}")

    async def _prompt_length(self, req: EntryRequest, token_counts: list[int]) -> int | None:
        """The prompt's token count with media expanded; None when it cannot be told here (the stage that
        prefills will name the problem). Its text is encoded once, off the event loop."""
        if self._measure is None or (req.kinds and not token_counts):
            return None
        if req.text_ids is None:
            req.text_ids = await asyncio.to_thread(self._measure.ids, req.text)
        return self._measure.count(req.text_ids, token_counts, req.kinds)

    @staticmethod
    def _record_for(stage: str, records: dict[str, bytes], local_prefill: bool = False) -> tuple[str, bytes] | None:
        """The one record a stage gets: what it takes (a decode stage prefilling itself: the embeddings)."""
        kind = "embeddings" if local_prefill else STAGES[stage].takes
        name = RECORD_TENSOR.get(kind) if kind else None
        return (name, records[name]) if name in records else None

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
        inputs, held = req.inputs, req.held
        instance = self._route(stage, req.keys if keys is None else keys, held)
        record = self._record_for(stage, req.records)
        self._begin(stage, instance, held)
        try:
            with tracing.step(f"call:{stage}"):
                arrays = await self._stages.call(instance, _arrays(stage, inputs, record), outputs, hand_to=hand_to,
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

    def _as_responses(self, message) -> list:
        """A stage stream's message as ``InferenceResponse``s: its outputs, or its error."""
        pb = self.pb
        out = []
        for item in responses_of(message):
            if isinstance(item, TridentError):
                code = getattr(pb.TritonError, item.triton_code, pb.TritonError.INTERNAL)
                out.append(pb.InferenceResponse(error=pb.TritonError(client_message(item), code)))
            else:
                out.append(pb.InferenceResponse(output_tensors=[pb.Tensor(n, a) for n, a in item.items()]))
        return out

    async def _stream(self, stage: str, req: EntryRequest, p: Plan) -> None:
        """Call the stage that hands on tokens and pass its responses to the client as they come; the first text
        goes out before the call when the prefill's record tells it (once per request: an attempt after a stage
        instance went away finds it sent)."""
        record = self._record_for(stage, req.records, p.local_prefill)  # a decode prefilling: the embeddings
        if req.early is None and not req.sent_responses:  # before anything else: this text is the client's first token
            req.early = self._send_early(record, req)
        instance = self._route(stage, req.keys, req.held)
        request_id = uuid.uuid4().hex
        self._begin(stage, instance, req.held)
        # the stage always says why it stopped (a stream that ends without a finish_reason was cut off) and how many
        # tokens the answer took (the vllm:* metrics count them)
        unasked = {out for flag, out in _ALWAYS_ASKED.items() if not _flag(req.inputs.get(flag))}
        inputs = {**req.inputs, **{flag: self.pb.Tensor(flag, np.array([True])) for flag in _ALWAYS_ASKED}}
        try:
            # with the first text out, or a prefill's KV in hand, the decode is called even if the client has gone
            # (a check here would be an IPC round trip before that text; dropped, the KV would wait for its lease):
            # the relay's cancel check at the decode's first response then stops the decode stage, which frees
            # the prefill's KV at once
            holds_kv = record is not None and record[0] == RECORD_TENSOR["kv"]
            if req.early is None and not holds_kv and req.cancelled():
                return self._cancelled(req.sender)
            t0 = time.monotonic_ns()
            stream = await self._stages.stream(instance, _arrays(stage, inputs, record), _ENTRY_OUTPUT_NAMES,
                                               {REQUEST_ID: request_id}, self._as_responses)
            if stream is None:
                raise StageGone(instance)
            outcome = await asyncio.get_running_loop().run_in_executor(
                self._streams, tracing.carry(self._relay), stream, instance, req, unasked, f"call:{stage}", t0)
            if outcome == "cancelled":
                await self._cancel_stream(stage, instance, request_id)
                self._cancelled(req.sender)
        finally:
            self._end(stage, instance, req.held)

    def _send_early(self, record: tuple[str, bytes] | None, req: EntryRequest) -> bytes | None:
        """Send a streaming client the first response now when the prefill told its text (the ``first_text``
        of ``kv_meta``: see :class:`~trident.protocol.HFKVRecord`), rather than after the decode call's round
        trip. Returns the text sent (the decode's first response, which :meth:`_relay` then drops), or None."""
        if record is None or record[0] != RECORD_TENSOR["kv"] or not _flag(req.inputs.get("stream")) \
                or any(_flag(req.inputs.get(f)) for f in ("return_logprobs", "return_cumulative_logprob")):
            return None  # (the logprobs of the first token are the decode's to tell)
        try:
            kv = decode_record(record[1], _KV_RECORDS)
        except TridentError:  # not ours to refuse: the decode stage names the problem
            return None
        if kv.first_text is None:
            return None
        text = kv.first_text.encode("utf-8")
        # the decode's first response as it would be: one token, not the last (finish_reason "None")
        outputs = {"text_output": np.array([text], dtype=np.object_)}
        if _flag(req.inputs.get("return_finish_reason")):
            outputs["finish_reason"] = np.array([b"None"], dtype=np.object_)
        if _flag(req.inputs.get("return_num_input_tokens")):
            outputs["num_input_tokens"] = np.array([kv.prompt_len], dtype=np.uint32)
        if _flag(req.inputs.get("return_num_output_tokens")):
            outputs["num_output_tokens"] = np.array([1], dtype=np.uint32)
        t1 = req.first_ns = time.monotonic_ns()
        req.sender.send(self.pb.InferenceResponse(
            output_tensors=[self.pb.Tensor(name, value) for name, value in outputs.items()]))
        req.sent_text, req.sent_tokens, req.sent_responses = text, 1, 1
        tracing.mark("first_send", t1)
        req.held.add("trident_decisions_total", decision="first_text_from_prefill")
        req.held.apply()
        return text

    def _relay(self, stream, instance: str, req: EntryRequest, unasked: set[str], step: str = "stream",
               t0: int = 0) -> str:
        """Send the stage's responses to the client, in a thread of their own (no event-loop hop per token);
        looks for a cancelled client every ``_CANCEL_CHECK_S``. Returns "done" or "cancelled" (the caller then
        stops the stage). The call (from ``t0``) up to its first response is timed as ``step``, the first send to
        the client as ``first_send``.

        The stage's responses carry ``finish_reason`` (its last one's not "None") and the token counts (asked for
        whether or not the client did; passed on only where it did: ``unasked`` are the ones it did not; the counts
        go to ``req.answered``). A stream whose worker went away (:class:`~trident.errors.WorkerLost`, or a stream
        that ends without a last response) with nothing sent yet makes the instance count as gone (the request is
        planned again); after some of the answer, the request moves (:class:`Migrate`, up to
        ``scheduling.migration_limit``): it is planned again, and the new stream's first tokens, the ones the client
        has (``req.sent_text``, ``req.sent_tokens``), are checked to be the same and dropped before it goes on
        (greedy and seeded requests continue exactly; one that sampled differently ends with a 503). A stage's error
        before anything was sent is the request's error; after, it ends the client's stream.

        ``req.early``: the text already sent as the first response (:meth:`_send_early`); the stage's first response,
        the same text, is not sent again.
        """
        pb = self.pb
        request, sender, held = req.triton, req.sender, req.held
        stage = step.split(":", 1)[-1]
        resumed = req.migrations > 0
        early = None if resumed else req.early
        replay, left = (req.sent_text, req.sent_tokens) if resumed else (b"", 0)  # what the client has: dropped
        before = req.sent_responses  # (the early first text's, or a moved request's earlier streams')
        finished, check_at = False, time.monotonic() + _CANCEL_CHECK_S
        prompt = generated = 0  # the answer's token counts, from the stage's responses
        last_ns = req.first_ns or 0  # when the client's last response went out
        for response in stream:
            if time.monotonic() >= check_at:
                if request.is_cancelled():
                    return "cancelled"
                check_at = time.monotonic() + _CANCEL_CHECK_S
            reason = _finish_reason(self.pb, response)
            if response.has_error():
                error = response.error()
                if isinstance(from_message(error.message()), WorkerLost):
                    if not req.sent_responses:
                        raise StageGone(instance)
                    if req.n == 1:
                        raise Migrate(instance, stage, "worker_lost", error.message())
                if req.sent_responses > before:  # the client has a partial answer: end it with the stage's error
                    # (as a response of its own: an error on the final response after others is dropped)
                    sender.send(pb.InferenceResponse(error=error))
                    sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    return "done"
                raise StageError(error.message(), error.code())
            tensors = response.output_tensors()
            n_in, n_out = _counts(tensors)
            prompt, generated = n_in or prompt, generated + n_out  # (each response counts its own tokens)
            tensors = [t for t in tensors if t.name() not in unasked]
            skipped = 0  # of this response's tokens, those the client has
            if early is not None:  # the stage's first response: the one already sent
                tensors, early = self._not_again(tensors, early, reason, instance), None
                tracing.mark(step, t0)
                if tensors is None:
                    return self._diverged(sender, instance)
                skipped = n_out if not tensors else 1
                if request.is_cancelled():  # (see _stream)
                    return "cancelled"
            elif left:  # a moved request's new stream: what the client has first
                past = self._past_replay(tensors, n_out, reason, replay, left)
                if past is None:
                    return self._diverged(sender, instance)
                tensors, replay, left, skipped = past
            if reason is not None:
                finished = True
            if tensors:
                t1 = 0 if req.sent_responses else time.monotonic_ns()
                sender.send(pb.InferenceResponse(output_tensors=tensors))
                last_ns = time.monotonic_ns()
                req.sent_text += _text_of(tensors) or b""
                req.sent_tokens += n_out - skipped
                if not req.sent_responses:
                    req.first_ns = t1
                    tracing.mark(step, t0, t1)
                    tracing.mark("first_send", t1)
                    if held is not None:  # the first response is out: now the metric updates (an IPC each),
                        held.loop.call_soon_threadsafe(held.apply)  # from the model's event loop, as before
                req.sent_responses += 1
        if not finished:
            if not req.sent_responses:
                raise StageGone(instance)
            if req.n == 1:
                raise Migrate(instance, stage, "cut_off", f"stage instance {instance} stopped before the end of the "
                              "answer (its worker exited or its model was unloaded)")
            error = Unavailable(f"stage instance {instance} stopped before the end of the answer (its worker exited "
                                "or its model was unloaded)")
            sender.send(pb.InferenceResponse(error=pb.TritonError(client_message(error), pb.TritonError.UNAVAILABLE)))
        sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if finished:
            req.answered = (prompt, generated, last_ns or time.monotonic_ns(), req.sent_responses)
        return "done"

    def _diverged(self, sender, instance: str) -> str:
        """End a client's stream whose new stream (after a stage instance went away) did not begin with what the
        client has: the request sampled differently."""
        pb = self.pb
        error = Unavailable(f"the answer was cut off: a stage instance went away, and the retry on {instance} began "
                            "differently (it sampled again); retry the request")
        sender.send(pb.InferenceResponse(error=pb.TritonError(client_message(error), pb.TritonError.UNAVAILABLE)))
        sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return "done"

    def _past_replay(self, tensors: list, n_out: int, reason: bytes | None, replay: bytes, left: int):
        """One response of a moved request's new stream while it replays what the client has (``replay``: that
        text not yet matched, ``left``: its tokens): (the tensors to send, possibly none, the replay and tokens left,
        this response's tokens the client has), or None when the stream does not match what the client has."""
        text = _text_of(tensors)
        if text is None:
            return None
        if n_out <= left:  # all of it the client has
            if not replay.startswith(text) or (reason is not None and n_out < left):
                return None
            if reason is None:
                return [], replay[len(text):], left - n_out, n_out
            rest, skip = b"", n_out  # (it ends just where the client's answer does: its end goes out, empty)
        else:  # the client has its first ``left`` tokens
            if not text.startswith(replay):
                return None
            rest, skip = text[len(replay):], left
        out = []
        for t in tensors:
            name = t.name()
            if name == "text_output":
                t = self.pb.Tensor(name, np.array([rest], dtype=np.object_))
            elif name == "num_output_tokens":
                t = self.pb.Tensor(name, np.array([n_out - skip], dtype=np.uint32))
            elif name == "logprobs":
                entries = json.loads(t.as_numpy().reshape(-1)[0] or b"[]")
                if isinstance(entries, list):
                    t = self.pb.Tensor(name, np.array([json.dumps(entries[skip:]).encode()], dtype=np.object_))
            out.append(t)
        return out, b"", 0, skip

    def _not_again(self, tensors: list, early: bytes, reason: bytes | None, instance: str) -> list | None:
        """The stage's first response's tensors (those the client asked for) less what :meth:`_send_early` sent
        already; None when that response does not begin with it. The same response is dropped whole (the early
        one carried its outputs); one with more text (a retry's) goes on with the rest only when the client asked
        for nothing that counts its tokens."""
        text = next((t.as_numpy().reshape(-1) for t in tensors if t.name() == "text_output"), None)
        first = text[0] if text is not None and text.size == 1 and isinstance(text[0], bytes) else None
        if first == early and reason is None:
            return []
        if first is not None and first.startswith(early) and len(tensors) == 1:  # the same first token, then more
            return [self.pb.Tensor("text_output", np.array([first[len(early):]], dtype=np.object_)),
                    *(t for t in tensors if t.name() != "text_output")]
        self.logger.log_error(f"[trident] {self.mode}: {instance}'s first response does not begin with the first text "
                              f"already sent ({early[:40]!r})")
        return None

    async def _cancel_stream(self, stage: str, instance: str, request_id: str) -> None:
        """Stop a stage's stream whose client went away (a :class:`~trident.protocol.Cancel` message)."""
        try:
            await self._stages.cancel(instance, request_id)
        except Exception as e:  # the stream still ends with its max_tokens
            self.logger.log_warn(f"[trident] {self.mode}: could not cancel a {stage} stream on {instance}: {e}")

    def _cancelled(self, sender) -> None:
        pb = self.pb
        sender.send(
            pb.InferenceResponse(error=pb.TritonError("request cancelled", pb.TritonError.CANCELLED)),
            flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )

    def finalize(self) -> None:
        self._stages.close()
        self._streams.shutdown(wait=False, cancel_futures=True)
        # Triton's requests still referenced from garbage (an error's traceback, a dropped task) are freed now, while
        # the stub's shared memory holds them: freed at the interpreter's exit, after it, the stub segfaulted
        # (InferRequest::~InferRequest)
        gc.collect()


def _stage_inputs(stage: str, inputs: dict, record: tuple[str, bytes] | None):
    """``(name, value)`` of each input ``stage`` takes, in its order: the record it takes (a STRING[1] array), else
    the entry's tensor of that name as it came."""
    for name in STAGES[stage].input_names:
        if record is not None and name == record[0]:
            yield name, np.array([record[1]], dtype=np.object_)
        elif name in inputs:
            yield name, inputs[name]


def _arrays(stage: str, inputs: dict, record: tuple[str, bytes] | None) -> dict:
    """The stage's inputs as arrays (a stage call's ``inputs``)."""
    return {name: v if isinstance(v, np.ndarray) else v.as_numpy() for name, v in _stage_inputs(stage, inputs, record)}


def _finish_reason(pb, response) -> bytes | None:
    """The response's ``finish_reason`` once every choice has one (the stream's last response; ``n`` > 1: one
    element per choice), else None."""
    tensor = pb.get_output_tensor_by_name(response, "finish_reason")
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)
    # ("None": not finished, as the vLLM backend says it)
    done = value.size and all(isinstance(v, bytes) and v not in (b"", b"None") for v in value)
    return value[-1] if done else None


def _text_of(tensors: list) -> bytes | None:
    """The ``text_output`` of a response's tensors (one choice), or None."""
    for t in tensors:
        if t.name() == "text_output":
            value = t.as_numpy().reshape(-1)
            return value[0] if value.size == 1 and isinstance(value[0], bytes) else None
    return None


def _counts(tensors: list) -> tuple[int, int]:
    """(num_input_tokens, num_output_tokens: of every choice) of a stage's response (0 where absent)."""
    found = {t.name(): t.as_numpy().reshape(-1) for t in tensors if t.name() in ("num_input_tokens", "num_output_tokens")}
    n_in = found.get("num_input_tokens")
    return (int(n_in[0]) if n_in is not None and n_in.size else 0,
            int(found["num_output_tokens"].sum()) if "num_output_tokens" in found else 0)


def _bytes_of(arrays: dict, outputs: list[str]) -> dict[str, bytes]:
    """A one-answer stage's STRING[1] outputs as bytes (b"" where absent)."""
    result = {}
    for name in outputs:
        value = arrays[name].reshape(-1)[0] if name in arrays else b""
        result[name] = value if isinstance(value, bytes) else str(value).encode()
    return result


def _flag(tensor) -> bool:
    """A BOOL control input (absent: false)."""
    if tensor is None:
        return False
    values = tensor.as_numpy().reshape(-1)
    return bool(values[0]) if values.size else False


def _choices(tensor) -> int:
    """``sampling_parameters.n``, for the metrics (1 where absent or not a number: the stages check it)."""
    if tensor is None:
        return 1
    try:
        raw = tensor.as_numpy().reshape(-1)[0]
        n = json.loads(raw).get("n", 1) if b'"n"' in raw else 1
    except (ValueError, AttributeError, IndexError, TypeError, RecursionError):  # (the stages name the problem)
        return 1
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_CHOICES else 1


def _text(tensor, limit: int | None = None) -> str:
    """The prompt's text; ``limit``: the most bytes a text that fits the context window can have."""
    if tensor is None:
        raise InvalidRequest("text_input is required")
    values = tensor.as_numpy().reshape(-1)
    if values.size == 0:
        raise InvalidRequest("text_input is empty")
    value = values[0]
    size = len(value) if isinstance(value, bytes) else len(str(value).encode("utf-8", "surrogatepass"))
    if limit is not None and size > limit:
        raise InvalidRequest(f"text_input is {size} bytes: more than any prompt that fits the model's context "
                             f"window can have ({limit} bytes)")
    try:
        text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise InvalidRequest("text_input is not valid UTF-8") from None
    if not text:
        raise InvalidRequest("text_input is empty")
    return text


def _media_ids(inputs: dict) -> tuple[list[str], list[str]]:
    """Content ids and kinds of the request's media, images then video then audio (base64 checked here; the
    items are decoded where they are encoded)."""
    ids: list[str] = []
    kinds: list[str] = []
    for kind in MODALITIES:
        tensor = inputs.get(kind)
        if tensor is None:
            continue
        values = tensor.as_numpy().reshape(-1)
        check_count(kind, len(values))
        ids += [content_id(decode_base64(v, i, kind), kind) for i, v in enumerate(values)]
        kinds += [kind] * len(values)
    return ids, kinds
