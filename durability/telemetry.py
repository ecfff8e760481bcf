"""Traces and metrics of runs, steps, calls, effects and checkpoint commits.

The engine speaks the OpenTelemetry *API*; whoever runs it installs an SDK (see
``config/telemetry.py``: only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or a sibling is set).
Without one, every helper here returns at its first line, so tracing off costs a function
call per step. Every span is the SDK's, from its tracer; a checkpoint commit is an event
of its step's span (``durability.spans``).

One run is one trace, whatever process executes it: the context of the request or command
that started the run is stored on the run (``Run.trace_parent``), every execution span is
parented there, and an execution that resumes after another one links to it
(``Run.trace_exec``), so a recovery after a SIGKILL can be followed to the attempt that died.
State contents never go on spans: sizes, hashes, keys and names only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import lru_cache
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_NULL = nullcontext()


def enabled() -> bool:
    """True once an SDK tracer provider is installed in this process."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


@lru_cache(maxsize=1)
def _sdk_meter_provider() -> type:
    from opentelemetry.sdk.metrics import MeterProvider

    return MeterProvider


def metrics_enabled() -> bool:
    """True once an SDK meter provider is installed in this process (traces may be off)."""
    return isinstance(metrics.get_meter_provider(), _sdk_meter_provider())


_tracer: tuple[Any, trace.Tracer] | None = None


def tracer() -> trace.Tracer:
    # get_tracer builds a new tracer (and checks its arguments) on every call: once per
    # provider is enough. Keyed by the provider itself, not its id(), which a provider
    # collected and replaced (in tests) could share.
    global _tracer
    provider = trace.get_tracer_provider()
    if _tracer is None or _tracer[0] is not provider:
        _tracer = (provider, provider.get_tracer("durability"))
    return _tracer[1]


def current_traceparent() -> str:
    """The W3C traceparent of the active span, or "" when nothing is being traced."""
    span = trace.get_current_span()
    if not span.get_span_context().is_valid:
        return ""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent", "")


@contextmanager
def run_root(name: str, **attributes: Any) -> Iterator[None]:
    """A span to start a run under when none is active (a script, the demo seeder, a fork
    made outside a request): the run keeps it as the parent of all its executions, so a run
    started anywhere is one trace, whichever worker or sweep later delivers it."""
    if not enabled() or trace.get_current_span().get_span_context().is_valid:
        yield
        return
    with tracer().start_as_current_span(name, attributes=attributes):
        yield


def _context_of(traceparent: str) -> otel_context.Context | None:
    if not traceparent:
        return None
    return _propagator.extract({"traceparent": traceparent})


def _span_context_of(traceparent: str) -> trace.SpanContext | None:
    ctx = _context_of(traceparent)
    if ctx is None:
        return None
    span_context = trace.get_current_span(ctx).get_span_context()
    return span_context if span_context.is_valid else None


# --- spans ---------------------------------------------------------------------------------------


@contextmanager
def execution(run: Any, worker: str, previous_exec: str) -> Iterator[Any]:
    """The span of one execution of a run on a worker: a child of the span that started the
    run (or of the delivering task, when it is in that same trace), linked to the previous
    execution of the run."""
    if not enabled():
        yield None
        return
    current = trace.get_current_span().get_span_context()
    started = _span_context_of(run.trace_parent)
    links = []
    parent = None
    if started is not None and (not current.is_valid or current.trace_id != started.trace_id):
        parent = _context_of(run.trace_parent)
        if current.is_valid:
            links.append(Link(current, {"durability.link": "delivery"}))
    previous = _span_context_of(previous_exec)
    if previous is not None:
        links.append(Link(previous, {"durability.link": "previous_execution"}))
    with tracer().start_as_current_span(
        f"run {run.agent}",
        context=parent,
        kind=SpanKind.CONSUMER,
        links=links,
        attributes={
            "durability.run.id": str(run.id),
            "durability.agent.name": run.agent,
            "durability.agent.version": run.agent_version,
            "durability.run.attempt": run.attempts,
            "durability.worker": worker,
            "durability.checkpoint.seq": run.head_seq,
        },
    ) as span:
        waiting, context = _spans().waiting_steps()
        token = otel_context.attach(context)
        try:
            yield span
        finally:
            otel_context.detach(token)
            _spans().end_waiting(waiting)


