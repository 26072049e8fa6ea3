"""The python-backend side of a stage model: PyTriton's proxy, with Trident's errors carrying their status.

:mod:`trident.workers.bind` copies this file over PyTriton's ``model.py`` in the stage model's folder; the
python-backend stub runs it inside Triton. A failed request arrives from the worker as
:func:`trident.errors.to_wire`'s envelope and leaves as a ``TritonError`` with the error class's code
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
from pytriton.proxy.types import Request

from trident import auth, timings
from trident.errors import Unauthenticated, Unavailable, client_message, from_wire, to_wire
from trident.protocol import REQUEST_ID, STAGE_ERROR_MARK, WORKER_FILE
from trident.workers import channel, wire

HANDSHAKE_S = 120.0  # how long a model's later instances wait for its first instance's config socket
_worker: dict = {}  # {"pid": ..., "name": ...} of this stub's worker


def triton_error(payload: str):
    """A ``pb_utils.TritonError`` for an error envelope (or PyTriton's own text)."""
    error = from_wire(payload)
    code = getattr(pb_utils.TritonError, error.triton_code, pb_utils.TritonError.INTERNAL)
    return pb_utils.TritonError(client_message(error), code)


def _from_scheduler(request) -> bool:
    try:
        return REQUEST_ID in json.loads(request.parameters() or "{}")
    except (ValueError, AttributeError):
        return False


def _lost_worker() -> bytes:
    pid = f" (pid {_worker['pid']})" if "pid" in _worker else ""
    error = Unavailable(f"the {_worker.get('name', 'stage')} stage's worker{pid} exited; the request was lost "
                        "with it (the server restarts the worker)")
    return to_wire(error).encode()


def _send_stream(triton_requests, senders, flags: int, payload: bytes, responses: list) -> None:
    """One response of a decoupled stage to Triton (``responses``: the wrapped ones, unless an error)."""
    eos, error = bool(flags & channel.EOS), bool(flags & channel.ERROR)
    flags_out = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if eos else 0
    if error:
        responses = [pb_utils.InferenceResponse(error=triton_error(payload.decode("utf-8"))) for _ in senders]
    if eos:  # the end of the stream may come without a response (then only the flag goes)
        responses = responses or [None] * len(senders)
    for request, sender, response in zip(triton_requests, senders, responses):
        if error and eos:
            # Triton 2.51 loses an error response that follows others on its way to a BLS caller (its stream
            # then ends as if complete, or never): the scheduler gets the error in the final response's
            # finish_reason; other callers as an error response, then the flag.
            if _from_scheduler(request):
                mark = np.array([STAGE_ERROR_MARK + payload], dtype=np.object_)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("finish_reason", mark)]), flags_out)
            else:
                sender.send(response, 0)
                sender.send(None, flags_out)
            continue
        sender.send(response, flags_out)


class _ChannelServer:
    """Stands in for PyTriton's ``TritonRequestsServer`` (same constructor; PyTriton's ``initialize`` makes it
    and runs :meth:`run` on a thread of its own): the stage's calls go over :class:`channel.StubChannel`.

    A one-answer stage's ``execute`` sends the request and waits for the response on its own thread; a
    decoupled stage's returns at once and the reader thread sends each response to Triton."""

    def __init__(self, url, responses_handle_fn, serializer_deserializer, model_config) -> None:
        self._serializer = serializer_deserializer
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

    def _request(self, triton_request, parameters: dict) -> Request:
        data = {}
        for name in self._inputs:
            tensor = pb_utils.get_input_tensor_by_name(triton_request, name)
            if tensor is not None:
                data[name] = tensor.as_numpy()
        return Request(data=data, parameters=parameters,
                       requested_output_names=list(triton_request.requested_output_names()))

    def _responses(self, triton_requests, payload: bytes) -> list:
        if not payload:
            return []
        return [
            _proxy._wrap_response(response, request.requested_output_names(), self._outputs)
            for request, response in zip(triton_requests, self._serializer.deserialize_responses(payload))
        ]

    def submit(self, triton_requests):
        """``execute``: the responses of a one-answer stage; None for a decoupled one (sent as they come).

        A request without the stage credential (:mod:`trident.auth`) is refused here, before the worker sees it."""
        parameters = [self._parameters(r) for r in triton_requests]
        if any(p is None for p in parameters):
            return self._refuse(triton_requests, parameters)
        payload = self._serializer.serialize_requests([self._request(r, p) for r, p in zip(triton_requests, parameters)])
        if self._decoupled:
            senders = [r.get_response_sender() for r in triton_requests]
            first = [True]

            def on_response(flags: int, data: bytes) -> None:
                t_in = time.monotonic_ns() if first[0] else 0
                responses = [] if flags & channel.ERROR else self._responses(triton_requests, data)
                _send_stream(triton_requests, senders, flags, data, responses)
                if first[0] and not flags & channel.EOS:
                    timings.mark("first_response", t_in)
                    first[0] = False

            try:
                self.channel.send(payload, on_response)
            except channel.NoWorker:
                on_response(channel.EOS | channel.ERROR, _no_worker())
            return None
        answer = channel.OneAnswer()
        try:
            self.channel.send(payload, answer)
            flags, data = answer.wait(lambda: self._reader is not None and self._reader.is_alive())
        except channel.NoWorker:
            flags, data = channel.EOS | channel.ERROR, _no_worker()
        if flags & channel.ERROR:
            return [pb_utils.InferenceResponse(error=triton_error(data.decode("utf-8"))) for _ in triton_requests]
        return self._responses(triton_requests, data)


    def _refuse(self, triton_requests, parameters: list):
        """Answer the requests without the credential with :class:`~trident.errors.Unauthenticated`, then submit the
        others (a batch of requests is one caller's in practice: each is judged alone all the same)."""
        error = to_wire(Unauthenticated(
            f"stage model {_worker.get('name', 'this')} answers only the deployment's own callers (the request "
            f"carries no valid {auth.CREDENTIAL}); clients call the entry models or the OpenAI API")).encode()
        refused = [r for r, p in zip(triton_requests, parameters) if p is None]
        kept = [r for r, p in zip(triton_requests, parameters) if p is not None]
        answers = dict.fromkeys(map(id, refused), pb_utils.InferenceResponse(error=triton_error(error.decode())))
        if self._decoupled:
            for request in refused:
                request.get_response_sender().send(answers[id(request)], pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            if kept:
                self.submit(kept)
            return None
        answers.update(zip(map(id, kept), self.submit(kept) if kept else []))
        return [answers[id(r)] for r in triton_requests]


def _no_worker() -> bytes:
    name = _worker.get("name", "this")
    return to_wire(Unavailable(f"the {name} stage's worker did not take the request (it is not running)")).encode()


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
_proxy.TensorStoreSerializerDeserializer = wire.InlineSerializer  # the worker's side: bind._install_proxy_model
_proxy.TritonRequestsServer = _ChannelServer
