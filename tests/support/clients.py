"""tritonclient helpers for the end-to-end tests: an entry-model request over gRPC or HTTP, a stage model called
directly."""

from __future__ import annotations

import json
import queue
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np


def credential() -> dict:
    """The request parameters of a caller that proves the deployment secret (the tests share the servers' secret:
    tests/conftest.py), as the BLS does for each stage call."""
    from trident.core import auth

    return {auth.CREDENTIAL: auth.credential()}


@dataclass
class Result:
    text: str
    finish_reason: str | None  # the last response's
    num_input_tokens: int | None
    num_output_tokens: int | None  # the responses' summed (each counts its own tokens)
    responses: int
    outputs: list[dict] = field(default_factory=list)  # each response's outputs besides text_output, by name

    @property
    def logprobs(self) -> list[dict]:
        """Every token's logprob entry, over the responses (each response's ``logprobs`` JSON holds its own)."""
        return [entry for o in self.outputs for entry in json.loads(o["logprobs"]) or ()]


def by_kind(media: list[str] | dict[str, list[str]] | None) -> dict[str, list[str]]:
    """A request's media by entry input: a plain list is images."""
    if not media:
        return {}
    return {k: v for k, v in media.items() if v} if isinstance(media, dict) else {"image": list(media)}


ADDITIONAL = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
"""The additional outputs the helpers ask for unless told otherwise (``flags``)."""
LOGPROB_FLAGS = ("return_logprobs", "return_cumulative_logprob")


def entry_inputs(text: str, images, params: dict | str | None, stream: bool, exclude: bool = True,
                 flags=ADDITIONAL):
    """(name, numpy array, Triton dtype) of an entry-model request; ``images`` is a list of base64 images or
    a dict of media by input (``image``, ``video``, ``audio``); ``flags``: the ``return_*`` outputs asked for."""
    out = [("text_input", np.array([text.encode()], dtype=np.object_), "BYTES")]
    for kind, items in by_kind(images).items():
        out.append((kind, np.array([i.encode() for i in items], dtype=np.object_), "BYTES"))
    if params is not None:
        sp = params if isinstance(params, str) else json.dumps(params)
        out.append(("sampling_parameters", np.array([sp.encode()], dtype=np.object_), "BYTES"))
    out.append(("stream", np.array([stream]), "BOOL"))
    out.append(("exclude_input_in_output", np.array([exclude]), "BOOL"))
    for flag in flags:
        out.append((flag, np.array([True]), "BOOL"))
    return out


def _scalar(result, name):
    value = result.as_numpy(name)
    if value is None or value.size == 0:
        return None
    v = value.reshape(-1)[0]
    return v.decode() if isinstance(v, bytes) else float(v) if isinstance(v, np.floating) else int(v)


OUTPUTS = ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens")


def grpc_generate(url: str, model: str, text: str, images, params, stream: bool, timeout: float = 120,
                  parameters: dict | None = None, flags=ADDITIONAL, headers: dict | None = None) -> Result:
    import tritonclient.grpc as grpcclient

    inputs = _grpc_inputs(grpcclient, {name: (arr, dtype) for name, arr, dtype in
                                       entry_inputs(text, images, params, stream, flags=flags)})
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)), headers=headers)
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True, parameters=parameters)
        parts, outputs = [], []
        while True:
            result, error = q.get(timeout=timeout)
            if error is not None:
                raise error
            response = result.get_response()
            final = response.parameters.get("triton_final_response")
            text_out = result.as_numpy("text_output")
            if text_out is not None and text_out.size:
                parts.append(text_out.reshape(-1)[0].decode())
                outputs.append({name: _scalar(result, name) for name in OUTPUTS if result.as_numpy(name) is not None})
            if final is not None and final.bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    last = outputs[-1] if outputs else {}
    counts = [o["num_output_tokens"] for o in outputs if "num_output_tokens" in o]
    return Result("".join(parts), last.get("finish_reason"), last.get("num_input_tokens"), sum(counts) if counts else None,
                  len(outputs), outputs)


def http_generate(url: str, model: str, text: str, images, params, timeout: float = 120, parameters: dict | None = None):
    """POST /v2/models/<model>/generate; returns (status code, JSON body). ``images`` as for
    :func:`entry_inputs`."""
    import requests

    body: dict = {"text_input": text, "exclude_input_in_output": True, "return_finish_reason": True,
                  "return_num_input_tokens": True, "return_num_output_tokens": True}
    body.update(by_kind(images))
    if params is not None:
        body["sampling_parameters"] = params if isinstance(params, str) else json.dumps(params)
    body.update(parameters or {})  # keys that name no input are the request's parameters
    r = requests.post(f"http://{url}/v2/models/{model}/generate", json=body, timeout=timeout)
    return r.status_code, r.json()


@contextmanager
def cancellable_stream(url: str, model: str, text: str, images, params, timeout: float = 120, stream: bool = True):
    """A gRPC request on a stream (``stream``: the entry's flag, whether it answers token by token); yields a
    function that waits for its next response (which must not be an error). Leaving the block cancels the
    request and closes the client."""
    import tritonclient.grpc as grpcclient

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    inputs = _grpc_inputs(grpcclient, {n: (a, d) for n, a, d in entry_inputs(text, images, params, stream)})

    def next_response():
        result, error = q.get(timeout=timeout)
        assert error is None, error
        return result

    try:
        client.async_stream_infer(model, inputs)
        yield next_response
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def _grpc_inputs(grpcclient, inputs: dict) -> list:
    tensors = []
    for name, (arr, dtype) in inputs.items():
        t = grpcclient.InferInput(name, arr.shape, dtype)
        t.set_data_from_numpy(arr)
        tensors.append(t)
    return tensors


def strings(*values: str | bytes) -> tuple[np.ndarray, str]:
    """A BYTES tensor."""
    return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_), "BYTES"


def stage_output(url: str, model: str, inputs: dict) -> bytes:
    """Call a non-decoupled stage model (encode, prefill, encode_prefill) over gRPC; returns its record."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    out_name = "embedding_meta" if model == "encode" else "kv_meta"
    value = client.infer(model, _grpc_inputs(grpcclient, inputs), parameters=credential()).as_numpy(out_name).reshape(-1)[0]
    assert isinstance(value, bytes)
    return value


def drain_kv(url: str, kv: bytes, text: str | None = None) -> None:
    """Decode a ``kv_meta`` for two tokens through the decode stage, so nothing waits for its lease."""
    error = decode_kv(url, kv, text)
    assert error is None, error


def decode_kv(url: str, kv: bytes, text: str | None = None, model: str = "decode"):
    """Call the decode stage model ``model`` with a ``kv_meta`` for two tokens: its error (tritonclient's), or None once
    it answers."""
    import tritonclient.grpc as grpcclient

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    inputs = {"kv_meta": strings(kv), "sampling_parameters": strings(json.dumps({"max_tokens": 2, "temperature": 0}))}
    if text is not None:  # the vllm decode stage needs the prompt
        inputs["text_input"] = strings(text)
    try:
        client.async_stream_infer(model, _grpc_inputs(grpcclient, inputs), parameters=credential())
        return q.get(timeout=60)[1]
    finally:
        client.stop_stream()
        client.close()
