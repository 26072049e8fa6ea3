"""A stage model's python-backend side: Triton's requests to the stage, as stage-protocol calls to its worker.

The head's bind model (:mod:`.bind_model`) writes the stage model's folder, with a ``model.py`` importing this
module and the worker file that says where the worker's :class:`~trident.core.stagecall.StageServer` listens; the
python-backend stub runs it inside Triton. It is a caller of the stage worker like any other
(:class:`~trident.core.stagecall.StageLink`, over the worker's Unix socket on this host or TCP from another): each Triton
request becomes one :class:`~trident.core.protocol.Call`, and each answer a Triton response. A failed call's
:class:`~trident.core.protocol.Failure` leaves as a ``TritonError`` with its class's code (INVALID_ARG -> HTTP 400,
UNAVAILABLE -> 503, ...) and the message ``"<ClassName>: <message>"``.

While the model is loaded, its first instance enters the worker file in the stage directory
(:mod:`trident.core.stagecall.directory`), where the schedulers find the worker to call it straight.

A request without the stage credential (:mod:`trident.core.auth`) is refused here, before the worker sees it.
"""

import json
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils  # type: ignore  # provided by the python-backend stub

from trident.core import auth, tracing
from trident.core.errors import TridentError, Unauthenticated, Unavailable, client_message
from trident.core.protocol import WORKER_FILE, Call, Failure, Gone, Reply, Stats, error_of, failure
from trident.core.stagecall import directory
from trident.core.stagecall.client import NoWorker, StageLink
from trident.core.stagecall.frames import ends
from trident.in_triton.stage_metrics import StageMetrics


def triton_error(error: TridentError):
    """A ``pb_utils.TritonError`` for a Trident error, with its class's code."""
    code = getattr(pb_utils.TritonError, error.triton_code, pb_utils.TritonError.INTERNAL)
    return pb_utils.TritonError(client_message(error), code)


def _parameters(triton_request) -> dict | None:
    """The request's parameters without the stage credential; None when it does not carry the credential (nothing
    of it is read beyond its parameters)."""
    try:
        parameters = json.loads(triton_request.parameters() or "{}")
    except ValueError:
        return None
    if not isinstance(parameters, dict) or not auth.check_credential(parameters.pop(auth.CREDENTIAL, None)):
        return None
    return parameters


class _Answer:
    """A one-answer call's last message, handed from the link's reader thread to the execute thread."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.message = None

    def __call__(self, message) -> None:
        if ends(message):
            self.message = message
            self._done.set()

    def wait(self, timeout: float | None = None):
        self._done.wait(timeout)
        return self.message


class TritonPythonModel:
    """The stage model: ``execute`` sends each request to the worker (a one-answer stage waits for the answers, a
    decoupled stage returns at once and the link's reader thread sends each response to Triton); with
    ``TRIDENT_TRACE_DIR`` set it times each ``execute`` call."""

    def initialize(self, args):
        name = args["model_name"]
        config = json.loads(args["model_config"])
        self._name = name
        self._inputs = [i["name"] for i in config["input"]]
        self._outputs = {o["name"]: pb_utils.triton_string_to_numpy(o["data_type"]) for o in config["output"]}
        self._decoupled = config.get("model_transaction_policy", {}).get("decoupled", False)
        self._entry = self._metrics = None
        worker_file = Path(args["model_repository"]) / args["model_version"] / WORKER_FILE
        if args["model_instance_name"].rsplit("_", 1)[-1] == "0":  # once per model
            self._entry = json.loads(worker_file.read_text())
            directory.enter(name, self._entry)
        self._link = StageLink(name, worker_file)
        if self._entry is not None:  # (once per model) its worker's counters as the stage's metrics
            self._metrics = StageMetrics(name, self._worker_stats, pb_utils)

    def _worker_stats(self) -> dict | None:
        """The worker's counters (a :class:`Stats` message on the link), or None when it does not answer."""
        answer = _Answer()
        try:
            self._link.send(Stats(), answer)
        except NoWorker:
            return None
        message = answer.wait(timeout=5)
        return message.outputs.get("stats") if isinstance(message, Reply) else None

    def execute(self, requests):
        calls = [self._call(r) for r in requests]
        if self._decoupled:
            for request, call in zip(requests, calls):
                self._stream(request, call)
            return None
        answers = []
        for call in calls:
            answer = _Answer()
            self._send(call, answer)
            answers.append(answer)
        return [self._response(r, a.wait()) or pb_utils.InferenceResponse() for r, a in zip(requests, answers)]

    def finalize(self) -> None:
        if self._metrics is not None:
            self._metrics.stop()
        if self._entry is not None:
            directory.remove(self._name, self._entry)
        self._link.close()

    def _call(self, triton_request) -> Call | Failure:
        """The request as a :class:`Call`; a :class:`Failure` when it does not carry the stage credential."""
        parameters = _parameters(triton_request)
        if parameters is None:
            return failure(0, Unauthenticated(
                f"stage model {self._name} answers only the deployment's own callers (the request carries no valid "
                f"{auth.CREDENTIAL}); clients call the entry models or the OpenAI API"))
        inputs = {}
        for name in self._inputs:
            tensor = pb_utils.get_input_tensor_by_name(triton_request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        traceparent = parameters.get(tracing.PARAMETER)
        return Call(0, inputs, list(triton_request.requested_output_names()), parameters,
                    traceparent=traceparent if isinstance(traceparent, str) else None)

    def _send(self, call: Call | Failure, target) -> None:
        if isinstance(call, Failure):
            return target(call)
        try:
            self._link.send(call, target)
        except NoWorker:
            target(failure(0, Unavailable(f"the {self._name} stage's worker did not take the request (it is not running)")))

    def _response(self, triton_request, message):
        """A message as a Triton response (None for a stream's end that carries no outputs)."""
        if isinstance(message, Gone):
            message = failure(message.id, Unavailable(f"the {self._name} stage's worker is stopping"))
        if isinstance(message, Failure):
            return pb_utils.InferenceResponse(error=triton_error(error_of(message)))
        if not message.outputs:
            return None
        wanted = set(triton_request.requested_output_names()) or set(self._outputs)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor(name, np.asarray(value).astype(self._outputs[name]))
            for name, value in message.outputs.items() if name in wanted and name in self._outputs])

    def _stream(self, request, call: Call | Failure) -> None:
        sender = request.get_response_sender()

        def on_message(message) -> None:
            last = ends(message)
            final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0
            response = self._response(request, message)
            if isinstance(message, (Failure, Gone)):  # an error response, then the flag
                sender.send(response, 0)
                sender.send(None, final)
            else:
                sender.send(response, final)  # the end may come without a response (then only the flag goes)

        self._send(call, on_message)
