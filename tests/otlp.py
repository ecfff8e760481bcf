"""Real OTLP receivers: over HTTP (``OTLPReceiver``: the protobuf payloads the SDK exporters
send to /v1/traces and /v1/metrics) and over gRPC (``OTLPGrpcReceiver``: the collector's
TraceService and MetricsService). Both keep what arrives and decode it when asked.

Decoding waits until a reader asks: a collector runs on its own machine in production, and
one that parsed every batch on arrival would take CPU from the worker a benchmark measures
on the same two cores."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict
    events: list[tuple[str, dict]]
    links: list[tuple[str, str, dict]]
    status: int
    start_ns: int
    end_ns: int


@dataclass
class Received:
    spans: list[Span] = field(default_factory=list)
    metrics: dict[str, list] = field(default_factory=dict)
    requests: int = 0
    # Payloads not decoded yet: (path, body) in arrival order.
    pending: list[tuple[str, bytes]] = field(default_factory=list)


class OTLPReceiver:
    def __init__(self) -> None:
        self.received = Received()
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if not self.path.endswith(("/v1/traces", "/v1/metrics")):
                    self.send_response(404)
                    self.end_headers()
                    return
                with outer.lock:
                    outer.received.pending.append((self.path, body))
                    outer.received.requests += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> OTLPReceiver:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def clear(self) -> None:
        with self.lock:
            self.received = Received()

    def _decode(self) -> None:
        """Decode what arrived since the last read (the caller holds the lock)."""
        pending, self.received.pending = self.received.pending, []
        for path, body in pending:
            if path.endswith("/v1/traces"):
                self._traces(body)
            else:
                self._metrics(body)

    def _traces(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            service = _attrs(resource_spans.resource.attributes).get("service.name", "")
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    spans.append(
                        Span(
                            service=service,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            attributes=_attrs(s.attributes),
                            events=[(e.name, _attrs(e.attributes)) for e in s.events],
                            links=[
                                (link.trace_id.hex(), link.span_id.hex(), _attrs(link.attributes))
                                for link in s.links
                            ],
                            status=s.status.code,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                        )
                    )
        self.received.spans.extend(spans)

    def _metrics(self, body: bytes) -> None:
        request = ExportMetricsServiceRequest()
        request.ParseFromString(body)
        for resource_metrics in request.resource_metrics:
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    self.received.metrics.setdefault(metric.name, []).append(metric)

    def spans(self) -> list[Span]:
        with self.lock:
            self._decode()
            return list(self.received.spans)

    def metrics(self, name: str) -> list:
        """Every exported copy of the metric ``name`` (OTLP ``Metric`` messages)."""
        with self.lock:
            self._decode()
            return list(self.received.metrics.get(name, []))

    def metric_names(self) -> set[str]:
        with self.lock:
            self._decode()
            return set(self.received.metrics)


class OTLPGrpcReceiver(OTLPReceiver):
    """The same, as a gRPC server: what a collector listens for on port 4317."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import grpc
        from opentelemetry.proto.collector.metrics.v1 import (
            metrics_service_pb2,
            metrics_service_pb2_grpc,
        )
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        self.received = Received()
        self.lock = threading.Lock()
        outer = self

        def keep(path: str, request) -> None:
            with outer.lock:
                outer.received.pending.append((path, request.SerializeToString()))
                outer.received.requests += 1

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the service's naming
                keep("/v1/traces", request)
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the service's naming
                keep("/v1/metrics", request)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self.server = grpc.server(ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OTLPGrpcReceiver:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=None)
