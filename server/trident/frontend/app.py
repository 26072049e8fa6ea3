"""The OpenAI-compatible HTTP server: chat completions with images, video and audio, completions, models, health, metrics.

Routes are thin: :class:`OpenAIServer` turns a request into an entry-model call (mode, prompt, media,
sampling) on an :class:`Engine` (:class:`TritonEngine`: Triton's entry models over gRPC), and :mod:`.responses`
shapes what goes back. Errors are :mod:`trident.core.errors` classes; each answers with its own HTTP status (400 bad input, 404
unknown model or mode, 503 unavailable or overloaded with ``Retry-After``, 504 transfer timeout or expired
lease).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Protocol

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from trident.core import tracing
from trident.core.config import FrontendSettings
from trident.core.errors import InvalidRequest, NotFound, TridentError, Unavailable, from_message
from trident.core.media import MODALITIES, check_count
from trident.core.media.audio import input_audio_to_base64
from trident.core.media.urls import FetchBudget, media_url_to_base64
from trident.core.processor import SamplingParams
from trident.core.protocol import MODES
from trident.core.prompt_length import text_bytes_limit
from trident.frontend.api_keys import load_keys, require_keys
from trident.frontend.body_limit import BodyLimit
from trident.frontend.responses import DONE, Chunk, Completion, error_body, error_headers
from trident.frontend.schemas import ChatCompletionRequest, CompletionRequest, Message
from trident.frontend.tools import ToolChoice, ToolStream

log = logging.getLogger("trident.frontend")
KEEP_ALIVE_S = 65


_PART_KIND = {"image_url": "image", "video_url": "video", "input_audio": "audio", "audio_url": "audio"}
"""The media kind of each content-part type."""
_MESSAGE_EXTRAS = ("tool_calls", "tool_call_id", "name")  # what a message may carry to the template besides content


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["mode", "endpoint"]
        self.requests = Counter("trident_requests", "Requests received", labels, registry=self.registry)
        self.errors = Counter("trident_request_errors", "Requests that failed", [*labels, "status"], registry=self.registry)
        self.ttft = Histogram("trident_time_to_first_token_seconds", "Time to first token", ["mode"], registry=self.registry)
        self.itl = Histogram("trident_inter_token_latency_seconds", "Time between streamed chunks", ["mode"],
                             buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0), registry=self.registry)
        self.tokens_in = Counter("trident_prompt_tokens", "Prompt tokens", ["mode"], registry=self.registry)
        self.tokens_out = Counter("trident_generation_tokens", "Generated tokens", ["mode"], registry=self.registry)


def chat_tokenizer(model_path: str):
    """The checkpoint's tokenizer, for its chat template and special tokens (all the frontend renders with). From its
    ``tokenizer.json`` through the tokenizers library's class, as ``AutoTokenizer`` gives it, without importing
    torch: that import was most of the frontend's start-up (7.5 of 8 CPU seconds on these 2 cores) and half its
    memory. A checkpoint with no ``tokenizer.json`` (a slow, sentencepiece-only tokenizer) goes through
    ``AutoTokenizer``."""
    if (Path(model_path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


class OpenAIServer:
    """What the routes do, over one engine."""

    def __init__(self, settings: FrontendSettings, engine: Engine) -> None:
        self.settings = settings
        self.name = settings.served_name
        self.engine = engine
        self.tokenizer = chat_tokenizer(settings.model_path)
        self.text_limit = text_bytes_limit(settings.model_path)  # (the entry models' bound, applied before sending)
        self.metrics = Metrics()

    def resolve(self, req) -> str:
        """The mode a request's model id names; refuses what cannot be served before any other work."""
        mode = self.resolve_mode(req.model)
        asked = req.not_yet()
        if asked:
            raise InvalidRequest(f"not supported by Trident yet: {', '.join(asked)} (leave it out, or send its "
                                 "default)")
        SamplingParams.from_json(json.dumps(req.sampling(self.settings.default_max_tokens)))  # as the models would
        return mode

    def resolve_mode(self, model: str) -> str:
        name, _, mode = model.partition(":")
        if name != self.name or (mode and mode not in MODES):
            raise NotFound(f"model {model!r} does not exist; served: {self.name} (add :{'|:'.join(MODES)} to pick a mode)")
        return mode or self.settings.default_mode

    async def chat_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> tuple[str, dict[str, list[str]]]:
        """The chat template's prompt (one placeholder per media item; the ``tools``, where the template takes them) and
        the media as base64, by kind."""
        media: dict[str, list[str]] = {kind: [] for kind in MODALITIES}
        budget = FetchBudget(self.settings.media.max_bytes)  # what its URLs and files may bring, together
        converted = []
        parts = [p for m in messages if isinstance(m.content, list) for p in m.content]
        for kind in MODALITIES:
            check_count(kind, sum(_PART_KIND.get(p.type) == kind for p in parts))
        for m in messages:
            said = {k: v for k, v in (m.model_extra or {}).items() if k in _MESSAGE_EXTRAS}  # (a tool call, its answer)
            if not isinstance(m.content, list):
                converted.append({"role": m.role, "content": m.content or "", **said})
                continue
            parts = []
            for part in m.content:
                if part.type == "text":
                    parts.append({"type": "text", "text": part.text or ""})
                    continue
                kind = _PART_KIND[part.type]
                media[kind].append(await self._media_part(part, kind, len(media[kind]), budget))
                parts.append({"type": kind})
            converted.append({"role": m.role, "content": parts, **said})
        # (off the event loop: a long conversation takes a while to render, and other requests go on meanwhile)
        prompt = await asyncio.to_thread(self.tokenizer.apply_chat_template, converted, tools=tools, tokenize=False,
                                         add_generation_prompt=True)
        return prompt, {kind: items for kind, items in media.items() if items}

    async def _media_part(self, part, kind: str, index: int, budget: FetchBudget) -> str:
        """One media part's bytes as base64 (fetched or read where it is a URL or a path)."""
        if part.type == "input_audio":
            if part.input_audio is None:
                raise InvalidRequest("an input_audio part needs input_audio.data and input_audio.format")
            return input_audio_to_base64(part.input_audio.data, part.input_audio.format, index)
        url = getattr(part, part.type)
        if url is None:
            raise InvalidRequest(f"a {part.type} part needs {part.type}.url")
        return await media_url_to_base64(url.url, self.settings.media, index, kind, budget)

    async def _chunks(self, mode: str, endpoint: str, prompt: str, media: dict[str, list[str]], sampling: dict,
                      traceparent: str | None = None) -> AsyncIterator[Chunk]:
        """Generation chunks, timed and counted; traced as span ``openai`` (a child of the client's
        ``traceparent`` header, when it sent one)."""
        m = self.metrics
        m.requests.labels(mode, endpoint).inc()
        start = last = time.perf_counter()
        first = True
        span = tracing.open_span("openai", traceparent, endpoint=endpoint, mode=mode)
        try:
            async for chunk in self.engine.generate(mode, prompt, media, sampling, uuid.uuid4().hex,
                                                    tracing.traceparent(span) if span is not None else None):
                now = time.perf_counter()
                if first and span is not None:
                    span.add_event("first_chunk")
                (m.ttft if first else m.itl).labels(mode).observe(now - (start if first else last))
                first, last = False, now
                if chunk.finish_reason is not None:  # a choice's last (the prompt counted once, with the first's)
                    if chunk.index == 0:
                        m.tokens_in.labels(mode).inc(chunk.num_input_tokens or 0)
                    m.tokens_out.labels(mode).inc(chunk.num_output_tokens or 0)
                yield chunk
        except TridentError as e:
            m.errors.labels(mode, endpoint, str(e.http_status)).inc()
            if span is not None:
                span.set_attribute("error", type(e).__name__)
            raise
        finally:
            if span is not None:
                span.end()

    async def respond(self, req, endpoint: str, prompt: str, media: dict[str, list[str]], mode: str,
                      http: Request | None = None, tools: ToolChoice | None = None):
        """The response to a request: ``req.n`` choices of one generation (``sampling_parameters.n``: one prefill,
        choice i sampling with seed + i, as vLLM's children do), whole or streamed."""
        _check_text(prompt, self.text_limit)
        sampling = req.sampling(self.settings.default_max_tokens)
        traceparent = http.headers.get(tracing.PARAMETER) if http is not None else None
        chunks = self._chunks(mode, endpoint, prompt, media, sampling, traceparent)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        shape = Completion(endpoint, req.model, include_usage, sampling.get("logprobs"))
        if not req.stream:
            wholes = await _unless_gone(_collect(chunks, req.n), http)
            if wholes is None:  # the client went away: its generation has been stopped
                return Response(status_code=499)
            out = []
            for index, (text, last, logprobs) in enumerate(wholes):
                content, calls = tools.calls(text) if tools is not None else (text, [])
                reason = tools.finish_reason(last.finish_reason if last else None, calls) if tools else None
                out.append(shape.choice(index, content, last, logprobs, calls, reason))
            return JSONResponse(shape.whole(out, [last for _, last, _ in wholes]))
        # Streaming: an error before the first chunk is still a proper HTTP error.
        iterator = chunks.__aiter__()
        first = await _first_chunk(iterator)
        lasts: list[Chunk | None] = [None] * req.n
        opening = [True] * req.n  # choices whose first event is still to come
        held = [ToolStream(tools) if tools is not None and tools.kind != "none" else None for _ in range(req.n)]

        async def every():
            if first is not None:
                yield first
            async for c in iterator:
                yield c

        def events(c: Chunk):
            """A chunk's events (of its choice); the choice's last chunk in ``lasts``."""
            index = c.index
            lasts[index] = c
            if held[index] is not None:  # text out while no call can have begun; the calls as each can go
                text, deltas = held[index].feed(c.text)
                c = dataclasses.replace(c, text=text)
                if c.finish_reason is not None:
                    rest, calls, more = held[index].end()
                    c = dataclasses.replace(c, text=c.text + rest,
                                            finish_reason=tools.finish_reason(c.finish_reason, calls))
                    deltas += more
                if deltas:
                    yield shape.sse_tool_calls(deltas, opening[index], index)
                    opening[index] = False
                if c.finish_reason is None and not c.text and not c.logprobs:
                    return
            yield shape.sse(c, opening[index], index)
            opening[index] = False

        async def stream():
            try:
                async for c in every():
                    for event in events(c):
                        yield event
            except TridentError as e:
                yield shape.sse_error(e)
            finally:
                await iterator.aclose()
            if include_usage:
                yield shape.sse_usage(lasts)
            yield DONE

        return StreamingResponse(stream(), media_type="text/event-stream")


