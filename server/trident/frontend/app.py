"""The OpenAI-compatible HTTP server: chat completions with images, completions, models, health, metrics."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from ..errors import InvalidRequest
from ..media import MediaPolicy, image_url_to_base64
from .engine import Chunk, Engine, EngineError
from .schemas import ChatCompletionRequest, CompletionRequest, Message, error_body

MODES = ("epd", "e_pd", "e_p_d", "ep_d")


@dataclass
class FrontendConfig:
    model_name: str  # the served model id
    model_path: str  # checkpoint folder (its tokenizer's chat template is applied here)
    default_mode: str = "e_p_d"
    default_max_tokens: int = 256
    media: MediaPolicy = field(default_factory=MediaPolicy)


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


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def create_app(config: FrontendConfig, engine: Engine) -> FastAPI:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    metrics = Metrics()
    app = FastAPI(title="Trident OpenAI-compatible API")

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return JSONResponse(error_body(exc.message, exc.status, exc.param), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors())
        return JSONResponse(error_body(f"invalid request: {problems}", 400), status_code=400)

    def resolve_mode(model: str) -> str:
        name, _, mode = model.partition(":")
        if name != config.model_name or (mode and mode not in MODES):
            raise ApiError(404, f"model {model!r} does not exist; served: {config.model_name} "
                                f"(add :{'|:'.join(MODES)} to pick a mode)", "model")
        return mode or config.default_mode

    async def chat_prompt(messages: list[Message]) -> tuple[str, list[str]]:
        images: list[str] = []
        converted = []
        for m in messages:
            if isinstance(m.content, list):
                parts = []
                for part in m.content:
                    if part.type == "text":
                        parts.append({"type": "text", "text": part.text or ""})
                    else:
                        if part.image_url is None:
                            raise ApiError(400, "an image_url part needs image_url.url", "messages")
                        try:
                            images.append(await image_url_to_base64(part.image_url.url, config.media, len(images)))
                        except InvalidRequest as e:
                            raise ApiError(400, str(e), "messages") from None
                        parts.append({"type": "image"})
                converted.append({"role": m.role, "content": parts})
            else:
                converted.append({"role": m.role, "content": m.content or ""})
        prompt = tokenizer.apply_chat_template(converted, tokenize=False, add_generation_prompt=True)
        return prompt, images

    async def run(mode: str, endpoint: str, prompt: str, images: list[str], sampling: dict) -> AsyncIterator[Chunk]:
        """Generation chunks with metrics; errors before the first chunk become ApiError."""
        metrics.requests.labels(mode, endpoint).inc()
        start = last = time.perf_counter()
        first = True
        try:
            async for chunk in engine.generate(mode, prompt, images, sampling, uuid.uuid4().hex):
                now = time.perf_counter()
                if first:
                    metrics.ttft.labels(mode).observe(now - start)
                    first = False
                else:
                    metrics.itl.labels(mode).observe(now - last)
                last = now
                if chunk.finish_reason is not None:
                    metrics.tokens_in.labels(mode).inc(chunk.num_input_tokens or 0)
                    metrics.tokens_out.labels(mode).inc(chunk.num_output_tokens or 0)
                yield chunk
        except EngineError as e:
            metrics.errors.labels(mode, endpoint, str(e.status)).inc()
            raise ApiError(e.status, e.message) from None

    def check(req) -> None:
        if req.n != 1:
            raise ApiError(400, f"n={req.n} is not supported; only n=1", "n")

    async def respond(req, mode: str, endpoint: str, prompt: str, images: list[str]):
        chunks = run(mode, endpoint, prompt, images, req.sampling(config.default_max_tokens))
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if endpoint == "chat" else "text_completion"

        def usage(c: Chunk | None) -> dict | None:
            if c is None:
                return None
            p, g = c.num_input_tokens or 0, c.num_output_tokens or 0
            return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

        if not req.stream:
            text, last = [], None
            async for c in chunks:
                text.append(c.text)
                last = c
            choice = {"index": 0, "finish_reason": last.finish_reason if last else None}
            if endpoint == "chat":
                choice["message"] = {"role": "assistant", "content": "".join(text)}
            else:
                choice["text"] = "".join(text)
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": req.model,
                                 "choices": [choice], "usage": usage(last)})

        # Streaming: surface an error before the first byte as a proper HTTP error.
        iterator = chunks.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            first = None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk_obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"

        def sse(c: Chunk, role: bool) -> str:
            if endpoint == "chat":
                delta = {"content": c.text}
                if role:
                    delta["role"] = "assistant"
                choice = {"index": 0, "delta": delta, "finish_reason": c.finish_reason}
            else:
                choice = {"index": 0, "text": c.text, "finish_reason": c.finish_reason}
            body = {"id": rid, "object": chunk_obj, "created": created, "model": req.model, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        async def events():
            last, role = first, True
            try:
                if first is not None:
                    yield sse(first, role)
                    role = False
                async for c in iterator:
                    last = c
                    yield sse(c, role)
                    role = False
            except ApiError as e:
                yield f"data: {json.dumps(error_body(e.message, e.status))}\n\n"
            if include_usage:
                body = {"id": rid, "object": chunk_obj, "created": created, "model": req.model, "choices": [],
                        "usage": usage(last)}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        mode = resolve_mode(req.model)
        check(req)
        prompt, images = await chat_prompt(req.messages)
        return await respond(req, mode, "chat", prompt, images)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        mode = resolve_mode(req.model)
        check(req)
        return await respond(req, mode, "completions", req.prompt, [])

    @app.get("/v1/models")
    async def models():
        ready = await engine.ready_modes(list(MODES))
        ids = ([config.model_name] if config.default_mode in ready else []) + [f"{config.model_name}:{m}" for m in ready]
        return {"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "trident"} for i in ids]}

    @app.get("/health")
    async def health():
        ready = await engine.ready_modes(list(MODES))
        if not ready:
            return JSONResponse({"status": "unavailable", "modes": []}, status_code=503)
        return {"status": "ok", "modes": ready}

    @app.get("/metrics")
    async def prometheus_metrics(_request: Request):
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def run_frontend(config: FrontendConfig, grpc_url: str, host: str, port: int) -> int:
    import uvicorn

    from .engine import TritonEngine

    app = create_app(config, TritonEngine(grpc_url))
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return 0


def default_model_name(model_path: str) -> str:
    return Path(model_path).name
