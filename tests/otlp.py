"""A real OTLP/HTTP trace receiver on 127.0.0.1, for the tracing tests: ``POST /v1/traces`` with a
protobuf ``ExportTraceServiceRequest`` (gzip or not), decoded with opentelemetry-proto into
``Received`` spans (ids in hex, attributes as Python values, the service that sent it). Nothing
leaves loopback.

    with Receiver() as receiver:
        ... OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint ...
        receiver.wait_for(lambda spans: ..., "what")
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.waiting import wait_until


@dataclass(frozen=True)
class Received:
    name: str
    trace_id: str
    span_id: str
    parent: str  # "" for a root span
    kind: int  # the proto's SpanKind: 1 internal, 3 client
    start: float  # seconds
    end: float
    attributes: dict[str, Any]
    status: int  # 0 unset, 1 ok, 2 error
    message: str
    events: list[str]  # their names ("exception")
    service: str


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


@dataclass
class Receiver:
    spans: list[Received] = field(default_factory=list)
    posts: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _httpd: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        """What OTEL_EXPORTER_OTLP_ENDPOINT is set to (the exporter adds /v1/traces)."""
        assert self._httpd is not None
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> Receiver:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._take(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    def _take(self, request: Any) -> None:
        found = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    found.append(Received(
                        name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent=span.parent_span_id.hex(), kind=span.kind, start=span.start_time_unix_nano / 1e9,
                        end=span.end_time_unix_nano / 1e9, attributes={a.key: _value(a.value) for a in span.attributes},
                        status=span.status.code, message=span.status.message, events=[e.name for e in span.events],
                        service=str(resource.get("service.name", ""))))
        with self._lock:
            self.spans += found
            self.posts += 1

    def of_trace(self, trace_id: str) -> list[Received]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, ready: Callable[[list[Received]], bool], what: str, timeout: float = 30.0) -> list[Received]:
        def attempt() -> list[Received] | None:
            with self._lock:
                spans = list(self.spans)
            return spans if ready(spans) else None
        return wait_until(attempt, timeout=timeout, what=what)
