"""How a stage's requests and responses cross between its python-backend stub and its worker: inline in the
ZeroMQ message, as msgpack.

PyTriton's default puts every tensor in its tensor store: shared memory whose blocks a third process (a
``multiprocessing`` manager) hands out and takes back, one RPC to allocate the tensors of a message and one
to release each tensor, besides JSON around the block ids. A stage call sends a few small tensors (records
under 1 KiB, a prompt, sampling parameters) and gets one back; a decode stream sends one message per
token. The round trips to the manager cost more than the data. Here the tensors travel in the message itself,
as PyTriton's own header + data frames, and nothing is left to release.

The stub (:mod:`.proxy_model`) and the worker (:mod:`.bind`) both install :class:`InlineSerializer` in place
of PyTriton's ``TensorStoreSerializerDeserializer`` (PyTriton 0.7 offers no setting for it); the two sides must
agree.
"""

from __future__ import annotations

from typing import Any

import time

import msgspec
from pytriton.proxy.data import (
    BaseRequestsResponsesSerializerDeserializer,
    deserialize_numpy_with_struct_header,
    serialize_numpy_with_struct_header,
)
from pytriton.proxy.types import Request, Response

from .. import timings

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def _frames(tensor) -> list:
    """PyTriton's header + data frames; data in a Fortran-ordered array's own memory order (its header says
    so), as bytes, since msgpack takes only C-contiguous buffers."""
    header, data = serialize_numpy_with_struct_header(tensor)
    if isinstance(data, memoryview) and not data.c_contiguous:
        data = data.tobytes(order="A")
    return [header, data]


def _pack(tensors: dict) -> dict[str, list]:
    return {name: _frames(tensor) for name, tensor in tensors.items()}


def _unpack(frames: dict[str, list]) -> dict:
    return {name: deserialize_numpy_with_struct_header(parts) for name, parts in frames.items()}


class InlineSerializer(BaseRequestsResponsesSerializerDeserializer):
    """PyTriton's serializer interface, with the tensors inline (see the module docstring)."""

    def serialize_requests(self, requests) -> bytes:
        t0 = time.monotonic_ns()
        out: list[dict[str, Any]] = []
        for request in requests:
            item: dict[str, Any] = {"data": _pack(request.data), "parameters": request.parameters}
            if request.span is not None:
                from pytriton.proxy.telemetry import get_span_dict

                item["span"] = get_span_dict(request.span)
            if request.requested_output_names is not None:
                item["requested_output_names"] = list(request.requested_output_names)
            out.append(item)
        try:
            return _encoder.encode(out)
        finally:
            timings.mark("wire_pack", t0)

    def deserialize_requests(self, requests_payload: bytes):
        t0 = time.monotonic_ns()
        requests = []
        for item in _decoder.decode(requests_payload):
            kwargs: dict[str, Any] = {"data": _unpack(item["data"]), "parameters": item.get("parameters")}
            if "span" in item:
                from pytriton.proxy.telemetry import start_span_from_remote

                kwargs["span"] = start_span_from_remote(item["span"], "proxy_inference_callable")
            if "requested_output_names" in item:
                kwargs["requested_output_names"] = item["requested_output_names"]
            requests.append(Request(**kwargs))
        timings.mark("wire_unpack", t0)
        return requests

    def serialize_responses(self, responses) -> bytes:
        """``responses``: the inference callable's output dicts (name -> array), as PyTriton passes them."""
        t0 = time.monotonic_ns()
        try:
            return _encoder.encode([_pack(response) for response in responses])
        finally:
            timings.mark("wire_pack", t0)

    def deserialize_responses(self, responses_payload: bytes):
        if not responses_payload:
            return []
        t0 = time.monotonic_ns()
        try:
            return [Response(data=_unpack(frames)) for frames in _decoder.decode(responses_payload)]
        finally:
            timings.mark("wire_unpack", t0)

    def free_requests_resources(self, requests_payload: bytes) -> None:
        """Nothing to free: the tensors were in the message."""

    def free_responses_resources(self, responses_payload: bytes) -> None:
        """Nothing to free: the tensors were in the message."""

    def start(self, url, authkey=None) -> None:
        """No store to start."""

    def connect(self, url, authkey=None) -> None:
        """No store to connect to."""

    def close(self) -> None:
        """No store to close."""
