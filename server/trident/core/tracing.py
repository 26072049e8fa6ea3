"""Request traces: OpenTelemetry spans from the frontend, the schedulers and every stage worker, one trace per request.

Off unless ``OTEL_TRACES_EXPORTER`` names an exporter (the launcher sets it from the ``tracing`` setting; every
process it starts inherits it, with the standard ``OTEL_EXPORTER_OTLP_*`` variables):

- ``otlp``: OTLP over HTTP/protobuf (gRPC when ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` is ``grpc`` and its exporter
  is installed), to where ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` says (default ``http://localhost:4318``);
- ``console``: each span printed on the process's standard output;
- ``file``: one JSON line per span in ``<TRIDENT_TRACE_DIR>/<process>.jsonl`` (what ``make bench-hops`` and the tests
  read), written as the span ends.

A request's context crosses processes as a W3C ``traceparent``: the frontend takes the client's HTTP header and
passes it to Triton as the request parameter ``traceparent`` (a Triton client may send one too), the scheduler
reads it and puts its own in each stage call (:class:`~trident.core.protocol.Call`), and the worker's spans continue it.
So a request's spans form one tree, on one host or several.

Spans are made only inside a request's: :func:`request` (or :func:`open_span`) starts one, :func:`step` and
:func:`mark` add its parts. A step outside any request (a batched decode step, the garbage collector between
requests) is not recorded. Tracing off costs one attribute test per step.

Tracing never fails a request: an exporter that cannot write (a full disk, no collector) loses spans, not requests.
"""

from __future__ import annotations

import contextvars
import functools
import gc
import json
import logging
import os
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Sequence

EXPORTER_ENV = "OTEL_TRACES_EXPORTER"
DIR_ENV = "TRIDENT_TRACE_DIR"  # the file exporter's folder
EXPORTERS = ("otlp", "console", "file", "none")
PARAMETER = "traceparent"  # the request parameter (and HTTP header) that carries a request's context

log = logging.getLogger("trident.core.tracing")

_tracer = None  # an OpenTelemetry tracer while tracing is on in this process
_offset_ns = 0  # time.time_ns() - time.monotonic_ns(): a step timed on the monotonic clock, as a span's time
_propagator = None
_NOTHING = nullcontext()  # what a step is while tracing is off


def exporter_name() -> str:
    """The exporter the environment asks for (``none`` when it asks for none)."""
    name = os.environ.get(EXPORTER_ENV, "none").strip().lower() or "none"
    return name.split(",")[0]


