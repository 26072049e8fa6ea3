"""What every stage worker shares: request parsing and turning a generation into entry-interface responses."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np

from ..engines.base import DecodeEvent, Generation
from ..errors import InvalidRequest
from ..media import decode_base64_image
from ..processor import SamplingParams

# -- request inputs -------------------------------------------------------------------------------------
def _first(request, name: str):
    value = request.data.get(name) if hasattr(request, "data") else request.get(name)
    if value is None:
        return None
    arr = np.asarray(value).reshape(-1)
    return arr[0] if arr.size else None


def text_input(request) -> str:
    value = _first(request, "text_input")
    if value is None:
        raise InvalidRequest("text_input is required")
    return value.decode("utf-8", errors="strict") if isinstance(value, bytes) else str(value)


def bool_input(request, name: str, default: bool) -> bool:
    value = _first(request, name)
    return default if value is None else bool(value)


def bytes_input(request, name: str) -> bytes | None:
    """A STRING[1] input's bytes; None when absent or empty (an ensemble passes an empty record on)."""
    value = _first(request, name)
    if value is None or (isinstance(value, (bytes, str)) and len(value) == 0):
        return None
    return value if isinstance(value, bytes) else str(value).encode()


def _decode_images(request) -> list:
    value = request.data.get("image") if hasattr(request, "data") else request.get("image")
    if value is None:
        return []
    return [decode_base64_image(v, i) for i, v in enumerate(np.asarray(value).reshape(-1))]


async def images(request) -> list:
    """The request's images, decoded off the event loop (a large PNG takes a while)."""
    return await asyncio.to_thread(_decode_images, request)


def sampling(request) -> SamplingParams:
    return SamplingParams.from_json(_first(request, "sampling_parameters"))


@dataclass(frozen=True)
class OutputOptions:
    """The entry interface's output controls (Triton vLLM backend semantics)."""

    stream: bool = False
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False

    @classmethod
    def of(cls, request) -> "OutputOptions":
        return cls(**{f: bool_input(request, f, False) for f in cls.__dataclass_fields__})


def _string(value: str) -> np.ndarray:
    return np.array([value.encode("utf-8")], dtype=np.object_)


def record_output(name: str, record: bytes | None) -> dict[str, np.ndarray]:
    """A record as a STRING[1] output; an empty one when there is nothing to pass on."""
    return {name: np.array([record or b""], dtype=np.object_)}


async def entry_responses(
    generation: Generation, opts: OutputOptions, prompt: str | None
) -> AsyncIterator[list[dict[str, np.ndarray]]]:
    """A generation's events -> entry responses: one per event when streaming, else one with the whole text.
    Stops the generation if the client goes away."""
    events, num_input_tokens = generation.events, generation.num_input_tokens
    try:
        async for responses in _responses(events, opts, prompt, num_input_tokens):
            yield responses
    finally:
        await events.aclose()


async def _responses(events, opts: OutputOptions, prompt: str | None, num_input_tokens: int):
    def response(text: str, event: DecodeEvent | None) -> dict[str, np.ndarray]:
        out = {"text_output": _string(text)}
        if event is not None and event.finish_reason is not None:
            if opts.return_finish_reason:
                out["finish_reason"] = _string(event.finish_reason)
            if opts.return_num_input_tokens:
                out["num_input_tokens"] = np.array([num_input_tokens], dtype=np.uint32)
            if opts.return_num_output_tokens:
                out["num_output_tokens"] = np.array([event.num_output_tokens], dtype=np.uint32)
        return out

    if opts.stream:
        async for event in events:
            if event.text or event.finish_reason is not None:
                yield [response(event.text, event)]
        return
    text, last = [], None
    async for event in events:
        text.append(event.text)
        last = event
    if not opts.exclude_input_in_output and prompt:
        text.insert(0, prompt)
    yield [response("".join(text), last)]


def single(requests: list) -> Any:
    """Stage models run without batching: Triton hands over one request at a time."""
    if len(requests) != 1:
        raise InvalidRequest(f"expected one request per call, got {len(requests)}")
    return requests[0]