def lost_execution(
    run: Any,
    previous_exec: str,
    *,
    worker: str,
    attempt: int,
    started_ns: int,
    ended_ns: int,
) -> bool:
    """Stand in for the span of an execution whose process died (SIGKILL, OOM) before it
    could end and export it: a span from when that execution started to its last sign of
    life, marked as an error, with the same trace and span id where the tracer provider is
    the one ``durability.spans.tracer_provider`` makes, so the steps, calls and commits it
    had already exported hang under it again and the trace stays connected. Written by the
    execution that recovered the run, which knows the dead one's lease is gone with its
    process. False, and nothing written, when tracing is off or that execution was not
    sampled."""
    lost = _span_context_of(previous_exec)
    if lost is None or not enabled() or not lost.trace_flags.sampled:
        return False
    root = _span_context_of(run.trace_parent)
    parent = None
    if root is not None and root.trace_id == lost.trace_id:
        parent = _context_of(run.trace_parent)
    spans = _spans()
    with spans.ids_of(lost):
        span = tracer().start_span(
            f"run {run.agent}",
            context=parent or otel_context.Context(),
            kind=SpanKind.CONSUMER,
            attributes={
                "durability.run.id": str(run.id),
                "durability.agent.name": run.agent,
                "durability.agent.version": run.agent_version,
                "durability.run.attempt": attempt,
                "durability.worker": worker,
                "durability.execution.lost": True,
            },
            start_time=started_ns,
        )
    if not span.is_recording():
        return False
    if span.get_span_context().span_id != lost.span_id:
        # A provider whose ids are not ``StandInIds``: the stand-in points at the lost span.
        span.add_link(lost, {"durability.link": "lost_execution"})
    span.set_status(Status(StatusCode.ERROR, "the worker died before this execution ended"))
    span.end(end_time=max(started_ns, ended_ns))
    return True


@lru_cache(maxsize=1)
def _spans() -> Any:
    # Imported on first use: it imports the SDK, which a process tracing nothing never needs.
    from durability import spans

    return spans


def _current(name: str, kind: SpanKind, attributes: dict[str, Any], step: bool = False):
    """The SDK's span as the current one for a ``with`` block (``durability.spans.Current``)."""
    span = tracer().start_span(name, kind=kind, attributes=attributes)
    return _spans().Current(span, step)


def step(name: str, seq: int, attempt: int):
    """A step's span. Its attempt is only written from the second on: each attribute costs a
    few microseconds to record and to encode, on every step."""
    if not enabled():
        return _NULL
    attributes: dict[str, Any] = {
        "durability.step.name": name,
        "durability.checkpoint.base_seq": seq,
    }
    if attempt > 1:
        attributes["durability.step.attempt"] = attempt
    return _current(f"step {name}", SpanKind.INTERNAL, attributes, step=True)


def call(key: str, function: str, kind: str):
    if not enabled():
        return _NULL
    return _current(
        f"call {key}",
        SpanKind.CLIENT,
        {
            "durability.call.key": key,
            "durability.call.function": function,
            "durability.call.kind": kind,
        },
    )


def describe_result(span: Any, value: Any) -> None:
    """GenAI semantic-convention attributes when a call's result looks like a completion."""
    if span is None or not isinstance(value, dict):
        return
    usage = value.get("usage")
    model = value.get("model")
    if not isinstance(usage, dict) and not model:
        return
    span.set_attribute("gen_ai.operation.name", "chat")
    span.set_attribute("gen_ai.system", str(value.get("system") or "openai"))
    if model:
        span.set_attribute("gen_ai.request.model", str(model))
        span.set_attribute("gen_ai.response.model", str(model))
    if isinstance(usage, dict):
        tokens_in = usage.get("prompt_tokens", usage.get("input_tokens"))
        tokens_out = usage.get("completion_tokens", usage.get("output_tokens"))
        if isinstance(tokens_in, int):
            span.set_attribute("gen_ai.usage.input_tokens", tokens_in)
        if isinstance(tokens_out, int):
            span.set_attribute("gen_ai.usage.output_tokens", tokens_out)


def effect(key: str, idempotency_key: str, function: str):
    if not enabled():
        return _NULL
    return _current(
        f"effect {key}",
        SpanKind.CLIENT,
        {
            "durability.effect.key": key,
            "durability.effect.idempotency_key": idempotency_key,
            "durability.effect.function": function,
        },
    )


def commit(run_id: Any, seq: int, size: int, delta: int, snapshot: bool):
    """A checkpoint commit made while the worker waits: an event of its step's span when the
    block ends (``durability.spans.Commit``)."""
    if not enabled():
        return _NULL
    return _spans().Commit(_commit_attributes(seq, size, delta, snapshot))


def _commit_attributes(seq: int, size: int, delta: int, snapshot: bool) -> dict:
    return {
        "durability.checkpoint.seq": seq,
        "durability.checkpoint.kind": "snapshot" if snapshot else "delta",
        "durability.checkpoint.bytes": size,
        "durability.checkpoint.delta_bytes": delta,
    }


