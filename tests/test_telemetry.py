"""Traces and metrics, as a collector receives them: a real OTLP/HTTP receiver decoding the
protobuf payloads of a real CLI process and a real worker process running a real run,
killed with SIGKILL mid-run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from durability.models import Run, RunStatus
from durability.testing import wait_until
from tests.otlp import OTLPReceiver
from tests.procs import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "sk-test"  # the test agent's LLM client sends it as its API key


@pytest.fixture(scope="module")
def receiver():
    server = OTLPReceiver().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def traced(cluster, receiver):
    telemetry_env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_METRIC_EXPORT_INTERVAL": "300",
    }
    cluster.env.update(telemetry_env)
    cluster.worker(wait=False)
    cluster.start_beat()
    return cluster


def cli(cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", "durability", "--by", "tracer", *args],
        cwd=ROOT,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_one_connected_trace_across_a_worker_kill(traced, receiver, cluster_faults, llm):
    receiver.clear()
    cluster_faults.set({"point": "in_commit", "when": {"seq": 4}, "action": "kill"})
    started = cli(traced, "start", "test-loop", "--input", '{"n": 6, "effects": true}')
    assert started.returncode == 0, started.stderr
    run = Run.objects.get()
    wait_until(lambda: Run.objects.get().status == RunStatus.SUCCEEDED, timeout=60)
    assert cluster_faults.fired() == 1

    def arrived():
        spans = receiver.spans()
        ids = {s.span_id for s in spans}
        executions = [s for s in spans if s.name == "run test-loop"]
        complete = all(s.parent_id in ids for s in executions)
        # Celery's own task span ends after the engine's flush at task_postrun (the
        # instrumentation's handler runs later), so it may come in a later batch.
        celery = any(s.name.startswith("run/durability.execute_run") for s in spans)
        linked = any(s.links for s in executions)
        return spans if executions and linked and complete and celery else None

    spans = wait_until(arrived, timeout=30, what="the resumed execution's span")
    by_id = {s.span_id: s for s in spans}
    root = next(s for s in spans if s.name == "durability start")
    assert root.service == "durability-cli" and root.parent_id == ""

    # Every span of the run is in the trace the command started.
    worker_spans = [s for s in spans if s.service == "durability-worker"]
    run_spans = [s for s in worker_spans if s.trace_id == root.trace_id]
    executions = [s for s in run_spans if s.name == "run test-loop"]
    assert executions, "no execution span in the command's trace"
    for execution in executions:
        assert execution.attributes["durability.run.id"] == str(run.id)

    def ancestors(span):
        chain = []
        while span.parent_id in by_id:
            span = by_id[span.parent_id]
            chain.append(span)
        return chain

    # The resumed execution links to the one that was killed (which never ended, so it was
    # never exported: the link is how the story is followed).
    resumed = next(
        s
        for s in executions
        if any(a.get("durability.link") == "previous_execution" for *_, a in s.links)
    )
    assert any(name == "recovered" for name, _ in resumed.events)
    assert resumed.attributes["durability.outcome"] == "succeeded"

    steps = [s for s in run_spans if s.name == "step iterate"]
    # The killed process's batch of finished spans died with it; the resumed execution's
    # steps are all there, from the checkpoint it resumed at.
    assert {s.attributes["durability.checkpoint.base_seq"] for s in steps} >= {3, 4, 5}
    killed = next(
        span_id
        for _, span_id, a in resumed.links
        if a.get("durability.link") == "previous_execution"
    )
    # The killed execution never ended its span: the execution that recovered the run wrote
    # a stand-in with its identity, so what it had exported hangs under it, in the trace.
    lost = wait_until(
        lambda: by_id.get(killed) or {s.span_id: s for s in receiver.spans()}.get(killed),
        timeout=30,
        what="the lost execution's stand-in",
    )
    by_id[killed] = lost
    assert lost.name == "run test-loop" and lost.parent_id == root.span_id
    assert lost.attributes["durability.execution.lost"] is True
    assert (
        lost.attributes["durability.run.attempt"]
        == resumed.attributes["durability.run.attempt"] - 1
    )
    assert lost.status == 2  # ERROR
    assert lost.start_ns <= lost.end_ns <= resumed.start_ns
    for step in steps:
        assert any(a.name == "run test-loop" for a in ancestors(step))
        assert root in ancestors(step)

    calls = [s for s in run_spans if s.name == "call llm"]
    # A call that ended before the kill may have been exported while its step span, which
    # never ended, was not: every call whose parent arrived hangs under a step.
    parented = [c for c in calls if c.parent_id in by_id]
    assert len(parented) >= 2  # at least iterations 4 and 5, run after the recovery
    for call in parented:
        assert by_id[call.parent_id].name == "step iterate"
    for call in calls:
        assert call.attributes["gen_ai.request.model"] == "fake-model"
        assert call.attributes["gen_ai.usage.input_tokens"] == 2
        assert call.attributes["gen_ai.usage.output_tokens"] >= 4

    effects = [s for s in run_spans if s.name == "effect notify"]
    assert effects
    assert {s.attributes["durability.effect.outcome"] for s in effects} == {"done"}
    # Iteration 3's effect was done before the kill: its re-run did not repeat it.
    replayed = [e for s in steps for e in s.events if e[0] == "effect.not_repeated"]
    assert len(replayed) == 1

    # A checkpoint commit is an event of its step's span.
    commits = [a for s in steps for name, a in s.events if name == "checkpoint.commit"]
    assert {a["durability.checkpoint.seq"] for a in commits} >= {4, 5, 6}
    assert all(a["durability.checkpoint.kind"] in ("delta", "snapshot") for a in commits)
    assert all(a["durability.checkpoint.bytes"] > 0 for a in commits)
    assert all(a["durability.checkpoint.latency_ms"] > 0 for a in commits)
    assert not any(s.name == "checkpoint commit" for s in spans)

    # Infrastructure spans come from the maintained instrumentations.
    assert any(s.name.startswith("run/durability.execute_run") for s in worker_spans)
    assert any(
        s.attributes.get("db.system") == "postgresql"
        or s.attributes.get("db.system.name") == "postgresql"
        for s in spans
    )

    # Sizes and hashes only: no state contents, no secrets, on any span.
    for span in spans:
        text = repr(span.attributes) + repr(span.events)
        assert "answer to iteration" not in text, span.name
        assert SECRET not in text, span.name

    def metrics_arrived():
        names = receiver.metric_names()
        wanted = {
            "durability.checkpoint.commits",
            "durability.checkpoint.commit.duration",
            "durability.recoveries",
            "durability.recovery.duration",
        }
        return wanted <= names

    wait_until(metrics_arrived, timeout=30, what="the durability metrics")
    # A commit per step: offering each latency as an exemplar is off by default.
    latencies = receiver.metrics("durability.checkpoint.commit.duration")
    points = [p for m in latencies for p in m.histogram.data_points]
    assert points and sum(p.count for p in points) > 0
    assert not any(p.exemplars for p in points)


PROBE = (
    "import os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'tests.settings');"
    "from config import telemetry; print(telemetry.setup('cli'));"
    "from durability import telemetry as t; print(t.enabled(), t.metrics_enabled())"
)


def probe(**otel: str) -> subprocess.CompletedProcess:
    """A process that sets telemetry up from ``otel`` alone (no other OTEL_ variable)."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env={**env, **otel},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_without_an_endpoint_nothing_is_installed():
    done = probe()
    assert done.stdout.split() == ["False", "False", "False"], done.stderr