async def _first_chunk(iterator) -> Chunk | None:
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return None


async def _collect(chunks: AsyncIterator[Chunk], n: int) -> list[tuple[str, Chunk | None, list[dict]]]:
    """Each of ``n`` choices' whole text, last chunk, and every token's logprob entry (when asked for)."""
    texts: list[list[str]] = [[] for _ in range(n)]
    lasts: list[Chunk | None] = [None] * n
    logprobs: list[list[dict]] = [[] for _ in range(n)]
    async for c in chunks:
        texts[c.index].append(c.text)
        logprobs[c.index] += c.logprobs or ()
        lasts[c.index] = c
    return [("".join(t), last, entries) for t, last, entries in zip(texts, lasts, logprobs)]


async def _unless_gone(work, http: Request | None, every_s: float = 0.25):
    """``work``'s result; None, with ``work`` cancelled (its generation stopped as a dropped stream's is), once the
    client of ``http`` has gone away (looked for every ``every_s``)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            if http is not None and await http.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _check_text(prompt: str, limit: int | None = None) -> None:
    """JSON may carry lone surrogates (``"\\ud800"``), which are not text: a 400, not a failure later. ``limit``: the
    most UTF-8 bytes a prompt that fits the model's context window can have (the entry models' own bound), checked
    here before a prompt of tens of MiB goes to Triton."""
    try:
        size = len(prompt.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"the prompt is not valid UTF-8 text: {e.reason} at character {e.start} ({prompt[e.start]!r})"
        ) from None
    if limit is not None and size > limit:
        raise InvalidRequest(f"the prompt is {size} bytes as rendered: more than any prompt that fits the model's "
                             f"context window can have ({limit} bytes)")


def create_app(settings: FrontendSettings, engine: Engine) -> FastAPI:
    server = OpenAIServer(settings, engine)
    app = FastAPI(title="Trident OpenAI-compatible API")
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, deadline_s=settings.body_timeout_s,
                       total=settings.max_buffered_bytes)
    if settings.api_key_file is not None:  # (outside the body limit: a request without a key is not read)
        require_keys(app, load_keys(settings.api_key_file))

    @app.exception_handler(TridentError)
    async def _trident_error(_request, exc: TridentError):
        return JSONResponse(error_body(exc.message, exc.http_status), status_code=exc.http_status,
                            headers=error_headers(exc))

    @app.exception_handler(Exception)
    async def _internal_error(_request, exc: Exception):  # a bug: logged here, a short JSON error there
        log.exception("request failed")
        return JSONResponse(error_body(f"internal error ({type(exc).__name__})", 500), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):  # FastAPI's own: a body it cannot parse, 404, 405
        message = exc.detail if isinstance(exc.detail, str) else "invalid request"
        if exc.status_code == 400:  # (FastAPI says "There was an error parsing the body")
            message = "the request body is not JSON that can be read: malformed, nested too deeply or a number too long"
        return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors())
        return JSONResponse(error_body(f"invalid request: {problems}", 400), status_code=400)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http: Request):
        mode = server.resolve(req)
        tools = req.tool_choice_of()
        prompt, media = await server.chat_prompt(req.messages, tools.template_tools())
        return await server.respond(req, "chat", prompt, media, mode, http, tools)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: Request):
        return await server.respond(req, "completions", req.prompt, {}, server.resolve(req), http)

    @app.get("/v1/models")
    async def models():
        ready = await engine.ready_modes(list(MODES))
        ids = ([server.name] if settings.default_mode in ready else []) + [f"{server.name}:{m}" for m in ready]
        return {"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "trident"} for i in ids]}

    @app.get("/health")
    async def health():
        ready = await engine.ready_modes(list(MODES)) if await engine.server_ready() else []
        if not ready:  # (none while the server starts, or drains as it stops)
            return JSONResponse({"status": "unavailable", "modes": []}, status_code=503)
        return {"status": "ok", "modes": ready}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# -- the engine: what the routes need of one (a Protocol), and Triton's, over gRPC ---------------------------------
class Engine(Protocol):
    async def generate(
        self, mode: str, prompt: str, media: dict[str, list[str]], sampling: dict, request_id: str,
        traceparent: str | None = None,
    ) -> AsyncIterator[Chunk]:
        """Stream a generation from entry model ``mode``; ``media`` holds base64 strings by kind (``image``,
        ``video``, ``audio``); ``traceparent``: the request's span, when it is traced. Raises a
        :class:`~trident.core.errors.TridentError` (its class says the status)."""
        ...

    async def ready_modes(self, modes: list[str]) -> list[str]:
        """The entry models among ``modes`` that are loaded and ready."""
        ...

    async def server_ready(self) -> bool:
        """Whether the server is READY (not while it starts, nor while it drains as it stops)."""
        ...


def _elements(result, name: str, n: int) -> list:
    """Output ``name``'s element of each of ``n`` choices (None where absent): text decoded, numbers as ints."""
    value = result.as_numpy(name)
    if value is None or value.size == 0:
        return [None] * n
    values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else int(v) for v in value.reshape(-1)]
    return values if len(values) == n else (values * n)[:n] if len(values) == 1 else [None] * n


