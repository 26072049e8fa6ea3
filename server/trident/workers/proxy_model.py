"""The python-backend side of a stage model: PyTriton's proxy, with Trident's errors carrying their status.

:mod:`trident.workers.bind` copies this file over PyTriton's ``model.py`` in the stage model's folder; the
python-backend stub runs it inside Triton. A failed request arrives from the worker as
:func:`trident.errors.to_wire`'s envelope and leaves as a ``TritonError`` with the error class's code
(INVALID_ARG -> HTTP 400, UNAVAILABLE -> 503, ...) and the message ``"<ClassName>: <message>"``, for
decoupled stages as an error response, for the others as the request's error response instead of an
exception wrapped in the stub's traceback.
"""

import time

import triton_python_backend_utils as pb_utils  # type: ignore  # provided by the python-backend stub
from pytriton.proxy import model as _proxy

from trident import timings
from trident.errors import client_message, from_wire


def triton_error(payload: str):
    """A ``pb_utils.TritonError`` for an error envelope (or PyTriton's own text)."""
    error = from_wire(payload)
    code = getattr(pb_utils.TritonError, error.triton_code, pb_utils.TritonError.INTERNAL)
    return pb_utils.TritonError(client_message(error), code)


class _BackendUtils:
    """``pb_utils`` as PyTriton's proxy sees it: errors it builds from a payload get their code."""

    def __getattr__(self, name):
        return getattr(pb_utils, name)

    @staticmethod
    def TritonError(error="", code=None):  # noqa: N802 (pb_utils' name)
        return triton_error(error)


class _BatchResponses(_proxy.BatchResponsesHandler):
    """Non-decoupled stages: a failed request gets an error response, not a raised exception."""

    async def handle_responses(self, scope, responses_queue, responses_future):
        from concurrent.futures import Future

        inner: Future = Future()
        result = await super().handle_responses(scope, responses_queue, inner)
        if isinstance(result, pb_utils.TritonModelException):
            result = [pb_utils.InferenceResponse(error=triton_error(str(result)))]
        responses_future.set_result(result)
        return result


class TritonPythonModel(_proxy.TritonPythonModel):
    """PyTriton's proxy; with ``TRIDENT_TRACE_DIR`` set it notes when each request reaches the stub."""

    def initialize(self, args):
        timings.start(f"proxy-{args['model_name']}")
        return super().initialize(args)

    def execute(self, requests):
        timings.mark("execute", time.monotonic_ns())
        return super().execute(requests)


_proxy.pb_utils = _BackendUtils()
_proxy.BatchResponsesHandler = _BatchResponses
