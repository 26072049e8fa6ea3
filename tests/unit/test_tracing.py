"""Request traces (trident.core.tracing): off unless OTEL_TRACES_EXPORTER names an exporter; with the file exporter each
span is one JSON line, a request's spans form one tree, and a ``traceparent`` continues a trace across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"

_SCRIPT = f"""
import asyncio, gc, time
from trident.core import tracing
tracing.start("proc")
with tracing.step("outside"):  # no request: not recorded
    pass
with tracing.request("request", "00-{TRACE_ID}-{CALLER}-01", mode="e_p_d"):
    with tracing.step("outer"):
        with tracing.step("inner"):
            time.sleep(0.01)
    t0 = time.monotonic_ns()
    tracing.mark("instant", t0, t0)
    try:
        with tracing.step("failing"):
            raise ValueError("x")
    except ValueError:
        pass
    gc.collect()  # a full collection during a request is a step of it
    next_hop = tracing.traceparent()
    kept = tracing.context()
tracing.mark("later", time.monotonic_ns(), context=kept)  # another thread's work for the request
with tracing.request("fresh"):  # no traceparent: a trace of its own
    pass
print(tracing.enabled(), next_hop)
"""


def _run(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "TRIDENT_TRACE_DIR"}
    return dict(env, **extra)


def test_off_by_default_writes_nothing(tmp_path):
    out = _run(_env(HOME=str(tmp_path), TRIDENT_TRACE_DIR=str(tmp_path / "t")))
    assert out.stdout.split() == ["False", "None"]
    assert not list(tmp_path.rglob("*.jsonl")) and out.stderr == ""


def test_file_exporter_writes_one_tree_per_request_that_continues_the_caller_s_trace(tmp_path):
    before = time.time_ns()
    out = _run(_env(OTEL_TRACES_EXPORTER="file", TRIDENT_TRACE_DIR=str(tmp_path / "t")))
    after = time.time_ns()
    enabled, next_hop = out.stdout.split()
    assert enabled == "True"
    spans = [json.loads(line) for line in (tmp_path / "t" / "proc.jsonl").read_text().splitlines()]
    names = [s["name"] for s in spans if not s["name"].startswith("gc")]
    assert names == ["inner", "outer", "instant", "failing", "request", "later", "fresh"], names
    assert "gc2" in [s["name"] for s in spans]  # the collector's pass over the oldest generation, inside the request
    by = {s["name"]: s for s in spans}
    request = by["request"]
    assert request["trace_id"] == TRACE_ID and request["parent_id"] == CALLER
    assert request["attributes"] == {"mode": "e_p_d"}
    for name in ("outer", "instant", "failing", "later", "gc2"):
        assert by[name]["trace_id"] == TRACE_ID and by[name]["parent_id"] == request["span_id"], name
    assert by["inner"]["parent_id"] == by["outer"]["span_id"]
    assert by["failing"]["status"] == "ERROR" and by["request"]["status"] == "UNSET"
    assert by["fresh"]["trace_id"] != TRACE_ID and by["fresh"]["parent_id"] is None
    # the next hop's traceparent names this trace and the current span, sampled
    assert next_hop == f"00-{TRACE_ID}-{request['span_id']}-01"
    assert by["inner"]["end"] - by["inner"]["start"] >= 10_000_000  # the 10 ms sleep
    assert by["outer"]["start"] <= by["inner"]["start"] <= by["inner"]["end"] <= by["outer"]["end"]
    assert by["instant"]["start"] == by["instant"]["end"]
    # Unix time, as every OpenTelemetry span: the child's spans fall inside this process's window
    assert all(before <= s["start"] <= s["end"] <= after for s in spans)


def test_a_trace_folder_that_cannot_be_written_turns_tracing_off_and_fails_nothing(tmp_path):
    """A full disk (``/dev/full``: every write is ENOSPC), a folder that cannot be made or an exporter that does not
    exist: the requests run, spans are not written, one warning says so, and nothing is raised."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "proc.jsonl").symlink_to("/dev/full")
    full = _run(_env(OTEL_TRACES_EXPORTER="file", TRIDENT_TRACE_DIR=str(tmp_path / "t")))
    assert full.stdout.split()[0] == "True"
    assert full.stderr.count("spans are not written in this process from now on") == 1, full.stderr
    (tmp_path / "file").write_text("")
    unmakeable = _run(_env(OTEL_TRACES_EXPORTER="file", TRIDENT_TRACE_DIR=str(tmp_path / "file" / "t")))
    assert unmakeable.stdout.split()[0] == "False" and "tracing is off in this process" in unmakeable.stderr
    unknown = _run(_env(OTEL_TRACES_EXPORTER="jaeger"))
    assert unknown.stdout.split()[0] == "False" and "OTEL_TRACES_EXPORTER=jaeger is not one of" in unknown.stderr


def test_triton_traces_with_opentelemetry_only_where_its_spans_can_go(monkeypatch):
    """Triton exports OTLP over HTTP alone: with ``otlp`` (not over gRPC) it gets the collector's traces URL."""
    from trident.core import tracing

    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
                 "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "file")
    assert tracing.triton_trace_config() == []
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    config = tracing.triton_trace_config()
    assert "mode=opentelemetry" in config and "opentelemetry,url=http://localhost:4318/v1/traces" in config
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    assert "opentelemetry,url=http://collector:4318/v1/traces" in tracing.triton_trace_config()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:9999/in")
    assert "opentelemetry,url=http://traces:9999/in" in tracing.triton_trace_config()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert tracing.triton_trace_config() == []


def test_the_scheduler_continues_triton_s_span_unless_the_parameter_names_another_trace():
    from trident.in_triton.scheduler.model import _traceparent

    class Request:
        def __init__(self, parameter, triton_context):
            self._parameters = json.dumps({"traceparent": parameter} if parameter else {})
            self._context = triton_context

        def parameters(self):
            return self._parameters

        def trace(self):
            return type("Trace", (), {"get_context": lambda _: self._context})()

    triton = f"00-{TRACE_ID}-1111111111111111-01"
    other = f"00-{'ab' * 16}-{CALLER}-01"
    context = json.dumps({"traceparent": triton})
    assert _traceparent(Request(None, context)) == triton  # (the client's header, continued by Triton)
    assert _traceparent(Request(f"00-{TRACE_ID}-{CALLER}-01", context)) == triton  # (the frontend's: both)
    assert _traceparent(Request(other, context)) == other  # (a parameter alone: Triton's span began its own trace)
    assert _traceparent(Request(other, None)) == other  # (Triton not tracing)
    assert _traceparent(Request(None, None)) is None
