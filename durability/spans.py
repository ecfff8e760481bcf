"""The pieces of the SDK set-up that belong to the engine's spans: how a step's span carries
its checkpoint commit, how the stand-in for a lost execution keeps that execution's identity,
and the redaction gate in front of the span processors.

Every span is the SDK's own, made by its tracer (``durability.telemetry``) and handed to its
processors: ``on_start`` and ``on_end`` run for each, samplers and limits apply as
configured.

- **A checkpoint commit is an event of its step's span** (``checkpoint.commit``: sequence,
  snapshot or delta, bytes, latency). A commit sent ahead is answered while the next step
  runs: its step's span then waits for the answer before it ends, with the end time it had
  when the step returned, so its duration is the step's own and the event is on it.
- **A stand-in keeps the lost execution's ids.** An execution whose process died never
  exported its span, so what it had exported (its steps, calls) points at a parent nobody
  sent. ``StandInIds``, the provider's id generator, hands the tracer those ids for the one
  span that stands in for it; every other span gets random ids.
- **Text passes the redaction gate** (``durability.redact``) as a span ends, in the thread
  that made it: ``Redacting`` sits in front of each span processor.

Imported on first use (it imports the SDK): a process tracing nothing never needs it.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import Link, Status, StatusCode

from durability import redact

COMMIT_EVENT = "checkpoint.commit"
# The execution's list of step spans still waiting for their commit's answer, and the step
# whose span is current: values of the OpenTelemetry context, so they follow the active span.
_WAITING = otel_context.create_key("durability.waiting_steps")
_STEP = otel_context.create_key("durability.step")


class FrozenResource(Resource):
    """A resource whose hash is computed once. The OTLP encoder groups spans by resource,
    hashing it for every span, and ``Resource.__hash__`` serialises the attributes to JSON
    each time; a resource's attributes never change."""

    _frozen_hash: int | None = None

    @classmethod
    def of(cls, resource: Resource) -> FrozenResource:
        return cls(resource.attributes, resource.schema_url)

    def __hash__(self) -> int:
        if self._frozen_hash is None:
            self._frozen_hash = super().__hash__()
        return self._frozen_hash


# --- the stand-in's identity -------------------------------------------------------------------

_wanted: contextvars.ContextVar[trace.SpanContext | None] = contextvars.ContextVar(
    "durability_stand_in_ids", default=None
)


class StandInIds(IdGenerator):
    """Random ids, except for a span started inside ``ids_of(context)``: that one gets
    ``context``'s span id (and its trace id, when it starts a trace)."""

    def __init__(self) -> None:
        self.random = RandomIdGenerator()

    def generate_span_id(self) -> int:
        wanted = _wanted.get()
        return wanted.span_id if wanted is not None else self.random.generate_span_id()

    def generate_trace_id(self) -> int:
        wanted = _wanted.get()
        return wanted.trace_id if wanted is not None else self.random.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return self.random.is_trace_id_random()


class ids_of:  # noqa: N801 - used as a context manager, like contextlib's
    """The next span started in this block takes ``context``'s ids (under ``StandInIds``)."""

    def __init__(self, context: trace.SpanContext) -> None:
        self.context = context
        self.token: Any = None

    def __enter__(self) -> None:
        self.token = _wanted.set(self.context)

    def __exit__(self, *exc: Any) -> None:
        _wanted.reset(self.token)


# --- redaction -----------------------------------------------------------------------------------


def _scrubbed_status(status: Status, secrets: set[str]) -> Status:
    if status.description and redact.contains_secret(status.description, secrets):
        return Status(status.status_code, redact.scrub(status.description, secrets))
    return status


def _scrubbed_events(events: Sequence[Event], secrets: set[str]) -> tuple[Event, ...]:
    return tuple(
        Event(
            redact.scrub(e.name, secrets),
            redact.scrub(dict(e.attributes), secrets) if e.attributes else e.attributes,
            e.timestamp,
        )
        for e in events
    )