# Nothing listens on port 9: nothing is exported during these probes, and nothing must be.
@pytest.mark.parametrize(
    ("otel", "traces", "metrics"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, True, True),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_TRACES_EXPORTER": "none"},
            False,
            True,
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_METRICS_EXPORTER": "none"},
            True,
            False,
        ),
        # A signal without an endpoint of its own, nor a general one, stays off.
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces"}, True, False),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "60000"}, True, False),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            },
            True,
            True,
        ),
    ],
)
def test_each_signal_goes_where_the_standard_variables_say(otel, traces, metrics):
    done = probe(**otel)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == [str(traces), str(metrics)], done.stderr


@pytest.mark.parametrize(
    ("otel", "message"),
    [
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_TRACES_EXPORTER": "zipkin"},
            "OTEL_TRACES_EXPORTER='zipkin': 'zipkin' is not supported here; use otlp, console,"
            " none",
        ),
        (
            {"OTEL_METRICS_EXPORTER": "prometheus"},
            "'prometheus' is not supported here (the web process serves the durability metrics"
            " at /metrics for scrapers)",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
            },
            "OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not supported here (the Python SDK has"
            " no OTLP/JSON exporter)",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "thrift",
            },
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL='thrift' is not supported here; use http/protobuf",
        ),
    ],
)
def test_a_variable_it_cannot_honour_is_a_clear_error(otel, message):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "manage.py", "durability", "agents"],
        cwd=ROOT,
        env={**env, **otel},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert message in done.stderr


HUNG_COLLECTOR_PROBE = """
import os, time
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
from config import telemetry
telemetry.setup("worker")
from durability import telemetry as t
took = []
for name in ("first", "second"):
    with t.tracer().start_as_current_span(name):
        pass
    started = time.monotonic()
    took.append((telemetry.flush(timeout_ms=1000), time.monotonic() - started))
started = time.monotonic()
telemetry.shutdown(timeout_s=1.0)
took.append((None, time.monotonic() - started))
print(repr(took))
"""


def test_a_collector_that_hangs_holds_a_task_back_once_and_briefly():
    """The worker flushes after every task (so a SIGKILL loses nothing already traced); a
    collector that accepts connections and never answers must not add the exporter's whole
    retry schedule (10 s and more) to each of them."""
    import ast
    import os
    import socket

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)  # connections complete in the kernel; nothing ever reads or answers
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{hung.getsockname()[1]}"
        done = subprocess.run(
            [sys.executable, "-c", HUNG_COLLECTOR_PROBE],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        hung.close()
    assert done.returncode == 0, done.stderr
    (first_ok, first), (second_ok, second), (_, shutdown) = ast.literal_eval(done.stdout)
    assert not first_ok and first < 5.0  # waited its own limit (1 s), not the exporter's
    assert not second_ok and second < 0.5  # then stops waiting for a while
    assert shutdown < 5.0
    assert "not waiting for it again" in done.stderr
