"""The engine's spans (``durability.telemetry``, ``durability.spans``), made by the SDK's own
tracer: what reaches the span processors, a checkpoint commit as an event of its step's span,
and the stand-in for a lost execution."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode

from durability import spans, telemetry
from tests.span_helpers import steps_with_a_failing_call


def by_name(exporter: InMemorySpanExporter) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_the_engines_spans_reach_the_processors(memory_spans):
    steps_with_a_failing_call()
    done = by_name(memory_spans)
    assert sorted(done) == ["call llm", "run x", "step plan"]
    step, call = done["step plan"], done["call llm"]
    assert step.parent.span_id == done["run x"].context.span_id
    assert call.parent.span_id == step.context.span_id and call.kind == SpanKind.CLIENT
    assert call.status.status_code == StatusCode.ERROR
    assert call.status.description == "ValueError: rate limited"
    [exception] = call.events
    assert exception.name == "exception"
    assert sorted(exception.attributes) == [
        "exception.escaped",
        "exception.message",
        "exception.stacktrace",
        "exception.type",
    ]
    assert call.attributes["gen_ai.usage.output_tokens"] == 7
    assert step.attributes["durability.step.next"] == "act"
    assert all(s.instrumentation_scope.name == "durability" for s in done.values())
    assert len({s.context.trace_id for s in done.values()}) == 1


def test_a_commit_is_an_event_of_its_steps_span(memory_spans):
    """A commit sent ahead is answered after its step returned: the step's span waits for
    it, then ends at the time the step returned, with the commit as an event on it."""
    steps_with_a_failing_call()
    step = by_name(memory_spans)["step plan"]
    assert [e.name for e in step.events] == ["call.replayed", "checkpoint.commit"]
    commit = step.events[1]
    assert commit.attributes["durability.checkpoint.seq"] == 4
    assert commit.attributes["durability.checkpoint.kind"] == "delta"
    assert commit.attributes["durability.checkpoint.bytes"] == 1200
    assert commit.attributes["durability.checkpoint.delta_bytes"] == 300
    assert commit.attributes["durability.checkpoint.latency_ms"] >= 0
    assert step.start_time <= commit.timestamp <= step.end_time
    # Its end is the step's: it ended before the run's span, which outlived the commit.
    assert step.end_time <= by_name(memory_spans)["run x"].end_time


def test_a_commit_made_while_waiting_and_one_that_failed(memory_spans):
    with telemetry.tracer().start_as_current_span("run x"):
        with telemetry.step("plan", 0, 1), telemetry.commit("r-1", 1, 900, 900, True):
            pass
        with telemetry.step("act", 1, 2):
            commit = telemetry.start_commit("r-1", 2, 950, 80, False)
            telemetry.note_recovered(commit)
        telemetry.end_commit(commit, RuntimeError("fenced out: the lease moved on"))
    done = by_name(memory_spans)
    [first] = done["step plan"].events
    assert first.name == "checkpoint.commit"
    assert first.attributes["durability.checkpoint.kind"] == "snapshot"
    assert "durability.checkpoint.recovered" not in first.attributes
    assert done["step plan"].status.status_code == StatusCode.UNSET
    [second] = done["step act"].events
    assert second.attributes["durability.checkpoint.recovered"] is True
    assert second.attributes["durability.checkpoint.error"] == "fenced out: the lease moved on"
    assert done["step act"].status.status_code == StatusCode.ERROR
    # A step's attempt is written from the second on.
    assert "durability.step.attempt" not in done["step plan"].attributes
    assert done["step act"].attributes["durability.step.attempt"] == 2


def test_a_step_left_waiting_ends_with_its_execution(memory_spans):
    """A way out of an execution that never took its last commit's answer still exports
    the step's span, at the step's own end time."""
    run = SimpleNamespace(
        id="r-1", agent="a", agent_version="1", attempts=1, head_seq=0, trace_parent=""
    )
    with telemetry.execution(run, "w@h", ""):
        with telemetry.step("plan", 0, 1):
            telemetry.start_commit("r-1", 1, 10, 10, False)
        assert "step plan" not in by_name(memory_spans)
    step = by_name(memory_spans)["step plan"]
    assert step.events == ()  # no answer, no commit to show
    assert step.end_time <= by_name(memory_spans)["run a"].end_time


@pytest.fixture
def provider():
    from opentelemetry.test.globals_test import reset_trace_globals

    made: list[TracerProvider] = []

    def make(processor: SpanProcessor, **options) -> TracerProvider:
        made.append(TracerProvider(**options))
        made[-1].add_span_processor(processor)
        reset_trace_globals()
        trace.set_tracer_provider(made[-1])
        return made[-1]

    yield make
    for p in made:
        p.shutdown()
    reset_trace_globals()


def test_processors_see_every_span_start(provider):
    class Starts(SpanProcessor):
        def __init__(self) -> None:
            self.started: list[str] = []

        def on_start(self, span, parent_context=None) -> None:
            self.started.append(span.name)

    starts = Starts()
    provider(starts)
    steps_with_a_failing_call()
    assert starts.started == ["run x", "step plan", "call llm"]


def test_the_sampler_decides(provider):
    exporter = InMemorySpanExporter()
    provider(SimpleSpanProcessor(exporter), sampler=TraceIdRatioBased(0.0))
    with telemetry.step("s", 0, 1) as span:
        commit = telemetry.start_commit("r-1", 1, 10, 10, False)
    telemetry.end_commit(commit)
    assert not span.is_recording()
    assert exporter.get_finished_spans() == ()


ROOT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
LOST = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"


def lost_run() -> SimpleNamespace:
    return SimpleNamespace(id="r-1", agent="a", agent_version="1", trace_parent=ROOT)


LOST_ARGS = {"worker": "w@h", "attempt": 2, "started_ns": 10, "ended_ns": 5}


def test_a_lost_executions_stand_in_keeps_its_identity_and_only_when_sampled(memory_spans):
    run = lost_run()
    with telemetry.tracer().start_as_current_span("resumed"):
        assert telemetry.lost_execution(run, LOST, **LOST_ARGS)
    [span] = [s for s in memory_spans.get_finished_spans() if s.name == "run a"]
    assert span.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert not span.context.is_remote and span.parent.span_id == 0xB7AD6B7169203331
    keeps_ids = isinstance(trace.get_tracer_provider().id_generator, spans.StandInIds)
    if keeps_ids:
        assert span.context.span_id == 0x00F067AA0BA902B7 and not span.links
    else:  # ids it cannot choose: it points at the lost span instead
        [link] = span.links
        assert link.context.span_id == 0x00F067AA0BA902B7
    assert span.kind == SpanKind.CONSUMER
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["durability.execution.lost"] is True
    assert span.attributes["durability.worker"] == "w@h"
    assert span.start_time == 10 and span.end_time == 10  # never before its start
    # The next span gets ids of its own.
    with telemetry.tracer().start_as_current_span("next") as following:
        assert following.get_span_context().span_id != 0x00F067AA0BA902B7
    # In another trace than the run's root: no parent is claimed for it.
    elsewhere = "00-11111111111111111111111111111111-00f067aa0ba902b7-01"
    assert telemetry.lost_execution(run, elsewhere, **LOST_ARGS)
    latest = memory_spans.get_finished_spans()[-1]
    assert latest.parent is None and latest.name == "run a"
    if keeps_ids:
        assert latest.context.trace_id == 0x11111111111111111111111111111111
    # Unsampled, absent or unreadable: nothing is written.
    memory_spans.clear()
    for previous in (LOST[:-2] + "00", "", "not a traceparent"):
        assert not telemetry.lost_execution(run, previous, **LOST_ARGS)
    assert memory_spans.get_finished_spans() == ()


def test_no_stand_in_without_tracing():
    assert not telemetry.lost_execution(lost_run(), LOST, **LOST_ARGS)


@pytest.mark.django_db(transaction=True)
def test_a_run_started_with_no_span_active_is_still_one_trace(memory_spans):
    """A script, the demo seeder or a fork outside a request starts a run with no span
    active: the run gets a root span of its own, and every execution hangs under it, even
    when a delivery from another trace (a sweep re-enqueuing it) executes it."""
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
    # Every step's span arrived, each with its commit as an event.
    steps = [s for s in memory_spans.get_finished_spans() if s.name.startswith("step ")]
    assert steps
    assert all([e.name for e in s.events].count("checkpoint.commit") == 1 for s in steps)

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
