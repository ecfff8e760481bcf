"""OpenTelemetry SDK set-up, from the standard environment variables only.

Nothing is installed unless a signal has somewhere to go and ``OTEL_SDK_DISABLED`` is not
true: then the engine's spans cost one function call each. A signal (traces, metrics) is
exported when an OTLP endpoint is set for it (``OTEL_EXPORTER_OTLP_ENDPOINT`` or its
``_TRACES_``/``_METRICS_`` variant) or when ``OTEL_TRACES_EXPORTER``/``OTEL_METRICS_EXPORTER``
names an exporter explicitly (``otlp``, ``console``, or ``none`` to turn it off). OTLP goes
over HTTP/protobuf (port 4318) or gRPC (port 4317), chosen by ``OTEL_EXPORTER_OTLP_PROTOCOL``
or its per-signal variant. The service name and resource come from ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES``, the sampler from ``OTEL_TRACES_SAMPLER``; with traces on,
Django, Celery, psycopg and Redis are traced by their maintained instrumentation packages.
Values this set-up cannot honour stop the process with a message naming the variable.

Each process calls ``setup()`` once: web (wsgi), the CLI (manage.py), every Celery pool
process (after fork: the SDK's export threads and gRPC channels do not survive one) and beat.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Any

from django.core.exceptions import ImproperlyConfigured

log = logging.getLogger(__name__)

_ENDPOINT_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)
# A step or two per millisecond makes bursts of spans: room for them, exported every second.
# Every commit records its latency; offering each one as an exemplar (the SDK's default
# inside a sampled span) adds about a third to that recording, for a link the commit's event
# on its step's span already gives. Each can still be set with its standard variable.
_DEFAULTS = {
    "OTEL_BSP_MAX_QUEUE_SIZE": "65536",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4096",
    "OTEL_BSP_SCHEDULE_DELAY": "1000",
    "OTEL_METRICS_EXEMPLAR_FILTER": "always_off",
}

_providers: list = []


SIGNALS = ("traces", "metrics")
EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("http/protobuf", "grpc")


def _endpoint(signal: str) -> str:
    return os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", ""
    )


def exporters(signal: str) -> list[str]:
    """The exporters ``signal`` goes to. Without ``OTEL_<SIGNAL>_EXPORTER``, OTLP only if an
    endpoint is set for it: a process nobody pointed anywhere exports nothing."""
    variable = f"OTEL_{signal.upper()}_EXPORTER"
    raw = os.environ.get(variable, "").strip()
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        hint = ""
        if unknown[0] == "prometheus":
            hint = " (the web process serves the durability metrics at /metrics for scrapers)"
        raise ImproperlyConfigured(
            f"{variable}={raw!r}: {unknown[0]!r} is not supported here{hint}; use"
            f" {', '.join(EXPORTERS)} (or a comma-separated list of them)"
        )
    if not names:
        return ["otlp"] if _endpoint(signal) else []
    if "none" in names:
        return []
    return list(dict.fromkeys(names))


def protocol(signal: str) -> str:
    for variable in (
        f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ):
        value = os.environ.get(variable, "").strip()
        if not value:
            continue
        if value not in PROTOCOLS:
            why = " (the Python SDK has no OTLP/JSON exporter)" if value == "http/json" else ""
            raise ImproperlyConfigured(
                f"{variable}={value!r} is not supported here{why}; use http/protobuf"
                " (a collector listens on port 4318) or grpc (port 4317)"
            )
        return value
    return "http/protobuf"


def configured() -> bool:
    """Whether any signal has somewhere to go (checked before anything is imported)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if any(os.environ.get(name) for name in _ENDPOINT_VARS):
        return True
    return any(
        os.environ.get(f"OTEL_{signal.upper()}_EXPORTER", "").strip().lower() not in ("", "none")
        for signal in SIGNALS
    )


def _span_exporter(name: str) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if protocol("traces") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def _metric_exporter(name: str) -> Any:
    if name == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return ConsoleMetricExporter()
    if protocol("metrics") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    return OTLPMetricExporter()


def check() -> None:
    """``ImproperlyConfigured`` naming the OTEL_ variable at fault, before anything starts:
    a worker's pool processes set telemetry up in a signal handler, where a refusal would
    leave the worker hanging instead of stopping it."""
    if not configured():
        return
    for signal in ("traces", "metrics"):
        if "otlp" in exporters(signal):
            protocol(signal)


