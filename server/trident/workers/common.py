"""What every stage worker shares: the context (engine roles, transfer endpoint), request parsing and
turning decode events into entry-interface responses."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import numpy as np

from ..engines.base import DecodeEvent
from ..engines.hf import HFDecoder, HFEncoder, HFModel, HFPrefiller
from ..errors import InvalidRequest
from ..media import decode_base64_image
from ..processor import SamplingParams
from ..transfer import TransferEndpoint

@dataclass
class WorkerContext:
    """A worker's engine roles and transfer endpoint; blocking work runs on one compute thread."""

    model: HFModel
    endpoint: TransferEndpoint | None
    encoder: HFEncoder | None = None
    prefiller: HFPrefiller | None = None
    decoder: HFDecoder | None = None

    def __post_init__(self) -> None:
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="trident-compute")

    @property
    def processor(self):
        return self.model.processor

    async def run(self, fn: Callable, *args) -> Any:
        """Run blocking work (encode, prefill, a READ) off the event loop, one at a time."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    def close(self) -> None:
        if self.decoder is not None:
            self.decoder.close()
        if self.endpoint is not None:
            self.endpoint.close()
        self._compute.shutdown(wait=False, cancel_futures=True)


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


def images(request) -> list:
    value = request.data.get("image") if hasattr(request, "data") else request.get("image")
    if value is None:
        return []
    return [decode_base64_image(v, i) for i, v in enumerate(np.asarray(value).reshape(-1))]


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


def record_output(name: str, record) -> dict[str, np.ndarray]:
    return {name: np.array([record.encode()], dtype=np.object_)}


async def entry_responses(
    events: AsyncIterator[DecodeEvent], opts: OutputOptions, prompt: str | None, num_input_tokens: int
) -> AsyncIterator[list[dict[str, np.ndarray]]]:
    """Decode events -> entry responses: one per event when streaming, else one with the whole text."""

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


# -- pieces of the stages that keep data in this process --------------------------------------------------
def local_prefill(ctx: WorkerContext, text: str, imgs: list, params: SamplingParams):
    """Encode (if there are images) and prefill in this process. Blocking: call through ``ctx.run``."""
    from ..stages import prepare_prompt, run_prefill

    ctx.processor.check_placeholders(text, len(imgs))  # before spending time on the vision tower
    emb = ctx.encoder.encode(imgs) if imgs else None
    prompt = prepare_prompt(ctx.processor, text, emb.token_counts if emb else [])
    return run_prefill(ctx.prefiller, prompt, emb, params)


async def decode_here(ctx: WorkerContext, request, opts: OutputOptions, prompt: str | None):
    """Decode a :class:`~trident.engines.base.DecodeRequest` in this worker and yield entry responses."""
    stream = ctx.decoder.submit(request, asyncio.get_running_loop())
    try:
        async for responses in entry_responses(stream, opts, prompt, request.prompt_len):
            yield responses
    finally:
        stream.cancel()  # no-op once finished; stops a request whose client went away
