from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from tests.procs import ROOT, Beat, CeleryWorker, housekeeping_queue
from tests.servers import EffectReceiver, FakeLLM

pytest_plugins: list[str] = []


@pytest.fixture(scope="session", autouse=True)
def flush_retries_deadlocks():
    """A transactional test ends with Django's flush (one TRUNCATE of every table) while a
    module's live workers may be sweeping or claiming: PostgreSQL can find the two
    deadlocked and cancel the flush, which then fails the next test with the rows it left.
    The flush is all-or-nothing (one transaction), so trying it again is safe."""
    from django.core.management.base import CommandError
    from django.core.management.commands import flush
    from django.db import OperationalError

    original = flush.Command.handle

    def handle(self, **options):
        for attempt in range(5):
            try:
                return original(self, **options)
            except CommandError as exc:
                cause = exc.__cause__
                deadlock = isinstance(cause, OperationalError) and "deadlock" in str(cause)
                if not deadlock or attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))

    flush.Command.handle = handle
    yield
    flush.Command.handle = original


@pytest.fixture(scope="session", autouse=True)
def flush_by_delete():
    """Each transactional test ends with Django's flush, which on PostgreSQL is one TRUNCATE
    of every table: a new file for each of the 30-odd tables, about 0.25 s a test on this
    kind of machine, several minutes over the suite. A test leaves a handful of rows behind,
    and deleting them costs milliseconds. The tables are locked first, as TRUNCATE locks
    them, so the flush still waits for a worker's open transaction and no row it commits
    later survives; every foreign key is deferred to the commit (Django makes them
    deferrable), so the order of the deletes does not matter. Sequences are reset, when a
    test asks for it, by Django's own flush."""
    from django.core.management.commands import flush

    original = flush.sql_flush

    def sql_flush(style, connection, reset_sequences=True, allow_cascade=False):
        if connection.vendor != "postgresql" or reset_sequences:
            return original(style, connection, reset_sequences, allow_cascade)
        tables = connection.introspection.django_table_names(
            only_existing=True, include_views=False
        )
        if not tables:
            return []
        names = [connection.ops.quote_name(table) for table in tables]
        return [
            "SET CONSTRAINTS ALL DEFERRED",
            f"LOCK TABLE {', '.join(names)} IN ACCESS EXCLUSIVE MODE",
            *(f"DELETE FROM {name}" for name in names),
        ]

    flush.sql_flush = sql_flush
    yield
    flush.sql_flush = original


@pytest.fixture(scope="session", autouse=True)
def static_root():
    # WhiteNoise warns (an error here) on any request when the static root is missing, and a
    # fresh checkout has none until collectstatic runs: any module must pass on its own.
    Path(settings.STATIC_ROOT).mkdir(parents=True, exist_ok=True)


@pytest.fixture(scope="session", autouse=True)
def commit_channels(django_db_setup):
    # Commits sent ahead go over a connection per thread that Django does not know of: it
    # must be gone before the test database is dropped.
    yield
    from durability.runtime import inflight

    inflight.close_all()


@pytest.fixture(autouse=True)
def langgraph_savers_closed(request):
    # A LangGraph saver the garbage collector frees is closed on a thread of its own
    # (durability.langgraph.lifetime): the LangGraph tests' savers are closed before the
    # next test, and the flush of the database, begin.
    yield
    if request.module.__name__.startswith("tests.test_langgraph"):
        from durability.langgraph import lifetime

        gc.collect()
        assert lifetime.wait_collected(), "a collected LangGraph saver was not closed in 30 s"


@pytest.fixture(scope="session")
def llm_server():
    server = FakeLLM().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def effect_server():
    server = EffectReceiver().start()
    yield server
    server.stop()


@pytest.fixture
def llm(llm_server):
    llm_server.reset()
    return llm_server


@pytest.fixture
def effects(effect_server):
    effect_server.reset()
    return effect_server


class Faults:
    """Named fault points for worker processes (and this one), set per test."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / "faults.json"
        self.markers = folder / "markers"
        self.clear()

    def set(self, *specs: dict) -> None:
        shutil.rmtree(self.markers, ignore_errors=True)
        self.markers.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(list(specs)))
        tmp.replace(self.path)

    def fired(self) -> int:
        return len(list(self.markers.glob("fault-*"))) if self.markers.exists() else 0

    def records(self) -> list[dict]:
        """What each fault that fired saw: its point's context, including whether a commit
        sent ahead was in flight (``in_flight``)."""
        if not self.markers.exists():
            return []
        return [json.loads(p.read_text()) for p in sorted(self.markers.glob("fault-*"))]

    def clear(self) -> None:
        self.set()

    @property
    def env(self) -> dict[str, str]:
        return {"DURABILITY_FAULTS": f"@{self.path}", "DURABILITY_FAULT_DIR": str(self.markers)}


@pytest.fixture(params=["engine", "sdk"])
def memory_spans(request):
    """This process traced into memory for one test, under a tracer provider made the way
    ``config.telemetry`` makes it (``engine``: ``durability.spans.tracer_provider``) or a
    plain one set up elsewhere (``sdk``). The global provider is set once per process
    otherwise: OpenTelemetry's test utilities reset it."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.test.globals_test import reset_trace_globals

    from durability import spans

    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    if request.param == "engine":
        provider = spans.tracer_provider([processor])
    else:
        provider = TracerProvider()
        provider.add_span_processor(processor)
    reset_trace_globals()
    trace.set_tracer_provider(provider)
    yield exporter
    provider.shutdown()
    reset_trace_globals()


