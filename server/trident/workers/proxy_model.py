"""The python-backend side of a stage model: PyTriton's proxy, with Trident's errors carrying their status.

:mod:`trident.workers.bind` copies this file over PyTriton's ``model.py`` in the stage model's folder; the
python-backend stub runs it inside Triton. A failed request arrives from the worker as a
:class:`~trident.protocol.Failure` and leaves as a ``TritonError`` with the error class's code
(INVALID_ARG -> HTTP 400, UNAVAILABLE -> 503, ...) and the message ``"<ClassName>: <message>"``, for
decoupled stages as an error response, for the others as the request's error response instead of an
exception wrapped in the stub's traceback.
"""

import json
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils  # type: ignore  # provided by the python-backend stub
from pytriton.proxy import model as _proxy

from trident import auth, timings
from trident.errors import TridentError, Unauthenticated, Unavailable, client_message, to_wire
from trident.protocol import REQUEST_ID, STAGE_ERROR_MARK, WORKER_FILE, Call, Failure, Gone, error_of, failure
from trident.workers import channel

HANDSHAKE_S = 120.0  # how long a model's later instances wait for its first instance's config socket
_worker: dict = {}  # {"pid": ..., "name": ...} of this stub's worker


def triton_error(error: TridentError):
    """A ``pb_utils.TritonError`` for a Trident error, with its class's code."""
    code = getattr(pb_utils.TritonError, error.triton_code, pb_utils.TritonError.INTERNAL)
    return pb_utils.TritonError(client_message(error), code)


def _from_scheduler(request) -> bool:
    try:
        return REQUEST_ID in json.loads(request.parameters() or "{}")
    except (ValueError, AttributeError):
        return False


def _lost_worker() -> Exception:
    pid = f" (pid {_worker['pid']})" if "pid" in _worker else ""
    return Unavailable(f"the {_worker.get('name', 'stage')} stage's worker{pid} exited; the request was lost "
                       "with it (the server restarts the worker)")


def _no_worker() -> Exception:
    name = _worker.get("name", "this")
    return Unavailable(f"the {name} stage's worker did not take the request (it is not running)")


def _send_stream(request, sender, message, response) -> None:
    """One message of a decoupled stage's call to Triton (``response``: its outputs wrapped, if any)."""
    eos = channel.ends(message)
    flags_out = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if eos else 0
    if isinstance(message, Failure):
        error = error_of(message)
        if _from_scheduler(request):
            # Triton 2.51 loses an error response that follows others on its way to a BLS caller (its stream
            # then ends as if complete, or never): the scheduler gets the error in the final response's
            # finish_reason; other callers as an error response, then the flag.
            mark = np.array([STAGE_ERROR_MARK + to_wire(error).encode()], dtype=np.object_)
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("finish_reason", mark)]), flags_out)
        else:
            sender.send(pb_utils.InferenceResponse(error=triton_error(error)), 0)
            sender.send(None, flags_out)
        return
    sender.send(response, flags_out)  # the end of the stream may come without a response (then only the flag goes)


