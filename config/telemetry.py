"""OpenTelemetry SDK set-up, from the standard environment variables only.

Nothing is installed unless an OTLP endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT``
or its ``_TRACES_``/``_METRICS_`` variants) and ``OTEL_SDK_DISABLED`` is not true: then the
engine's spans cost one function call each. With an endpoint: traces and metrics go out
over OTLP/HTTP (protobuf), the service name and resource come from ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES``, the sampler from ``OTEL_TRACES_SAMPLER``, and Django, Celery,
psycopg and Redis are traced by their maintained instrumentation packages.

Each process calls ``setup()`` once: web (wsgi), the CLI (manage.py), every Celery pool
process (after fork: the SDK's export threads do not survive one) and beat.
"""

from __future__ import annotations

import atexit
import logging
import os

from django.core.exceptions import ImproperlyConfigured

log = logging.getLogger(__name__)

_ENDPOINT_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)
# A checkpoint per step makes bursts of spans: room for them, exported every second. Every
# commit records its latency; offering each one as an exemplar (the SDK's default inside a
# sampled span) adds about a third to that recording, for a link the commit's own span
# already gives. Each can still be set with its standard variable.
_DEFAULTS = {
    "OTEL_BSP_MAX_QUEUE_SIZE": "65536",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4096",
    "OTEL_BSP_SCHEDULE_DELAY": "1000",
    "OTEL_METRICS_EXEMPLAR_FILTER": "always_off",
}

_providers: list = []


def configured() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(os.environ.get(name) for name in _ENDPOINT_VARS)


def setup(role: str, *, django: bool = False) -> bool:
    """Install the SDK for this process; returns False (and does nothing) without an
    endpoint. ``role`` names the service when ``OTEL_SERVICE_NAME`` is not set."""
    if _providers or not configured():
        return bool(_providers)
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    if protocol != "http/protobuf":
        raise ImproperlyConfigured(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported here; use"
            " http/protobuf (an OpenTelemetry Collector accepts it on port 4318)"
        )
    for name, value in _DEFAULTS.items():
        os.environ.setdefault(name, value)

    from opentelemetry import metrics, trace
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes[SERVICE_NAME] = f"durability-{role}"
    resource = Resource.create(attributes)
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(tracer_provider)
    meter_provider = MeterProvider(
        resource=resource, metric_readers=[PeriodicExportingMetricReader(OTLPMetricExporter())]
    )
    metrics.set_meter_provider(meter_provider)
    _providers.extend([tracer_provider, meter_provider])
    _instrument(django=django)
    atexit.register(shutdown)
    log.info("OpenTelemetry export on for %s", role)
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


def flush(timeout_ms: int = 10_000) -> None:
    for provider in _providers:
        provider.force_flush(timeout_ms)


def shutdown() -> None:
    while _providers:
        provider = _providers.pop()
        try:
            provider.shutdown()
        except Exception:  # exporting at exit is best effort
            log.debug("telemetry shutdown failed", exc_info=True)
