"""An OpenTelemetry collector for the tests: OTLP over HTTP/protobuf (``POST /v1/traces``, what Triton and the
OpenTelemetry SDK export), on a free localhost port; it keeps each span it receives, with its service's name."""

from __future__ import annotations

import gzip
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Collector:
    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self._pb = trace_service_pb2
        self.spans: list[dict] = []
        self.errors: list[str] = []  # exports it could not read
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                try:
                    if self.headers.get("Content-Type", "").startswith("application/json"):  # (Triton's exporter)
                        collector._add(collector._from_json(json.loads(body)))
                    else:
                        collector._add(collector._from_protobuf(body))
                except Exception as e:  # noqa: BLE001 - kept for the tests to see; the exporter is answered
                    collector.errors.append(f"{type(e).__name__}: {e}")
                answer = collector._pb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def _from_protobuf(self, body: bytes) -> list[dict]:
        request = self._pb.ExportTraceServiceRequest.FromString(body)
        spans = []
        for resource in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource.resource.attributes}
            for scope in resource.scope_spans:
                for s in scope.spans:
                    spans.append({
                        "service": attributes.get("service.name"), "name": s.name, "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(), "parent_id": s.parent_span_id.hex() or None,
                        "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                        "attributes": {a.key: _value(a.value) for a in s.attributes},
                    })
        return spans

    @staticmethod
    def _from_json(request: dict) -> list[dict]:
        """OTLP/JSON (ids in hex, as the OTLP specification writes them)."""
        spans = []
        for resource in request.get("resourceSpans", []):
            attributes = {a["key"]: a["value"].get("stringValue")
                          for a in resource.get("resource", {}).get("attributes", [])}
            for scope in resource.get("scopeSpans", []):
                for s in scope.get("spans", []):
                    spans.append({
                        "service": attributes.get("service.name"), "name": s["name"], "trace_id": s["traceId"].lower(),
                        "span_id": s["spanId"].lower(), "parent_id": s.get("parentSpanId", "").lower() or None,
                        "start": int(s.get("startTimeUnixNano", 0)), "end": int(s.get("endTimeUnixNano", 0)),
                        "attributes": {a["key"]: next(iter(a["value"].values()), None) for a in s.get("attributes", [])},
                    })
        return spans

    def _add(self, spans: list[dict]) -> None:
        with self._lock:
            self.spans += spans

    def trace(self, trace_id: str, until, timeout: float = 20.0) -> list[dict]:
        """The spans of trace ``trace_id`` once ``until(spans)`` holds of them (or ``timeout`` has passed)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = [s for s in self.spans if s["trace_id"] == trace_id]
            if until(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind is not None else None
