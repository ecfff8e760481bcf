"""The engine's own spans (``durability.spans``) against the SDK's: what reaches the span
processors is the same either way, and where the SDK must decide, it does."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags

from durability import spans, telemetry
from tests.span_helpers import steps_with_a_failing_call


def _shape(exporter: InMemorySpanExporter) -> list[tuple]:
    ids = {s.context.span_id: s.name for s in exporter.get_finished_spans()}
    return sorted(
        (
            s.name,
            ids.get(s.parent.span_id) if s.parent else None,
            s.kind,
            dict(s.attributes),
            s.status.status_code,
            s.status.description,
            [(e.name, sorted(dict(e.attributes or {}))) for e in s.events],
            s.instrumentation_scope.name,
            s.start_time <= s.end_time,
        )
        for s in exporter.get_finished_spans()
    )


def test_the_engines_spans_reach_the_processors_as_the_sdks_do(memory_spans):
    steps_with_a_failing_call()
    assert len(memory_spans.get_finished_spans()) == 4
    shape = _shape(memory_spans)
    by_name = {row[0]: row for row in shape}
    assert by_name["step plan"][1] == "run x"
    assert by_name["call llm"][1] == "step plan" and by_name["call llm"][2] == SpanKind.CLIENT
    assert by_name["call llm"][4] == StatusCode.ERROR
    assert by_name["call llm"][5] == "ValueError: rate limited"
    assert by_name["call llm"][6] == [
        (
            "exception",
            ["exception.escaped", "exception.message", "exception.stacktrace", "exception.type"],
        )
    ]
    assert by_name["call llm"][3]["gen_ai.usage.output_tokens"] == 7
    assert by_name["step plan"][3]["durability.step.next"] == "act"
    assert by_name["step plan"][6] == [("call.replayed", ["key"])]
    assert by_name["checkpoint commit"][1] == "step plan"
    assert by_name["checkpoint commit"][3]["durability.checkpoint.sent_ahead"] is True
    assert all(row[7] == "durability" and row[8] for row in shape)
    # And the same trace: every span carries the execution's trace id.
    assert len({s.context.trace_id for s in memory_spans.get_finished_spans()}) == 1


def test_both_ways_give_the_same_spans():
    from opentelemetry.test.globals_test import reset_trace_globals

    shapes = []
    for engine in (True, False):
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        processor = SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
        reset_trace_globals()
        trace.set_tracer_provider(provider)
        if engine:
            spans.install(provider, [processor])
        try:
            steps_with_a_failing_call()
        finally:
            spans.uninstall()
            reset_trace_globals()
        shapes.append(_shape(exporter))
    assert shapes[0] == shapes[1]


@pytest.fixture
def pipeline():
    from opentelemetry.test.globals_test import reset_trace_globals

    def make(**options):
        exporter = InMemorySpanExporter()
        provider = TracerProvider(**options)
        processor = SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
        reset_trace_globals()
        trace.set_tracer_provider(provider)
        spans.install(provider, [processor])
        return provider, exporter

    yield make
    spans.uninstall()
    reset_trace_globals()


def test_where_the_sdk_must_decide_it_does(pipeline):
    provider, exporter = pipeline()
    tracer = provider.get_tracer("t")
    # No parent: a root span's ids and sampling are the SDK's.
    assert spans.start("x", SpanKind.INTERNAL, {}) is None
    # A remote parent (from a traceparent) or one that was not sampled.
    for flags, remote in ((TraceFlags.SAMPLED, True), (TraceFlags.DEFAULT, False)):
        parent = SpanContext(1, 2, is_remote=remote, trace_flags=TraceFlags(flags))
        with trace.use_span(NonRecordingSpan(parent)):
            assert spans.start("x", SpanKind.INTERNAL, {}) is None
    with tracer.start_as_current_span("local"):
        assert spans.start("x", SpanKind.INTERNAL, {}) is not None
        # Another provider installed since: its own API takes every span.
        other = TracerProvider()
        from opentelemetry.test.globals_test import reset_trace_globals

        reset_trace_globals()
        trace.set_tracer_provider(other)
        assert spans.start("x", SpanKind.INTERNAL, {}) is None


def test_a_sampler_that_is_not_parent_based_is_asked(pipeline):
    provider, exporter = pipeline(sampler=TraceIdRatioBased(1.0))
    with provider.get_tracer("t").start_as_current_span("root"):
        assert spans.start("x", SpanKind.INTERNAL, {}) is None
        with telemetry.step("s", 0, 1):
            pass
    # The SDK's tracer made the step's span, with this sampler's decision.
    assert sorted(s.name for s in exporter.get_finished_spans()) == ["root", "step s"]


def test_attribute_limits_and_bad_values_as_the_sdk_applies_them(pipeline, monkeypatch, caplog):
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "4")
    provider, exporter = pipeline()
    with provider.get_tracer("t").start_as_current_span("root"):
        span = spans.start("x", SpanKind.INTERNAL, {"durability.step.name": "a-long-name"})
        with spans.current(span):
            span.set_attribute("bad", {"a": 1})  # not an attribute value: dropped, logged
            span.set_attribute("list", ["ab", "cd"])
            span.set_attribute("mixed", ["ab", 1])
    [done] = [s for s in exporter.get_finished_spans() if s.name == "x"]
    assert done.attributes["durability.step.name"] == "a-lo"
    assert done.attributes["list"] == ("ab", "cd")
    assert "bad" not in done.attributes and "mixed" not in done.attributes
    assert "Invalid type dict" in caplog.text
    # Ended: nothing changes it any more.
    span.set_attribute("late", 1)
    span.set_status(StatusCode.ERROR)
    assert not span.is_recording() and "late" not in done.attributes


def test_a_lost_executions_stand_in_keeps_its_identity_and_only_when_sampled(pipeline):
    from types import SimpleNamespace

    provider, exporter = pipeline()
    root = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    lost = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"
    run = SimpleNamespace(id="r-1", agent="a", agent_version="1", trace_parent=root)
    kwargs = {"worker": "w@h", "attempt": 2, "started_ns": 10, "ended_ns": 5}
    assert telemetry.lost_execution(run, lost, **kwargs)
    [span] = exporter.get_finished_spans()
    assert (span.context.trace_id, span.context.span_id) == (
        0x0AF7651916CD43DD8448EB211C80319C,
        0x00F067AA0BA902B7,
    )
    assert not span.context.is_remote and span.parent.span_id == 0xB7AD6B7169203331
    assert span.name == "run a" and span.kind == SpanKind.CONSUMER
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["durability.execution.lost"] is True
    assert span.attributes["durability.worker"] == "w@h"
    assert span.start_time == 10 and span.end_time == 10  # never before its start
    # In another trace than the run's root: no parent is claimed for it.
    elsewhere = "00-11111111111111111111111111111111-00f067aa0ba902b7-01"
    assert telemetry.lost_execution(run, elsewhere, **kwargs)
    assert exporter.get_finished_spans()[-1].parent is None
    # Unsampled, absent or unreadable: nothing is written.
    exporter.clear()
    for previous in (lost[:-2] + "00", "", "not a traceparent"):
        assert not telemetry.lost_execution(run, previous, **kwargs)
    assert exporter.get_finished_spans() == ()
    # Under a provider the engine's spans are not installed on: nothing either.
    spans.uninstall()
    assert not telemetry.lost_execution(run, lost, **kwargs)


@pytest.mark.django_db(transaction=True)
def test_a_run_started_with_no_span_active_is_still_one_trace(memory_spans):
    """A script, the demo seeder or a fork outside a request starts a run with no span
    active: the run gets a root span of its own, and every execution hangs under it, even
    when a delivery from another trace (a sweep re-enqueuing it) executes it."""
    from opentelemetry import trace

    from durability import operations
    from durability.testing import drive

    def traceparent(span) -> str:
        context = span.get_span_context() if hasattr(span, "get_span_context") else span.context
        return f"{context.trace_id:032x}-{context.span_id:016x}"

    def ids(run) -> str:
        return run.trace_parent.split("-", 1)[1].rsplit("-", 1)[0]

    run = operations.start("test-ticker", {"n": 2}, by="script")
    [root] = [s for s in memory_spans.get_finished_spans() if s.name == "start test-ticker"]
    assert root.parent is None and root.attributes["durability.agent.name"] == "test-ticker"
    assert ids(run) == traceparent(root)
    with trace.get_tracer("t").start_as_current_span("sweep") as sweep:
        drive(run.id)
    executions = [s for s in memory_spans.get_finished_spans() if s.name == "run test-ticker"]
    assert executions
    for execution in executions:
        assert execution.parent.span_id == root.context.span_id
        assert execution.context.trace_id == root.context.trace_id
        assert [link.context.span_id for link in execution.links] == [
            sweep.get_span_context().span_id
        ]

    # Under an active span (a request, a CLI command), that span is the run's parent.
    memory_spans.clear()
    with trace.get_tracer("t").start_as_current_span("request") as request:
        started = operations.start("test-ticker", {"n": 1}, by="web")
        forked = operations.fork(run.id, 1, by="web")
    assert ids(started) == ids(forked) == traceparent(request)
    assert [s.name for s in memory_spans.get_finished_spans()] == ["request"]

    # A fork with none active gets its own root, naming the run it came from.
    forked = operations.fork(run.id, 1, by="script")
    [root] = [s for s in memory_spans.get_finished_spans() if s.name == "fork test-ticker"]
    assert root.attributes["durability.fork.source"] == str(run.id)
    assert ids(forked) == traceparent(root)
