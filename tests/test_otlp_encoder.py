"""The OTLP/HTTP request body written by ``config.otlp`` is the SDK encoder's, byte for byte,
for the engine's spans and for every shape of span and attribute value the SDK can hand an
exporter; and the exporter built on it sends, refuses and stops as the SDK's does."""

from __future__ import annotations

import logging

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from config.otlp import OTLPSpanExporter, encode_spans
from tests.otlp import OTLPReceiver
from tests.span_helpers import steps_with_a_failing_call


def _sdk_bytes(spans) -> bytes:
    return sdk_encode(spans).SerializePartialToString()


def _recorded(provider: TracerProvider) -> tuple[InMemorySpanExporter, TracerProvider]:
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, provider


def test_the_engines_spans_encode_as_the_sdk_does(memory_spans):
    """Step, call (with GenAI attributes and an error), event, commit: as the engine makes
    them, through its own spans and through the SDK's tracer."""
    steps_with_a_failing_call()
    spans = memory_spans.get_finished_spans()
    assert len(spans) == 4
    assert encode_spans(spans) == _sdk_bytes(spans)


def test_every_span_field_encodes_as_the_sdk_does():
    """Kinds, remote and local parents, trace state, events, links, statuses, dropped
    counts, two resources, scopes with and without version, schema URL and attributes."""
    limits = SpanLimits(max_span_attributes=3, max_events=2, max_links=1)
    first, p1 = _recorded(
        TracerProvider(
            resource=Resource({"service.name": "a", "n": 3}, schema_url="https://r/1"),
            span_limits=limits,
        )
    )
    second, p2 = _recorded(TracerProvider(resource=Resource({"service.name": "b"})))
    scoped = p1.get_tracer("lib", "2.0", schema_url="https://s/1", attributes={"x": True})
    bare = p1.get_tracer("bare")
    remote = SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
        trace_state=TraceState([("vendor", "v1"), ("other", "x=y")]),
    )
    under_remote = set_span_in_context(NonRecordingSpan(remote))
    for i, kind in enumerate(SpanKind):
        tracer = scoped if i % 2 else bare
        with tracer.start_as_current_span(
            f"op {i}", kind=kind, context=under_remote if i == 1 else None
        ) as span:
            span.set_attributes({"a": i, "b": "two", "c": [1.5, -2.0], "d": "dropped"})
            span.add_event("e1", {"k": "v"}, timestamp=1_700_000_000_000_000_000 + i)
            span.add_event("")
            span.add_event("e3")
            span.add_link(remote, {"why": "resumed"})
            span.add_link(span.get_span_context())
            if i == 2:
                span.set_status(Status(StatusCode.ERROR, "it broke"))
            elif i == 3:
                span.set_status(StatusCode.OK)
            with tracer.start_as_current_span(""):
                pass
    with p2.get_tracer("other").start_as_current_span("elsewhere"):
        pass
    unstarted = ReadableSpan(
        "unstarted", context=SpanContext(5, 6, False), events=[Event("e", timestamp=0)]
    )
    spans = [*first.get_finished_spans(), *second.get_finished_spans(), unstarted]
    assert {s.dropped_attributes for s in spans} >= {1}
    assert {s.dropped_events for s in spans} >= {1}
    assert {s.dropped_links for s in spans} >= {1}
    interleaved = spans[::2] + spans[1::2]  # grouping by resource and scope, in first-seen order
    assert encode_spans(interleaved) == _sdk_bytes(interleaved)
    assert encode_spans([]) == _sdk_bytes([])


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
    | st.binary(max_size=300)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=12,
)


def _span(attributes: dict, events: list, name: str) -> ReadableSpan:
    ctx = SpanContext(trace_id=7, span_id=9, is_remote=False, trace_flags=TraceFlags(1))
    return ReadableSpan(
        name=name,
        context=ctx,
        parent=None,
        resource=Resource({"service.name": "h"}),
        attributes=attributes,
        events=[Event(n, a, timestamp=5) for n, a in events],
        links=[Link(ctx, attributes)],
        kind=SpanKind.INTERNAL,
        instrumentation_scope=InstrumentationScope("h"),
        status=Status(StatusCode.UNSET),
        start_time=1,
        end_time=2**63 + 5,
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    attributes=st.dictionaries(st.text(max_size=20), _values, max_size=8),
    events=st.lists(
        st.tuples(st.text(max_size=10), st.dictionaries(st.text(max_size=5), _values)),
        max_size=2,
    ),
    name=st.text(max_size=40),
)
def test_generated_attribute_values_encode_as_the_sdk_does(attributes, events, name):
    """Values of every type, nested; integers beyond 64 bits, NaN, empty strings and keys;
    the SDK's encoder leaves out what it cannot encode, and so must this one."""
    logging.disable(logging.CRITICAL)  # both encoders log each value they leave out
    try:
        span = _span(attributes, events, name)
        assert encode_spans([span, span]) == _sdk_bytes([span, span])
    finally:
        logging.disable(logging.NOTSET)


def test_a_value_that_cannot_be_encoded_is_left_out_and_logged(caplog):
    span = _span({"ok": 1, "huge": 2**70, "surrogate": "\ud800", "obj": object()}, [], "s")
    with caplog.at_level(logging.ERROR, logger="config.otlp"):
        body = encode_spans([span])
    assert body == _sdk_bytes([span])
    assert {r.args[0] for r in caplog.records} == {"huge", "surrogate", "obj"}


def test_the_exporter_sends_refuses_and_stops_as_the_sdks():
    receiver = OTLPReceiver().start()
    try:
        exporter, provider = _recorded(TracerProvider(resource=Resource({"service.name": "e"})))
        with provider.get_tracer("t").start_as_current_span("sent", attributes={"n": 1}):
            pass
        spans = exporter.get_finished_spans()
        otlp = OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces")
        assert otlp.export(spans) is SpanExportResult.SUCCESS
        (got,) = receiver.spans()
        assert (got.service, got.name, got.attributes) == ("e", "sent", {"n": 1})

        # Over the size limit: nothing is sent, the batch is reported failed.
        small = OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces", max_request_size=10)
        assert small.export(spans) is SpanExportResult.FAILURE
        assert receiver.received.requests == 1

        # A collector that answers 404 (a wrong path) fails the batch without retries.
        wrong = OTLPSpanExporter(endpoint=f"{receiver.url}/v1/nowhere")
        assert wrong.export(spans) is SpanExportResult.FAILURE

        otlp.shutdown()
        assert otlp.export(spans) is SpanExportResult.FAILURE
        assert receiver.received.requests == 1
    finally:
        receiver.stop()