@pytest.fixture
def faults(tmp_path, monkeypatch):
    """Faults for in-process executions."""
    f = Faults(tmp_path / "faults")
    for key, value in f.env.items():
        monkeypatch.setenv(key, value)
    yield f
    f.clear()


def test_database_url() -> str:
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    return (
        f"postgres://{db['USER'] or 'postgres'}@{db['HOST'] or '127.0.0.1'}:"
        f"{db['PORT'] or 5432}/{db['NAME']}"
    )


def python_on_test_database(
    code: str, *args: str, timeout: float = 90, **env: str
) -> subprocess.CompletedProcess:
    """``python -c code args`` in a process of its own, on the test settings and this test's
    database, with ``env`` added to its environment; what it printed."""
    full_env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": test_database_url(),
        "PYTHONPATH": str(ROOT),
        **env,
    }
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Cluster:
    """Celery workers and a beat for one test module, on a queue of their own, pointed at
    the test database; plus the faults file they read. Beat comes with the housekeeping
    worker that executes its sweeps, as in the Procfile."""

    def __init__(
        self,
        name: str,
        folder: Path,
        llm_url: str,
        effect_url: str,
        *,
        database_url: str | None = None,
        broker_url: str | None = None,
    ) -> None:
        self.name = name
        self.folder = folder
        self.queue = f"t-{name}-{uuid.uuid4().hex[:6]}"
        self.faults = Faults(folder / "faults")
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DATABASE_URL": database_url or test_database_url(),
            "CELERY_BROKER_URL": broker_url or os.environ.get("CELERY_BROKER_URL", ""),
            "CELERY_QUEUE": self.queue,
            "TEST_LLM_URL": llm_url,
            "TEST_EFFECT_URL": effect_url,
            "PYTHONUNBUFFERED": "1",
            **self.faults.env,
        }
        self.workers: list[CeleryWorker] = []
        self.beat: Beat | None = None
        self.housekeeping: CeleryWorker | None = None

    def worker(self, concurrency: int = 1, *, wait: bool = True, **extra_env: str) -> CeleryWorker:
        """A run worker; ``wait=False``: started, not waited for (``start_beat`` waits for
        every worker, so that a module's processes boot side by side)."""
        name = f"{self.name}-w{len(self.workers) + 1}"
        worker = CeleryWorker(name, {**self.env, **extra_env}, concurrency=concurrency)
        self.workers.append(worker)
        return worker.start(wait=wait)

    def migrate(self) -> None:
        """Migrate the cluster's own database (a throwaway server's, not the test database
        pytest-django sets up)."""
        done = subprocess.run(
            [sys.executable, "manage.py", "migrate", "-v0"],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr

    def start_beat(self) -> Beat:
        if self.housekeeping is None:
            self.housekeeping = CeleryWorker(
                f"{self.name}-housekeeping", self.env, queues=[housekeeping_queue(self.env)]
            )
        if not self.housekeeping.alive():
            self.housekeeping.start(wait=False)
        self.beat = Beat(f"{self.name}-beat", self.env, self.folder).start(wait=False)
        # Booted side by side (each is seconds of imports), then each waited for.
        for proc in [*self.workers, self.housekeeping]:
            if proc.booting:
                proc.ready()
        return self.beat.ready()

    def stop(self) -> None:
        """SIGKILL every process: the module is done with them, nothing a warm shutdown
        would do is looked at, and one costs the engine's grace period plus the exporters'
        flush (about 3 s a module). The tests of shutdown itself stop their own workers."""
        for proc in [*self.workers, self.beat, self.housekeeping]:
            if proc is not None:
                proc.kill()
                proc.stop()


@pytest.fixture(scope="module")
def cluster(
    request, django_db_setup, django_db_blocker, llm_server, effect_server, tmp_path_factory
):
    """Workers and beat for the module; the test process publishes to their queue."""
    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    with django_db_blocker.unblock():
        c = Cluster(name, tmp_path_factory.mktemp(name), llm_server.url, effect_server.url)
    previous = settings.CELERY_TASK_DEFAULT_QUEUE
    settings.CELERY_TASK_DEFAULT_QUEUE = c.queue
    try:
        yield c
    finally:
        settings.CELERY_TASK_DEFAULT_QUEUE = previous
        c.stop()


@pytest.fixture
def cluster_faults(cluster):
    cluster.faults.clear()
    yield cluster.faults
    cluster.faults.clear()


# --- the browser tests' Chromium -------------------------------------------------------------

CHROMIUM = os.environ.get("DURABILITY_CHROMIUM", "/usr/bin/chromium")


@pytest.fixture(scope="session")
def browser():
    if not Path(CHROMIUM).exists():
        # CI installs Chromium: there a missing browser is a failure, never a quiet skip.
        if os.environ.get("DURABILITY_REQUIRE_BROWSER") == "1":
            pytest.fail(f"no Chromium at {CHROMIUM}, and DURABILITY_REQUIRE_BROWSER=1")
        pytest.skip(f"no Chromium at {CHROMIUM}")
    # Playwright's sync API keeps an event loop running in this thread, which Django takes
    # for an async context and refuses database calls in. The tests use the ORM
    # synchronously, between Playwright calls, never from the loop.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        yield from _chromium()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


def _chromium():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        yield chromium
        chromium.close()
