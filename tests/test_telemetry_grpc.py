"""OTLP over gRPC (``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``, a collector's port 4317): a real gRPC
receiver gets the spans and metrics of a real CLI process and a real worker process running a
real run, as one trace."""

from __future__ import annotations

import subprocess
import sys

import pytest

from durability.models import Run, RunStatus
from durability.testing import wait_until
from tests.otlp import OTLPGrpcReceiver
from tests.procs import ROOT

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def receiver():
    server = OTLPGrpcReceiver().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def traced(cluster, receiver):
    cluster.env.update(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_METRIC_EXPORT_INTERVAL": "300",
        }
    )
    cluster.worker()
    return cluster


def test_a_run_is_one_trace_over_grpc(traced, receiver, llm):
    started = subprocess.run(
        [sys.executable, "manage.py", "durability", "start", "test-loop", "--input", '{"n": 3}'],
        cwd=ROOT,
        env=traced.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode == 0, started.stderr
    run = Run.objects.get()
    wait_until(lambda: Run.objects.get().status == RunStatus.SUCCEEDED, timeout=60)

    def arrived():
        spans = receiver.spans()
        names = {s.name for s in spans}
        wanted = {"durability start", "run test-loop", "step iterate"}
        return spans if wanted <= names else None

    spans = wait_until(arrived, timeout=30, what="the run's spans over gRPC")
    by_id = {s.span_id: s for s in spans}
    root = next(s for s in spans if s.name == "durability start")
    assert root.service == "durability-cli" and root.parent_id == ""
    execution = next(s for s in spans if s.name == "run test-loop")
    assert execution.service == "durability-worker"
    assert execution.trace_id == root.trace_id
    assert execution.attributes["durability.run.id"] == str(run.id)
    steps = [s for s in spans if s.name == "step iterate"]
    assert len(steps) == 3
    for step in steps:
        assert step.trace_id == root.trace_id
        assert by_id[step.parent_id].name == "run test-loop"
    # Each step's checkpoint commit is an event of its span.
    commits = [a for s in steps for name, a in s.events if name == "checkpoint.commit"]
    assert sorted(a["durability.checkpoint.seq"] for a in commits) == [1, 2, 3]

    def metrics_arrived():
        points = [
            p for m in receiver.metrics("durability.checkpoint.commits") for p in m.sum.data_points
        ]
        return points if sum(p.as_int for p in points) >= 3 else None

    wait_until(metrics_arrived, timeout=30, what="the commit counter over gRPC")
