"""A secret read with ``ctx.secret`` is written nowhere: one run of a real Celery worker takes
every write path with a canary secret in it (state, a blob, call arguments and result,
effect arguments, result and error, a transient error, a message, a log record, an approval
payload, the final error, spans), then every table, every file under the var dir, the worker's
logs and the spans a real OTLP/HTTP receiver got are read byte for byte. Argument hashes are
keyed: none is a plain SHA-256 of arguments, and rows hashed before the upgrade or under a
rotated key still replay."""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from django.conf import settings
from django.db import connection

from durability import END, Agent, operations, registry
from durability.errors import NonDeterminismError
from durability.models import (
    Approval,
    Effect,
    Event,
    EventKind,
    JournalEntry,
    Message,
    Run,
    RunStatus,
)
from durability.runtime.context import ArgsHash, args_hash
from durability.testing import drive, wait_until
from tests.otlp import OTLPReceiver
from tests.procs import ROOT

pytestmark = [pytest.mark.smoke, pytest.mark.django_db(transaction=True)]

# Random per session: a hit can only come from this run, never from an earlier one's logs.
CANARY = "canary" + secrets.token_hex(24)
MARK = "[redacted]"


class RawReceiver(OTLPReceiver):
    """The receiver, also keeping each trace payload's bytes as they arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[bytes] = []

    def _traces(self, body: bytes) -> None:
        self.bodies.append(body)
        super()._traces(body)


@pytest.fixture(scope="module")
def receiver():
    server = RawReceiver().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def worker(cluster, receiver, tmp_path_factory):
    folder = tmp_path_factory.mktemp("secrets-files")
    cluster.env.update(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_METRIC_EXPORT_INTERVAL": "300",
            "TEST_CANARY": CANARY,
            "LOG_LEVEL": "INFO",  # the engine's own "run failed: ..." record too
            "DURABILITY_BLOB_BYTES": "1024",
            "DURABILITY_BLOB_DIR": str(folder / "blobs"),
            "DURABILITY_LOCK_DIR": str(folder / "locks"),
        }
    )
    proc = cluster.worker(wait=False)
    cluster.start_beat()
    yield proc, folder
    # While the span receiver still answers: stopped after it, the processes retry their
    # last export against a closed port until the SDK's timeouts end it (about 25 s).
    cluster.stop()


def legacy_hash(args: tuple, kwargs: dict) -> str:
    """What argument hashes were before they were keyed: SHA-256 of the arguments."""
    data = orjson.dumps([list(args), kwargs], option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    return hashlib.sha256(data).hexdigest()


def hits(data: bytes) -> int:
    # A bytea column reads as hex when a row is cast to text.
    return data.count(CANARY.encode()) + data.count(CANARY.encode().hex().encode())


def database_hits() -> dict[str, int]:
    found: dict[str, int] = {}
    with connection.cursor() as cur:
        if connection.vendor == "postgresql":
            cur.execute(
                "SELECT table_name FROM information_schema.tables"
                " WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'"
            )
            tables = [t for (t,) in cur.fetchall()]
            for table in tables:
                cur.execute(f'SELECT t::text FROM "{table}" t')  # noqa: S608 - catalog names
                found[table] = sum(hits(row.encode()) for (row,) in cur.fetchall())
        else:
            cur.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            tables = [t for (t,) in cur.fetchall()]
            for table in tables:
                cur.execute(f'SELECT * FROM "{table}"')  # noqa: S608 - catalog names
                found[table] = sum(
                    hits(v if isinstance(v, bytes) else str(v).encode())
                    for row in cur.fetchall()
                    for v in row
                )
            # The file itself, free pages and the write-ahead log included.
            name = connection.settings_dict["NAME"]
            for path in (name, f"{name}-wal"):
                if os.path.exists(path):
                    found[path] = hits(Path(path).read_bytes())
    assert len(tables) > 10, tables
    return {k: v for k, v in found.items() if v}


def file_hits(*roots: Path) -> dict[str, int]:
    found = {}
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in names:
                path = Path(folder) / name
                try:
                    n = hits(path.read_bytes())
                except (FileNotFoundError, PermissionError):
                    continue
                if n:
                    found[str(path)] = n
    return found


def test_a_secret_read_with_ctx_secret_is_written_nowhere(worker, cluster, receiver):
    proc, folder = worker
    run = operations.start("test-secrets", {})

    def retrying():
        r = Run.objects.get(pk=run.id)
        assert r.status != RunStatus.FAILED, r.error
        return r.wait_detail if r.wait_reason == "retry" else None

    # The transient error, as the run shows it while it waits for its retry.
    detail = wait_until(retrying, timeout=60, interval=0.02, what="the retry")
    assert detail == f"Transient: upstream rate limit for key {MARK}"

    def asking():
        r = Run.objects.get(pk=run.id)
        assert r.status != RunStatus.FAILED, r.error
        return r.wait_reason == "approval"

    wait_until(asking, timeout=90, what="the approval")
    operations.decide(run.id, "go", approve=True, by="tester")
    done = wait_until(
        lambda: (r := Run.objects.get(pk=run.id)).status == RunStatus.FAILED and r,
        timeout=90,
        what="the final failure",
    )

    # Every write path was taken, and the secret was replaced where it went.
    assert done.error == f"RuntimeError: the final call failed with {MARK}"
    refused = Effect.objects.get(run=run, key="refused")
    assert refused.error == f"RuntimeError: the remote refused the key {MARK}"
    assert MARK in Effect.objects.get(run=run, key="send").result
    assert MARK in JournalEntry.objects.get(run=run, key="echo").result
    retry = Event.objects.get(run=run, kind=EventKind.RETRY_SCHEDULED)
    assert f"upstream rate limit for key {MARK}" in retry.data
    assert Event.objects.filter(run=run, kind=EventKind.FAILED, reason__contains=MARK).exists()
    assert MARK in Approval.objects.get(run=run, name="go").payload
    assert MARK in Message.objects.get(run=run, name="note").data
    blobs = list((folder / "blobs").rglob("*"))
    assert len([b for b in blobs if b.is_file()]) >= 2, blobs
    assert f"step leak holds {MARK}" in proc.text()

    # Keyed argument hashes: this deploy's key, never the SHA-256 of the arguments.
    echo = JournalEntry.objects.get(run=run, key="echo")
    echo_args = ((CANARY, f"hello {CANARY}"), {})
    assert echo.args_hash == args_hash(*echo_args)
    sent = Effect.objects.get(run=run, key="send")
    sent_args = ((CANARY,), {"header": f"Bearer {CANARY}"})
    assert sent.args_hash == args_hash(*sent_args)
    legacy = {legacy_hash(*echo_args), legacy_hash(*sent_args), legacy_hash((CANARY,), {})}
    stored = set(JournalEntry.objects.values_list("args_hash", flat=True))
    stored |= set(Effect.objects.values_list("args_hash", flat=True))
    assert not stored & legacy

    verified = subprocess.run(
        [sys.executable, "manage.py", "durability", "verify", str(run.id)],
        cwd=ROOT,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr

    def exported():
        spans = receiver.spans()
        runs = [s for s in spans if s.name == "run test-secrets"]
        failed = any(s.attributes.get("durability.outcome") == "failed" for s in runs)
        return spans if failed else None

    spans = wait_until(exported, timeout=30, what="the failed execution's span")
    events = [a for s in spans for name, a in s.events if name == "exception"]
    assert any(MARK in str(a.get("exception.message", "")) for a in events), events

    assert database_hits() == {}
    assert file_hits(Path(settings.VAR_DIR), folder) == {}
    for p in cluster.workers + [cluster.beat]:
        assert hits(p.log_path.read_bytes()) == 0, p.log_path
    assert hits(verified.stdout.encode() + verified.stderr.encode()) == 0
    assert sum(hits(body) for body in receiver.bodies) == 0


# --- hashes written before the upgrade, or under a key since rotated ---------------------------


def tool(value: str) -> dict:
    return {"value": value}


@pytest.fixture
def asking_agent():
    registry.unregister("x-rehash")
    a = Agent("x-rehash", version="1")

    @a.step(start=True)
    def ask(state, ctx):
        state["got"] = ctx.call("tool", tool, "argument")
        ctx.approval("go", {})
        return END

    yield a
    registry.unregister("x-rehash")


def waiting_with_one_call() -> Run:
    run = operations.start("x-rehash", {})
    assert drive(run.id).wait_reason == "approval"
    return run


def resume(run: Run) -> Run:
    operations.decide(run.id, "go", approve=True, by="tester")
    return drive(run.id)


def test_a_call_hashed_before_the_upgrade_still_replays(asking_agent):
    run = waiting_with_one_call()
    JournalEntry.objects.filter(run=run, key="tool").update(
        args_hash=legacy_hash(("argument",), {})
    )
    done = resume(run)
    assert done.status == RunStatus.SUCCEEDED, done.error


def test_a_call_hashed_under_a_rotated_key_replays_while_that_key_is_a_fallback(
    asking_agent, settings
):
    # Without DURABILITY_HMAC_KEY the key is derived from SECRET_KEY, which Django rotates
    # with SECRET_KEY_FALLBACKS. (DURABILITY_HMAC_KEY also keys the checkpoint chain.)
    settings.DURABILITY_HMAC_KEY = ""
    settings.SECRET_KEY = "first-" + "a" * 40
    run = waiting_with_one_call()
    first = JournalEntry.objects.get(run=run, key="tool").args_hash
    settings.SECRET_KEY = "second-" + "b" * 40
    settings.SECRET_KEY_FALLBACKS = ["first-" + "a" * 40]
    assert args_hash(("argument",), {}) != first
    done = resume(run)
    assert done.status == RunStatus.SUCCEEDED, done.error

    # Without the fallback the old hash is unknown: the replay is refused, not guessed.
    settings.SECRET_KEY = "first-" + "a" * 40
    settings.SECRET_KEY_FALLBACKS = []
    run = waiting_with_one_call()
    settings.SECRET_KEY = "second-" + "b" * 40
    done = resume(run)
    assert done.status == RunStatus.FAILED
    assert done.error_code == NonDeterminismError.code, done.error


def test_hashes_under_every_configured_key_are_accepted(settings):
    args = (("argument", {"token": "value"}), {"flag": True})
    settings.DURABILITY_HMAC_KEY = ""
    derived = args_hash(*args)
    settings.DURABILITY_HMAC_KEY = "explicit-one-" + "c" * 32
    one = args_hash(*args)
    settings.DURABILITY_HMAC_KEY = "explicit-two-" + "d" * 32
    settings.DURABILITY_HMAC_KEY_FALLBACKS = ["explicit-one-" + "c" * 32]
    two = ArgsHash(*args)
    assert len({derived, one, two.value, legacy_hash(*args)}) == 4
    # The current key, a fallback, the key derived from SECRET_KEY (before an explicit key
    # was set) and the unkeyed hash of rows written before keyed hashes.
    assert all(two.matches(h) for h in (two.value, one, derived, legacy_hash(*args)))
    assert not two.matches(args_hash(("other",), {}))
    settings.DURABILITY_HMAC_KEY_FALLBACKS = []
    assert not ArgsHash(*args).matches(one)
    # Back to the key derived from SECRET_KEY, the explicit one kept as a fallback.
    settings.DURABILITY_HMAC_KEY = ""
    settings.DURABILITY_HMAC_KEY_FALLBACKS = ["explicit-two-" + "d" * 32]
    back = ArgsHash(*args)
    assert back.value == derived and back.matches(two.value)


# --- what the gate refuses, and what it catches that a per-value redaction would not ------------


def test_a_secret_too_short_to_redact_reliably_is_refused(monkeypatch):
    monkeypatch.setenv("X_SHORT", "1234567")
    registry.unregister("x-short")
    a = Agent("x-short", version="1")

    @a.step(start=True)
    def read(state, ctx):
        state["pin"] = ctx.secret("X_SHORT")
        return END

    done = drive(operations.start("x-short", {}).id)
    registry.unregister("x-short")
    assert done.status == RunStatus.FAILED
    assert "7 characters long" in done.error and "1234567" not in done.error


def test_a_secret_in_a_state_key_fails_the_step_instead_of_being_hashed(monkeypatch):
    monkeypatch.setenv("X_KEYED", CANARY)
    registry.unregister("x-keyed")
    a = Agent("x-keyed", version="1")

    @a.step(start=True)
    def keyed(state, ctx):
        state[ctx.secret("X_KEYED")] = 1
        return END

    run = operations.start("x-keyed", {})
    done = drive(run.id)
    registry.unregister("x-keyed")
    assert done.status == RunStatus.FAILED
    assert "in a key of the state" in done.error
    assert database_hits() == {}
    assert operations.verify(run.id)[0].ok


def test_text_clipped_inside_a_secret_loses_the_part_it_kept():
    from durability import redact

    with redact.scope({CANARY}):
        assert redact.scrub(f"refused {CANARY[:20]}") == f"refused {MARK}"
        assert redact.scrub(f"refused {CANARY} and {CANARY[:9]}") == f"refused {MARK} and {MARK}"
        # Fewer characters than a secret may have are left: they identify nothing.
        assert redact.scrub(f"ends with {CANARY[:7]}") == f"ends with {CANARY[:7]}"
        assert redact.scrub(b"raw " + CANARY.encode()) == b"raw " + MARK.encode()
    assert redact.scrub(f"no scope {CANARY}") == f"no scope {CANARY}"


def test_a_statement_wrapper_added_and_removed_later_leaves_the_gate_in_place():
    from durability import redact

    connection.ensure_connection()
    seen = []

    def spy(execute, sql, params, many, context):
        seen.append(params)
        return execute(sql, params, many, context)

    with redact.scope({CANARY}):
        with connection.execute_wrapper(spy), connection.cursor() as cur:
            cur.execute("SELECT %s", [f"x {CANARY}"])
            assert cur.fetchone() == (f"x {MARK}",)
        with connection.cursor() as cur:
            cur.execute("SELECT %s", [f"y {CANARY}"])
            assert cur.fetchone() == (f"y {MARK}",)
    assert seen == [[f"x {MARK}"]]


def test_spans_of_the_sdk_pass_the_gate_in_front_of_its_processors():
    """Spans the engine does not make itself (instrumentations', an agent's own) are scrubbed
    by the processor ``config.telemetry`` puts in front of the exporter's."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Status, StatusCode

    from durability import redact, spans

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(spans.Redacting(SimpleSpanProcessor(exporter)))
    tracer = provider.get_tracer("agent")
    with redact.scope({CANARY}), tracer.start_as_current_span(f"call {CANARY}") as span:
        span.set_attribute("prompt", f"use {CANARY}")
        span.add_event("sent", {"header": f"Bearer {CANARY}"})
        span.record_exception(RuntimeError(f"refused {CANARY}"))
        span.set_status(Status(StatusCode.ERROR, f"refused {CANARY}"))
    with tracer.start_as_current_span(f"outside {CANARY}"):
        pass  # no scope: nothing to hide, nothing changed
    inside, outside = exporter.get_finished_spans()
    provider.shutdown()
    assert inside.name == f"call {MARK}" and inside.attributes["prompt"] == f"use {MARK}"
    assert inside.status.description == f"refused {MARK}"
    text = repr([(e.name, dict(e.attributes)) for e in inside.events])
    assert CANARY not in text and f"Bearer {MARK}" in text and f"refused {MARK}" in text
    assert outside.name == f"outside {CANARY}"
