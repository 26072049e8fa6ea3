"""The BLS entry model of one mode (python backend, decoupled): Trident's scheduler as a Triton model.

A thin adapter: Triton's lifecycle (``initialize``, ``execute``, ``finalize``), the entry tensors read as arrays,
and each request's responses through Triton's response sender (:class:`TritonResponder`). The request's way through
the stages is :mod:`.flow`'s, which imports nothing of Triton.

Stage instances are the Triton models ``<stage>`` and ``<stage>-<n>`` that are ready (:mod:`.instances`).
Decisions are counted on Triton's metrics port (:mod:`.metrics`) and logged per request at verbose level
(``--log-verbose 1``).

The python backend imports this through the ``model.py`` that :mod:`trident.core.repository` writes.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import threading
import time
from pathlib import Path

import numpy as np

from trident.core import tracing
from trident.core.config import MODEL_ENV, SCHEDULING_ENV, SchedulerConfig
from trident.core.errors import TridentError, client_message
from trident.core.protocol import ENTRY_INPUTS
from trident.core.stagecall import StageClient
from trident.in_triton.scheduler.engine_metrics import EngineMetrics
from trident.in_triton.scheduler.flow import RequestFlow
from trident.in_triton.scheduler.instances import Instances
from trident.in_triton.metrics import SchedulerMetrics
from trident.core.prompt_length import context_length, model_family
from trident.in_triton.scheduler.routing import Router

_ENTRY_INPUT_NAMES = tuple(t.name for t in ENTRY_INPUTS)


class TritonResponder:
    """One request's answer through Triton's response sender (the flow's ``Responder``)."""

    def __init__(self, pb, request) -> None:
        self._pb, self._request, self._sender = pb, request, request.get_response_sender()
        self._sent = False

    def send(self, outputs: dict[str, np.ndarray]) -> None:
        pb = self._pb
        self._sender.send(pb.InferenceResponse(output_tensors=[pb.Tensor(n, v) for n, v in outputs.items()]))
        self._sent = True

    def end(self, error: TridentError | None = None) -> None:
        """The last response; an error after other responses goes as a response of its own (Triton drops an error
        on a final response that follows others)."""
        pb = self._pb
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if error is None:
            return self._sender.send(flags=final)
        code = getattr(pb.TritonError, error.triton_code, pb.TritonError.INTERNAL)
        response = pb.InferenceResponse(error=pb.TritonError(client_message(error), code))
        if self._sent:
            self._sender.send(response)
            self._sender.send(flags=final)
        else:
            self._sender.send(response, flags=final)

    def cancelled(self) -> bool:
        return self._request.is_cancelled()


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
        mode: str = params["mode"]
        tracing.start(f"bls-{mode}")
        # the server's settings, with the fields an operator's config override names
        cfg = SchedulerConfig.model_validate(
            json.loads(os.environ.get(SCHEDULING_ENV) or "{}") | json.loads(params.get("scheduler") or "{}"))
        model_path = os.environ.get(MODEL_ENV) or None
        router = Router(cfg.routing, cfg.affinity_slack)
        metrics = SchedulerMetrics(mode, pb_utils)
        if model_path:
            family = model_family(model_path)
            metrics.model_info(family.name, family.model_type, family.listed)
        engine_metrics = EngineMetrics(args["model_name"], str(args.get("model_version") or 1),
                                       context_length(model_path) if model_path else None, pb_utils)
        log = pb_utils.Logger
        store = Path(args["model_repository"]).parent  # the server's model store
        instances = Instances(RequestFlow.stages_of(mode), store, self._ready, cfg.refresh_s, router.forget,
                              lambda line: log.log_info(f"[trident] {mode}: {line}"))
        self.flow = RequestFlow(mode, cfg, StageClient(), instances, router, metrics, engine_metrics.observe, log,
                                model_path)
        # Triton reports this entry model READY only when a request with media would be served; else the load fails
        # at once, naming the stages missing (it does not wait: Triton serializes loads, and a load that waited here
        # would hold up the stage models' own)
        self.flow.check_route()
        self._drain_watch = threading.Thread(target=self.flow.watch_drain, name="trident-bls-drain", daemon=True)
        self._drain_watch.start()

    def _ready(self, name: str) -> bool:
        try:
            return bool(self.pb.is_model_ready(name))
        except Exception:
            return False

    async def execute(self, requests):
        await asyncio.gather(*(self._serve(request) for request in requests))
        return None

    async def _serve(self, request) -> None:
        arrived = time.monotonic_ns()
        inputs = {}
        for name in _ENTRY_INPUT_NAMES:
            tensor = self.pb.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        await self.flow.serve(inputs, TritonResponder(self.pb, request), arrived,
                              _traceparent(request) if tracing.enabled() else None)

    def finalize(self) -> None:
        self.flow.close()
        self._drain_watch.join(2.0)
        # Triton's requests still referenced from garbage (an error's traceback, a dropped task) are freed now, while
        # the stub's shared memory holds them: freed at the interpreter's exit, after it, the stub segfaulted
        # (InferRequest::~InferRequest)
        gc.collect()