def _choice_chunks(result, n: int, generated: list[int], finished: list[bool]):
    """A response's chunks: one per choice it says something of (text, logprobs, or its end), in the vLLM backend's
    shape, one element per choice; ``generated`` and ``finished``: each choice's counts so far, updated."""
    texts, reasons = _elements(result, "text_output", n), _elements(result, "finish_reason", n)
    counts, logprobs = _elements(result, "num_output_tokens", n), _elements(result, "logprobs", n)
    n_in = _elements(result, "num_input_tokens", 1)[0]
    for i in range(n):
        generated[i] += counts[i] or 0
        reason = None if reasons[i] in (None, "None") else reasons[i]
        entries = json.loads(logprobs[i]) if logprobs[i] else None
        if finished[i] or not (texts[i] or entries or reason):
            continue
        finished[i] = reason is not None
        yield Chunk(text=texts[i] or "", finish_reason=reason, num_input_tokens=n_in, num_output_tokens=generated[i],
                    logprobs=entries or None, index=i)


# gRPC's own reconnect backoff grows to 120 s: after Triton was started again (or started late), every request and
# /health probe meanwhile failed fast, and the frontend answered 503 for up to two minutes after Triton served again.
# Triton is on this host (or the next pod): try again at least every second.
RECONNECT_BACKOFF_MS = (250, 1000)  # (first and longest wait between connection attempts)