class _ChannelServer:
    """Stands in for PyTriton's ``TritonRequestsServer`` (same constructor; PyTriton's ``initialize`` makes it
    and runs :meth:`run` on a thread of its own): the stage's calls go over :class:`channel.StubChannel`, one
    :class:`~trident.protocol.Call` per Triton request.

    A one-answer stage's ``execute`` sends the calls and waits for their answers on its own thread; a
    decoupled stage's returns at once and the reader thread sends each response to Triton."""

    def __init__(self, url, responses_handle_fn, serializer_deserializer, model_config) -> None:
        self._inputs = [i["name"] for i in model_config["input"]]
        self._outputs = {o["name"]: o for o in model_config["output"]}
        self._decoupled = model_config.get("model_transaction_policy", {}).get("decoupled", False)
        self.channel = channel.StubChannel(url, _lost_worker)
        self._reader: threading.Thread | None = None

    def run(self) -> None:
        self._reader = threading.current_thread()
        try:
            self.channel.run()
        finally:
            self.channel.finish()

    def shutdown(self) -> None:
        self.channel.close()

    @staticmethod
    def _parameters(triton_request) -> dict | None:
        """The request's parameters without the stage credential; None when it does not carry the credential
        (nothing of it is read beyond its parameters)."""
        try:
            parameters = json.loads(triton_request.parameters() or "{}")
        except ValueError:
            return None
        if not isinstance(parameters, dict) or not auth.check_credential(parameters.pop(auth.CREDENTIAL, None)):
            return None
        return parameters

    def _call(self, triton_request, parameters: dict) -> Call:
        inputs = {}
        for name in self._inputs:
            tensor = pb_utils.get_input_tensor_by_name(triton_request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        return Call(0, inputs, list(triton_request.requested_output_names()), parameters)

    def _response(self, triton_request, message):
        if isinstance(message, Failure):
            return pb_utils.InferenceResponse(error=triton_error(error_of(message)))
        if isinstance(message, Gone) or not message.outputs:
            return None
        return _proxy._wrap_response(message.outputs, triton_request.requested_output_names(), self._outputs)

    def submit(self, triton_requests):
        """``execute``: the responses of a one-answer stage; None for a decoupled one (sent as they come).

        A request without the stage credential (:mod:`trident.auth`) is refused here, before the worker sees it."""
        parameters = [self._parameters(r) for r in triton_requests]
        if self._decoupled:
            for request, params in zip(triton_requests, parameters):
                self._stream(request, params)
            return None
        answers = []
        for request, params in zip(triton_requests, parameters):
            answer = channel.OneAnswer()
            if params is None:
                answer(failure(0, _refused()))
            else:
                try:
                    self.channel.send(self._call(request, params), answer)
                except channel.NoWorker:
                    answer(failure(0, _no_worker()))
            answers.append(answer)
        alive = lambda: self._reader is not None and self._reader.is_alive()  # noqa: E731
        return [self._response(r, a.wait(alive)) or pb_utils.InferenceResponse()
                for r, a in zip(triton_requests, answers)]

    def _stream(self, request, parameters: dict | None) -> None:
        sender = request.get_response_sender()
        first = [True]

        def on_message(message) -> None:
            t_in = time.monotonic_ns() if first[0] else 0
            _send_stream(request, sender, message, self._response(request, message))
            if first[0] and not channel.ends(message):
                timings.mark("first_response", t_in)
                first[0] = False

        if parameters is None:
            return on_message(failure(0, _refused()))
        try:
            self.channel.send(self._call(request, parameters), on_message)
        except channel.NoWorker:
            on_message(failure(0, _no_worker()))


def _refused() -> Exception:
    return Unauthenticated(
        f"stage model {_worker.get('name', 'this')} answers only the deployment's own callers (the request "
        f"carries no valid {auth.CREDENTIAL}); clients call the entry models or the OpenAI API")


class TritonPythonModel(_proxy.TritonPythonModel):
    """PyTriton's proxy over Trident's channel (:mod:`trident.workers.channel`); with ``TRIDENT_TRACE_DIR`` set
    it times each ``execute`` call."""

    def initialize(self, args):
        timings.start(f"proxy-{args['model_name']}")
        info = Path(args["model_repository"]) / args["model_version"] / WORKER_FILE
        try:
            _worker.update(json.loads(info.read_text()))
        except (OSError, ValueError):  # no worker file: requests wait on the worker without a watch
            pass
        return super().initialize(args)

    def execute(self, requests):
        t0 = time.monotonic_ns()
        try:
            return self._requests_server.submit(requests)  # a decoupled stage's returns at once
        finally:
            timings.mark("execute", t0)


_pytriton_handshake = _proxy.get_config_from_handshake_server


def patient_handshake(socket_path: Path, timeout_s: float = 1.0) -> dict:
    """PyTriton's config hand-shake, with time to wait. A stage model's second and later instances read their
    config from a socket that its first instance opens; Triton starts the instances side by side and PyTriton
    gives that socket 1 s to appear. On a busy machine the first instance takes longer to get there, and the
    model failed to load (``--vllm-prefill-calls 2`` at start-up beside vLLM engines). The socket is waited
    for up to :data:`HANDSHAKE_S`; the exchange itself keeps PyTriton's limit."""
    deadline = time.monotonic() + HANDSHAKE_S
    while not Path(socket_path).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return _pytriton_handshake(socket_path, timeout_s)


_proxy.get_config_from_handshake_server = patient_handshake
_proxy.TritonRequestsServer = _ChannelServer