def setup(role: str, *, django: bool = False) -> bool:
    """Install the SDK for this process; returns False (and does nothing) when no signal has
    anywhere to go. ``role`` names the service when ``OTEL_SERVICE_NAME`` is not set."""
    if _providers or not configured():
        return bool(_providers)
    # Every variable is checked before anything is installed: a bad one changes nothing.
    span_exporters, metric_exporters = exporters("traces"), exporters("metrics")
    if "otlp" in span_exporters:
        protocol("traces")
    if "otlp" in metric_exporters:
        protocol("metrics")
    if not span_exporters and not metric_exporters:
        return False
    for name, value in _DEFAULTS.items():
        os.environ.setdefault(name, value)

    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from durability import spans

    attributes = {}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes[SERVICE_NAME] = f"durability-{role}"
    resource = spans.FrozenResource.of(Resource.create(attributes))
    if span_exporters:
        # Each span is scrubbed of the executing run's secrets as it ends (durability/redact.py),
        # in front of the batch processor that hands it to the exporter.
        tracer_provider = spans.tracer_provider(
            [BatchSpanProcessor(_span_exporter(name)) for name in span_exporters], resource
        )
        trace.set_tracer_provider(tracer_provider)
        _providers.append(tracer_provider)
    if metric_exporters:
        meter_provider = MeterProvider(
            resource=resource,
            metric_readers=[
                PeriodicExportingMetricReader(_metric_exporter(name)) for name in metric_exporters
            ],
        )
        metrics.set_meter_provider(meter_provider)
        _providers.append(meter_provider)
    if span_exporters:
        _instrument(django=django)
    atexit.register(shutdown)
    log.info(
        "OpenTelemetry on for %s: traces to %s, metrics to %s",
        role,
        ", ".join(span_exporters) or "nowhere",
        ", ".join(metric_exporters) or "nowhere",
    )
    return True


def _instrument(*, django: bool) -> None:
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    if django:
        from opentelemetry.instrumentation.django import DjangoInstrumentor

        DjangoInstrumentor().instrument()
    CeleryInstrumentor().instrument()
    PsycopgInstrumentor().instrument(enable_commenter=False)
    RedisInstrumentor().instrument()


# After a flush that did not finish in time, the next ones are skipped for this long: the
# batch processors keep exporting on their own threads, and tasks stop waiting for them.
FLUSH_BACKOFF_SECONDS = 30.0
_flush_skipped_until = 0.0


def flush(timeout_ms: int = 10_000) -> bool:
    """Export what is queued, waiting at most ``timeout_ms``; True if it all went out.

    The SDK's ``force_flush`` does not honour its timeout (opentelemetry-python #4568): with
    the collector down or hanging, it holds its caller for the exporter's whole retry
    schedule, and a Celery task would wait that long after every execution. So it runs on a
    thread of its own, and after one that overran, flushes are skipped for a while."""
    global _flush_skipped_until
    if not _providers or time.monotonic() < _flush_skipped_until:
        return False
    providers = list(_providers)
    results: list[bool] = []
    done = threading.Event()

    def run() -> None:
        try:
            results.extend(bool(p.force_flush(timeout_ms)) for p in providers)
        finally:
            done.set()

    threading.Thread(target=run, name="otel-flush", daemon=True).start()
    if done.wait(timeout_ms / 1000) and all(results):
        return True
    _flush_skipped_until = time.monotonic() + FLUSH_BACKOFF_SECONDS
    log.warning(
        "OpenTelemetry: the export did not complete within %d ms (is the collector up?);"
        " not waiting for it again for %.0f s",
        timeout_ms,
        FLUSH_BACKOFF_SECONDS,
    )
    return False


def shutdown(timeout_s: float = 5.0) -> None:
    """Export what is left and stop, waiting at most ``timeout_s``: a process on its way out
    must not hang for the exporters' retry schedules when the collector is unreachable."""
    providers = list(reversed(_providers))
    _providers.clear()

    def run() -> None:
        for provider in providers:
            try:
                provider.shutdown()
            except Exception:  # exporting at exit is best effort
                log.debug("telemetry shutdown failed", exc_info=True)

    thread = threading.Thread(target=run, name="otel-shutdown", daemon=True)
    thread.start()
    thread.join(timeout_s)
