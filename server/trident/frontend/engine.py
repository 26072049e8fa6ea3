"""What the HTTP layer needs from a generation engine (a :class:`typing.Protocol`), and its Triton gRPC
implementation. Failures are :mod:`trident.errors` classes, which carry their HTTP status."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

import numpy as np

from .. import tracing
from ..errors import TridentError, Unavailable, from_message


@dataclass
class Chunk:
    """One streamed piece of a generation; the last one has ``finish_reason``. ``num_output_tokens``: the tokens
    generated so far; ``logprobs``: the entries of this piece's tokens, when the request asked for them (each
    ``{token id: {"logprob", "rank", "decoded_token"}}``, the sampled token's first)."""

    text: str
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    logprobs: list[dict] | None = None


class Engine(Protocol):
    async def generate(
        self, mode: str, prompt: str, media: dict[str, list[str]], sampling: dict, request_id: str,
        traceparent: str | None = None,
    ) -> AsyncIterator[Chunk]:
        """Stream a generation from entry model ``mode``; ``media`` holds base64 strings by kind (``image``,
        ``video``, ``audio``); ``traceparent``: the request's span, when it is traced. Raises a
        :class:`~trident.errors.TridentError` (its class says the status)."""
        ...

    async def ready_modes(self, modes: list[str]) -> list[str]:
        """The entry models among ``modes`` that are loaded and ready."""
        ...

    async def server_ready(self) -> bool:
        """Whether the server is READY (not while it starts, nor while it drains as it stops)."""
        ...


def _scalar(result, name):
    value = result.as_numpy(name)
    if value is None or value.size == 0:
        return None
    v = value.reshape(-1)[0]
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else int(v)


class TritonEngine:
    """Streams from Triton entry models over gRPC (``tritonclient.grpc.aio``)."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc.aio as grpcclient

        self._grpc = grpcclient
        self.url = url
        self._client = None

    @property
    def client(self):
        """The gRPC client, made inside the serving event loop on first use."""
        if self._client is None:
            self._client = self._grpc.InferenceServerClient(self.url)
        return self._client

    def _inputs(self, prompt: str, media: dict[str, list[str]], sampling: dict) -> list:
        g = self._grpc
        spec = [
            ("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
            ("stream", np.array([True]), "BOOL"),
            ("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"),
            ("exclude_input_in_output", np.array([True]), "BOOL"),
            ("return_finish_reason", np.array([True]), "BOOL"),
            ("return_num_input_tokens", np.array([True]), "BOOL"),
            ("return_num_output_tokens", np.array([True]), "BOOL"),
        ]
        if sampling.get("logprobs") is not None:
            spec.append(("return_logprobs", np.array([True]), "BOOL"))
        for kind, items in media.items():
            if items:
                spec.append((kind, np.array([i.encode() for i in items], dtype=np.object_), "BYTES"))
        out = []
        for name, arr, dtype in spec:
            t = g.InferInput(name, list(arr.shape), dtype)
            t.set_data_from_numpy(arr)
            out.append(t)
        return out

    async def generate(self, mode, prompt, media, sampling, request_id, traceparent=None):
        request = {"model_name": mode, "inputs": self._inputs(prompt, media, sampling), "request_id": request_id}
        if traceparent is not None:
            request["parameters"] = {tracing.PARAMETER: traceparent}

        async def requests():
            yield request

        generated = 0  # (each response counts its own tokens, as the vLLM backend's do)
        try:
            async for result, error in self.client.stream_infer(requests()):
                if error is not None:
                    raise await self._error(mode, str(error.message() if hasattr(error, "message") else error))
                reason = _scalar(result, "finish_reason")
                generated += _scalar(result, "num_output_tokens") or 0
                logprobs = _scalar(result, "logprobs")
                chunk = Chunk(
                    text=_scalar(result, "text_output") or "",
                    finish_reason=None if reason == "None" else reason,  # ("None": not the last response)
                    num_input_tokens=_scalar(result, "num_input_tokens"),
                    num_output_tokens=generated,
                    logprobs=json.loads(logprobs) if logprobs else None,
                )
                yield chunk
                if chunk.finish_reason is not None:
                    return
        except TridentError:
            raise
        except Exception as e:  # connection refused, server gone
            raise Unavailable(f"the Triton server at {self.url} is unavailable: {type(e).__name__}") from None

    async def _error(self, mode: str, message: str) -> TridentError:
        """The error of a failed stream: the Trident error its message names (a gRPC stream carries only a
        message), else Triton's own: the entry model not loaded (503) or an internal error."""
        error = from_message(message)
        if error is not None:
            return error
        if mode not in await self.ready_modes([mode]):
            return Unavailable(f"mode {mode} is not loaded: {message}")
        return TridentError(message)

    async def server_ready(self):
        try:
            return bool(await self.client.is_server_ready())
        except Exception:
            return False

    async def ready_modes(self, modes):
        ready = []
        for mode in modes:
            try:
                if await self.client.is_model_ready(mode):
                    ready.append(mode)
            except Exception:
                pass
        return ready