def redacted(span: ReadableSpan, secrets: set[str]) -> ReadableSpan:
    """A copy of ``span`` with ``secrets`` replaced in its name, attributes, events, links and
    status."""
    return ReadableSpan(
        name=redact.scrub(span.name, secrets),
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=redact.scrub(dict(span.attributes or {}), secrets),
        events=_scrubbed_events(span.events, secrets),
        links=tuple(
            Link(link.context, redact.scrub(dict(link.attributes or {}), secrets))
            for link in span.links
        ),
        kind=span.kind,
        status=_scrubbed_status(span.status, secrets),
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


class Redacting(SpanProcessor):
    """In front of a span processor: a span that ends while an execution's secrets are in
    scope is handed on scrubbed. (Exporting happens on other threads, where the scope is
    not visible: this is the last point where it is.)"""

    def __init__(self, inner: SpanProcessor) -> None:
        self.inner = inner

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.inner.on_start(span, parent_context=parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        secrets = redact.active()
        self.inner.on_end(redacted(span, secrets) if secrets else span)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def tracer_provider(
    processors: Sequence[SpanProcessor], resource: Resource | None = None
) -> TracerProvider:
    """The SDK's tracer provider as the engine's spans need it: ids from ``StandInIds``, and
    each of ``processors`` behind the redaction gate."""
    provider = TracerProvider(resource=resource, id_generator=StandInIds())
    for processor in processors:
        provider.add_span_processor(Redacting(processor))
    return provider


# --- spans as the current one, and the commits their steps send ---------------------------------


class Current:
    """``span`` as the current span for a ``with`` block; an exception is recorded on it as
    the SDK's ``use_span`` records it. ``step``: the span of a step, whose commits become its
    events; if one is still unanswered when the block ends, the span ends with that answer
    (at the time the block ended). A class, not a generator: it runs for every step, call
    and effect, and contextlib's machinery costs more than the rest."""

    __slots__ = ("span", "step", "token", "pending", "ended_at", "waiting")

    def __init__(self, span: trace.Span, step: bool = False) -> None:
        self.span = span
        self.step = step
        self.token: Any = None
        self.pending = 0
        self.ended_at: int | None = None
        self.waiting: list[Current] | None = None

    def __enter__(self) -> trace.Span:
        context = trace.set_span_in_context(self.span)
        if self.step:
            context = otel_context.set_value(_STEP, self, context)
        self.token = otel_context.attach(context)
        return self.span

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> None:
        span = self.span
        if isinstance(exc, Exception) and span.is_recording():
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        if self.pending:
            self.waiting = otel_context.get_value(_WAITING)  # type: ignore[assignment]
            if self.waiting is not None:
                self.waiting.append(self)
            self.ended_at = time.time_ns()
            otel_context.detach(self.token)
            return
        otel_context.detach(self.token)
        span.end()

    def answered(self) -> None:
        """One of the step's commits was answered: end the span if it only waited for that."""
        self.pending = max(0, self.pending - 1)
        if self.pending or self.ended_at is None or not self.span.is_recording():
            return
        if self.waiting is not None and self in self.waiting:
            self.waiting.remove(self)
        self.span.end(end_time=self.ended_at)


def waiting_steps() -> tuple[list[Current], otel_context.Context]:
    """A fresh list for an execution's steps that wait for their commit, and a context that
    carries it."""
    waiting: list[Current] = []
    return waiting, otel_context.set_value(_WAITING, waiting)


def end_waiting(waiting: list[Current]) -> None:
    """The execution is over: a step span still waiting for its commit's answer (a path that
    never took it) ends now, at its own end time, rather than never."""
    for step in list(waiting):
        step.pending = 1
        step.answered()


class Commit:
    """A checkpoint commit in progress: becomes an event of its step's span when it ends."""

    __slots__ = ("owner", "span", "attributes", "started_ns", "started")

    def __init__(self, attributes: dict[str, Any]) -> None:
        owner = otel_context.get_value(_STEP)
        span = trace.get_current_span()
        # The step's span, wherever the commit is made inside the step (a periodic level's
        # commit is made inside a call); outside any step, the current span.
        self.owner: Current | None = owner if isinstance(owner, Current) else None
        self.span = self.owner.span if self.owner is not None else span
        if self.owner is not None:
            self.owner.pending += 1
        self.attributes = attributes
        self.started_ns = time.time_ns()
        self.started = time.perf_counter()

    def end(self, error: BaseException | None = None) -> None:
        attributes = self.attributes
        attributes["durability.checkpoint.latency_ms"] = round(
            (time.perf_counter() - self.started) * 1000, 3
        )
        span = self.span
        if error is not None:
            attributes["durability.checkpoint.error"] = str(error)[:500]
            if span.is_recording():
                span.set_status(Status(StatusCode.ERROR, str(error)[:500]))
        if span.is_recording():
            span.add_event(COMMIT_EVENT, attributes, self.started_ns)
        if self.owner is not None:
            self.owner.answered()

    def __enter__(self) -> Commit:
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> None:
        self.end(exc)