def channel_args() -> list[tuple[str, int]]:
    """``tritonclient``'s own gRPC channel options, with :data:`RECONNECT_BACKOFF_MS`."""
    from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, KeepAliveOptions

    keepalive = KeepAliveOptions()
    first, longest = RECONNECT_BACKOFF_MS
    return [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", first),
        ("grpc.min_reconnect_backoff_ms", first),
        ("grpc.max_reconnect_backoff_ms", longest),
    ]


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
            self._client = self._grpc.InferenceServerClient(self.url, channel_args=channel_args())
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
        headers = None
        if traceparent is not None:  # (Triton's own span continues the header; the scheduler's, the parameter)
            request["parameters"] = {tracing.PARAMETER: traceparent}
            headers = {tracing.PARAMETER: traceparent}

        async def requests():
            yield request

        n = sampling.get("n", 1)
        generated, finished = [0] * n, [False] * n  # (each response counts its own tokens, as the vLLM backend's do)
        try:
            async for result, error in self.client.stream_infer(requests(), headers=headers):
                if error is not None:
                    raise await self._error(mode, str(error.message() if hasattr(error, "message") else error))
                for chunk in _choice_chunks(result, n, generated, finished):
                    yield chunk
                if all(finished):
                    return
        except TridentError:
            raise
        except Exception as e:  # connection refused, server gone
            log.warning("Triton at %s: %s: %s", self.url, type(e).__name__, e)  # (the address for the log alone)
            raise Unavailable(f"the Triton server is unavailable ({type(e).__name__}); retry later") from None

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


def run_frontend(settings: FrontendSettings) -> int:
    import uvicorn

    from trident.frontend.header_deadline import header_deadline_protocol
    from trident.frontend.idle_reclaim import ReclaimIdle

    tracing.start("frontend")
    app = create_app(settings, TritonEngine(settings.grpc_url))
    # an idle keep-alive connection stays open longer than clients keep theirs (aiohttp 15 s, load balancers
    # 60 s): with uvicorn's 5 s a client could send a request on a connection the server was just closing
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S,
                limit_concurrency=settings.max_connections,
                http=header_deadline_protocol(settings.header_timeout_s, base=ReclaimIdle))
    return 0