def start(process: str) -> None:
    """Trace this process's part of each request, as service ``trident-<process>`` (a no-op when the environment
    asks for no exporter, or when tracing is on already)."""
    global _tracer, _offset_ns, _propagator
    name = exporter_name()
    if _tracer is not None or name == "none":
        return
    if name not in EXPORTERS:
        log.warning("tracing is off: %s=%s is not one of %s", EXPORTER_ENV, name, ", ".join(EXPORTERS))
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    try:
        exporter = _exporter(name, process)
    except (OSError, ImportError) as e:
        log.warning("tracing is off in this process: %s", e)
        return
    provider = TracerProvider(resource=Resource.create({
        "service.name": f"trident-{process}", "service.namespace": "trident", "process.pid": os.getpid()}))
    # the file exporter writes each span as it ends (the tests and make bench-hops read them at once); the others
    # batch, off the request's thread
    provider.add_span_processor(SimpleSpanProcessor(exporter) if name == "file" else BatchSpanProcessor(exporter))
    _propagator = TraceContextTextMapPropagator()
    _offset_ns = time.time_ns() - time.monotonic_ns()
    _tracer = provider.get_tracer("trident")
    gc.callbacks.append(_gc_step)
    quiet = _OnceAMinute()
    for name in ("opentelemetry.sdk.trace.export", "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                 "opentelemetry.exporter.otlp.proto.grpc.exporter"):
        logging.getLogger(name).addFilter(quiet)


class _OnceAMinute(logging.Filter):
    """An exporter that cannot reach its collector says so in one line a minute, without a traceback, not in a
    traceback per batch and retry."""

    def __init__(self) -> None:
        super().__init__()
        self._last = -60.0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self._last < 60:
            return False
        self._last = now
        cause = f" ({type(record.exc_info[1]).__name__})" if record.exc_info and record.exc_info[1] else ""
        record.msg, record.args = f"spans not exported: {record.getMessage()}{cause}", None
        record.exc_info = record.exc_text = None
        return True


def _exporter(name: str, process: str):
    if name == "file":
        folder = os.environ.get(DIR_ENV)
        if not folder:
            raise OSError(f"{EXPORTER_ENV}=file needs the folder in {DIR_ENV}")
        return FileSpanExporter(Path(folder) / f"{process}.jsonl")
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def triton_trace_config() -> list[str]:
    """Triton's ``--trace-config`` values that make it trace every request with OpenTelemetry and export its spans
    to the same collector as Trident's (OTLP over HTTP, the one protocol Triton exports); empty when the spans go
    elsewhere (a file, the console, OTLP over gRPC), where Triton cannot send its own. Triton continues a request's
    ``traceparent`` (an HTTP header or gRPC metadata) and hands its span's context to the scheduler, whose spans
    then sit under Triton's."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if exporter_name() != "otlp" or protocol == "grpc":
        return []
    url = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not url:
        url = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318").rstrip("/") + "/v1/traces"
    return ["mode=opentelemetry", "rate=1", "level=TIMESTAMPS", "count=-1", f"opentelemetry,url={url}",
            "opentelemetry,resource=service.name=trident-triton",
            "opentelemetry,resource=service.namespace=trident"]


def triton_context(request) -> str | None:
    """The ``traceparent`` of Triton's span of ``request`` (a python-backend request), when Triton traces it."""
    try:
        context = request.trace().get_context()
    except (AttributeError, RuntimeError, TypeError):  # (an older Triton; a request Triton does not trace)
        return None
    if not context:
        return None
    try:
        value = json.loads(context).get(PARAMETER)
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


class FileSpanExporter:
    """Spans as JSON lines in one file: name, trace and span ids (hex), parent id, start and end (Unix ns), status
    and attributes. A file that cannot be written turns the exporter off, with one warning."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(path, "a", buffering=1)  # a line each, flushed as written
        self._lock = threading.Lock()

    def export(self, spans: Sequence) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = "".join(json.dumps(span_record(s)) + "\n" for s in spans)
        with self._lock:
            if self._out is None:
                return SpanExportResult.FAILURE
            try:
                self._out.write(lines)
            except OSError as e:
                log.warning("spans are not written in this process from now on: %s", e)
                self._close()
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def _close(self) -> None:
        out, self._out = self._out, None
        try:
            out.close()
        except OSError:
            pass

    def shutdown(self) -> None:
        with self._lock:
            if self._out is not None:
                self._close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_record(span) -> dict:
    """What the file exporter writes of a finished span."""
    parent = span.parent
    return {
        "name": span.name, "trace_id": f"{span.context.trace_id:032x}", "span_id": f"{span.context.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "start": span.start_time, "end": span.end_time, "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }


def enabled() -> bool:
    return _tracer is not None


def _recording() -> bool:
    from opentelemetry import trace

    return trace.get_current_span().is_recording()


def _parent(traceparent: str | None):
    """The context a ``traceparent`` names (None: a new trace)."""
    if not traceparent:
        return None
    return _propagator.extract({PARAMETER: traceparent})


def request(name: str, traceparent: str | None = None, **attributes):
    """The span of one request's part in this process, current for the ``with`` body (in this task or thread):
    a child of ``traceparent``'s span, or the root of a new trace."""
    if _tracer is None:
        return _NOTHING
    return _tracer.start_as_current_span(name, context=_parent(traceparent), attributes=attributes or None)


def open_span(name: str, traceparent: str | None = None, **attributes):
    """A request's span that the caller ends (``span.end()``), for work that a ``with`` cannot hold (an async
    generator's); it is not made current. None when tracing is off."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, context=_parent(traceparent), attributes=attributes or None)


def traceparent(span=None) -> str | None:
    """The ``traceparent`` of ``span`` (default: the current span), for the next hop; None when tracing is off or
    no request is being traced."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    span = span if span is not None else trace.get_current_span()
    if not span.is_recording():
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get(PARAMETER)


def context():
    """This task's or thread's context when a request is being traced in it, for work that another thread does
    for that request (:func:`mark`'s ``context``); None otherwise."""
    if _tracer is None or not _recording():
        return None
    return contextvars.copy_context()


def carry(fn: Callable) -> Callable:
    """``fn``, run in this context (the request's span) from another thread: for ``run_in_executor``, which does
    not carry it. ``fn`` itself when tracing is off."""
    if _tracer is None:
        return fn
    return functools.partial(contextvars.copy_context().run, fn)


def mark(step: str, t0: int, t1: int | None = None, context: contextvars.Context | None = None, **attributes) -> None:
    """Record ``step`` as having run from ``t0`` to ``t1`` (default: now), in ``time.monotonic_ns()``, as a span of
    the current request's (or of the one whose :func:`context` is given)."""
    if _tracer is None:
        return
    end = t1 if t1 is not None else time.monotonic_ns()
    if context is not None:
        context.run(_span, step, t0, end, attributes)
    elif _recording():
        _span(step, t0, end, attributes)


def _span(step: str, t0: int, t1: int, attributes: dict) -> None:
    _tracer.start_span(step, start_time=t0 + _offset_ns, attributes=attributes or None).end(end_time=t1 + _offset_ns)


def step(name: str):
    """Time the ``with`` body as step ``name`` of the current request."""
    if _tracer is None or not _recording():
        return _NOTHING
    return _tracer.start_as_current_span(name)


_gc_t0 = 0


def _gc_step(phase: str, info: dict) -> None:
    """The garbage collector's passes over the older generations, while a request is traced, are steps too
    (``gc1``, ``gc2``)."""
    global _gc_t0
    if info.get("generation", 0) == 0:
        return
    if phase == "start":
        _gc_t0 = time.monotonic_ns()
    elif _gc_t0:
        mark(f"gc{info['generation']}", _gc_t0)