def start_commit(run_id: Any, seq: int, size: int, delta: int, snapshot: bool) -> Any:
    """A commit sent ahead: its event is added to its step's span when the worker takes the
    answer (``end_commit``), and that span waits for it."""
    if not enabled():
        return None
    return _spans().Commit(_commit_attributes(seq, size, delta, snapshot))


def end_commit(commit: Any, error: BaseException | None = None) -> None:
    if commit is not None:
        commit.end(error)


def note_recovered(commit: Any) -> None:
    """On a commit's event: its first attempt failed, and recovery found or made it."""
    if commit is not None:
        commit.attributes["durability.checkpoint.recovered"] = True


def approval_wait(name: str, requested_at: Any, decided_at: Any, approved: bool) -> None:
    """A span covering the time a run waited for a person, drawn when the run resumes."""
    if requested_at is None or decided_at is None:
        return
    start_ns = int(requested_at.timestamp() * 1e9)
    end_ns = int(decided_at.timestamp() * 1e9)
    if enabled():
        span = tracer().start_span(
            f"approval {name}",
            start_time=start_ns,
            attributes={"durability.approval.name": name, "durability.approval.approved": approved},
        )
        span.end(end_time=max(end_ns, start_ns))
    if metrics_enabled():
        instruments().approval_wait.record(max(0.0, (end_ns - start_ns) / 1e9))


def note(name: str, **attributes: Any) -> None:
    """An event on the active span (lease lost, recovered, suspended...)."""
    if not enabled():
        return
    clean = {k: v for k, v in attributes.items() if v is not None}
    trace.get_current_span().add_event(name, clean)


def set_attributes(span: Any, **attributes: Any) -> None:
    if span is None:
        return
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(key, value)


def failed(span: Any, error: BaseException | str) -> None:
    if span is None:
        return
    span.set_status(Status(StatusCode.ERROR, str(error)[:500]))


# --- metrics -------------------------------------------------------------------------------------


class Instruments:
    def __init__(self) -> None:
        meter = metrics.get_meter("durability")
        self.commit_duration = meter.create_histogram(
            "durability.checkpoint.commit.duration",
            unit="s",
            description="Latency of checkpoint commits, fencing check and flush included",
        )
        self.commits = meter.create_counter(
            "durability.checkpoint.commits", description="Checkpoints committed"
        )
        self.commit_failures = meter.create_counter(
            "durability.checkpoint.commit.failures",
            description="Checkpoint commits that failed (the database did not answer)",
        )
        self.recoveries = meter.create_counter(
            "durability.recoveries", description="Runs taken over from a worker that died"
        )
        self.recovery_duration = meter.create_histogram(
            "durability.recovery.duration",
            unit="s",
            description="From the failure (the process found gone, or the last sign of life"
            " of a stalled one) to the run's next claim",
        )
        self.work_lost = meter.create_histogram(
            "durability.recovery.work_lost",
            unit="s",
            description="From the last checkpoint to the failure (the recovery point)",
        )
        # Counted where it happens (a worker finding an effect's outcome unknown); how many
        # are in doubt now is /metrics' durability_effects_in_doubt, read from the database:
        # an up-down counter here went up in the worker and never down (an operator resolves
        # an effect in another process), and lost its value with the process.
        self.in_doubt = meter.create_counter(
            "durability.effects.in_doubt.found",
            description="Effects found in doubt (their outcome unknown after a worker died)",
        )
        self.duplicates_prevented = meter.create_counter(
            "durability.effects.duplicates_prevented",
            description="Effects a re-run found done and did not repeat",
        )
        self.approval_wait = meter.create_histogram(
            "durability.approval.wait", unit="s", description="Time runs waited for a decision"
        )
        self.runs_finished = meter.create_counter(
            "durability.runs.finished", description="Runs that ended, by final status"
        )


@lru_cache(maxsize=1)
def _instruments() -> Instruments:
    return Instruments()


def instruments() -> Instruments:
    return _instruments()


def record_commit(agent: str, seconds: float) -> None:
    if metrics_enabled():
        instruments().commit_duration.record(seconds, {"durability.agent.name": agent})


def commits_made(agent: str, count: int) -> None:
    """Counted once per execution, not per commit: each ``add`` costs as much as the
    latency's ``record``, and the count is exported after the execution anyway."""
    if count and metrics_enabled():
        instruments().commits.add(count, {"durability.agent.name": agent})


def count(name: str, value: float = 1, **attributes: Any) -> None:
    if not metrics_enabled():
        return
    getattr(instruments(), name).add(value, attributes)


def observe(name: str, value: float, **attributes: Any) -> None:
    if not metrics_enabled():
        return
    getattr(instruments(), name).record(value, attributes)


def monotonic_ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000
