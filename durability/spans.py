"""The engine's own spans on the hot path, handed straight to the SDK's span processors.

A step makes three spans or more (the step, its calls and effects, its checkpoint commit),
and the SDK's ``Tracer.start_span`` costs about 40 to 50 µs of interpreter time for each:
the sampler, a lock, bounded attribute and event lists, a copy into a ``ReadableSpan`` at
the end. On a step of about 2 ms that alone was a tenth of the step. A span here records into
plain fields and becomes one ``ReadableSpan`` when it ends, given to the same processors,
exported by the same exporters: about 8 µs (``bench.tracing`` prints the effect).

It is used only where that is what the SDK would have done:
- the tracer provider is the one ``config.telemetry`` installed with these processors (set
  with ``install``); a provider anyone else installed gets every span through its own API;
- the parent is a local span that is sampled, and the sampler is parent-based or always on,
  so the SDK's decision for this child is known (record and sample) without asking it;
- a limit on attribute values from the standard variables is applied as the SDK would.
Everywhere else ``start`` returns None and the caller takes the SDK's path.

Text on a span passes the redaction gate (``durability.redact``) when the span ends, in the
thread that made it: here for the engine's spans, and in ``Redacting``, the processor
``config.telemetry`` puts in front of the SDK's, for everyone else's.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode

from durability import redact

log = logging.getLogger(__name__)

_SCALARS = (str, bool, int, float)
_UNSET = Status(StatusCode.UNSET)


class FrozenResource(Resource):
    """A resource whose hash is computed once. The OTLP encoder groups spans by resource,
    hashing it for every span, and ``Resource.__hash__`` serialises the attributes to JSON
    each time (about a tenth of the encoding); a resource's attributes never change."""

    _hash: int | None = None

    @classmethod
    def of(cls, resource: Resource) -> FrozenResource:
        return cls(resource.attributes, resource.schema_url)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = super().__hash__()
        return self._hash


class _Pipeline:
    def __init__(self, provider: TracerProvider, processors: Sequence[SpanProcessor]) -> None:
        self.provider = provider
        self.processors = tuple(processors)
        self.resource = provider.resource
        self.ids = provider.id_generator
        self.scope = InstrumentationScope("durability")
        limits = SpanLimits()
        self.max_attributes = limits.max_span_attributes
        self.max_value_len = limits.max_span_attribute_length
        self.max_events = limits.max_events
        sampler = provider.sampler
        self.usable = isinstance(sampler, ParentBased) or sampler is ALWAYS_ON


_pipeline: _Pipeline | None = None


def install(provider: TracerProvider, processors: Sequence[SpanProcessor]) -> None:
    """Hand the engine's spans to ``processors`` (those of ``provider``, which must be the
    global tracer provider for this to take effect)."""
    global _pipeline
    # The engine's spans are scrubbed as they end: not twice.
    inner = [p.inner if isinstance(p, Redacting) else p for p in processors]
    _pipeline = _Pipeline(provider, inner)


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


def uninstall() -> None:
    global _pipeline
    _pipeline = None


def _clean(value: Any) -> Any:
    """An attribute value as the SDK accepts it, or None (dropped, with a warning)."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        kinds = {type(v) for v in value if v is not None}
        if len(kinds) <= 1 and all(k in _SCALARS for k in kinds):
            return tuple(value)
    log.warning("Invalid type %s for attribute value; dropped", type(value).__name__)
    return None


class Span(trace.Span):
    """A recording span of the engine's, ended once; not shared between threads."""

    __slots__ = (
        "_pipeline",
        "_name",
        "_context",
        "_parent",
        "_kind",
        "_attributes",
        "_events",
        "_status",
        "_start",
        "_ended",
    )

    def __init__(
        self,
        pipeline: _Pipeline,
        name: str,
        context: SpanContext,
        parent: SpanContext,
        kind: SpanKind,
        attributes: dict[str, Any],
    ) -> None:
        self._pipeline = pipeline
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._attributes = attributes
        self._events: list[Event] = []
        self._status = _UNSET
        self._start = time.time_ns()
        self._ended = False

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return not self._ended

    def set_attribute(self, key: str, value: Any) -> None:
        if self._ended or not isinstance(key, str) or not key:
            return
        value = _clean(value)
        if value is not None:
            self._attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(
        self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None
    ) -> None:
        if self._ended or len(self._events) >= (self._pipeline.max_events or 0):
            return
        clean = None
        if attributes:
            clean = {k: c for k, v in attributes.items() if (c := _clean(v)) is not None}
        self._events.append(Event(name, clean, timestamp or time.time_ns()))

    def update_name(self, name: str) -> None:
        if not self._ended:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # As the SDK: OK is final, UNSET changes nothing.
        if self._ended or self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if status.status_code is not StatusCode.UNSET:
            self._status = status

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        module = type(exception).__module__
        qualname = type(exception).__qualname__
        recorded = {
            "exception.type": f"{module}.{qualname}" if module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        recorded.update(attributes or {})
        self.add_event("exception", recorded, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        pipeline = self._pipeline
        attributes: Any = self._attributes
        secrets = redact.active()
        if secrets:
            self._name = redact.scrub(self._name, secrets)
            attributes = redact.scrub(attributes, secrets)
            self._events = list(_scrubbed_events(self._events, secrets))
            self._status = _scrubbed_status(self._status, secrets)
        if pipeline.max_value_len is not None or len(attributes) > pipeline.max_attributes:
            attributes = BoundedAttributes(
                pipeline.max_attributes,
                attributes,
                immutable=True,
                max_value_len=pipeline.max_value_len,
            )
        finished = ReadableSpan(
            name=self._name,
            context=self._context,
            parent=self._parent,
            resource=pipeline.resource,
            attributes=attributes,
            events=tuple(self._events),
            kind=self._kind,
            status=self._status,
            start_time=self._start,
            end_time=end_time or time.time_ns(),
            instrumentation_scope=pipeline.scope,
        )
        for processor in pipeline.processors:
            processor.on_end(finished)


def record(
    name: str,
    context: SpanContext,
    parent: SpanContext | None,
    kind: SpanKind,
    attributes: dict[str, Any],
    start_ns: int,
    end_ns: int,
    status: Status,
) -> bool:
    """Hand the processors a finished span whose identity is already known (a span another
    process started and could not end); False, and nothing sent, where the engine's spans
    are not installed or ``context`` is not sampled."""
    pipeline = _pipeline
    if pipeline is None or trace.get_tracer_provider() is not pipeline.provider:
        return False
    if not context.trace_flags.sampled:
        return False
    secrets = redact.active()
    if secrets:
        name, attributes = redact.scrub(name, secrets), redact.scrub(attributes, secrets)
        status = _scrubbed_status(status, secrets)
    finished = ReadableSpan(
        name=name,
        context=context,
        parent=parent,
        resource=pipeline.resource,
        attributes=BoundedAttributes(
            pipeline.max_attributes,
            {k: c for k, v in attributes.items() if (c := _clean(v)) is not None},
            immutable=True,
            max_value_len=pipeline.max_value_len,
        ),
        kind=kind,
        status=status,
        start_time=start_ns,
        end_time=max(start_ns, end_ns),
        instrumentation_scope=pipeline.scope,
    )
    for processor in pipeline.processors:
        processor.on_end(finished)
    return True


def start(name: str, kind: SpanKind, attributes: dict[str, Any]) -> Span | None:
    """A span, child of the current one, or None where the SDK must decide (see above)."""
    pipeline = _pipeline
    if pipeline is None or not pipeline.usable:
        return None
    if trace.get_tracer_provider() is not pipeline.provider:
        return None
    parent = trace.get_current_span().get_span_context()
    if not parent.is_valid or parent.is_remote or not parent.trace_flags.sampled:
        return None
    context = SpanContext(
        parent.trace_id,
        pipeline.ids.generate_span_id(),
        is_remote=False,
        trace_flags=parent.trace_flags,
        trace_state=parent.trace_state,
    )
    return Span(pipeline, name, context, parent, kind, attributes)


class current:  # noqa: N801 - used as a context manager, like contextlib's
    """``span`` as the current span, ended on the way out; an exception is recorded on it
    as the SDK's ``start_as_current_span`` records it. A class, not a generator: it runs for
    every step, call and effect, and contextlib's machinery costs more than the span."""

    __slots__ = ("span", "token")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.token: Any = None

    def __enter__(self) -> Span:
        self.token = otel_context.attach(trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> None:
        span = self.span
        if isinstance(exc, Exception):
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        otel_context.detach(self.token)
        span.end()
