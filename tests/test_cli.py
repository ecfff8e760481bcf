"""``python manage.py durability ...`` as an operator runs it, against the test database and
real workers: its exit codes, its output, its one-line errors.

Each exit code (0, 2, 3, 4, 6) and the settings read from the environment (an unreachable
database or broker) are checked through a real process (``cli_process``). The other
commands run in this process (``cli``), through the same entry point ``manage.py`` calls
(the command's ``run_from_argv``: argument parsing, the coded error and the exit status),
with its output, the log's and the process's own stdout and stderr captured: a Django
start-up of well over a second per command would otherwise be most of this module's time."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from durability.models import Checkpoint, Run, RunStatus
from durability.testing import wait_until
from tests.procs import ROOT

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def workers(cluster):
    cluster.worker(wait=False)
    cluster.start_beat()
    return cluster


def cli_process(
    workers, *args: str, stdin: str | None = None, env: dict | None = None, by: bool = True
) -> subprocess.CompletedProcess:
    """``python manage.py durability ...`` in a process of its own."""
    return subprocess.run(
        [sys.executable, "manage.py", "durability", *(["--by", "tester"] if by else []), *args],
        cwd=ROOT,
        env={**workers.env, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        input=stdin,
    )


def cli(
    workers, *args: str, stdin: str | None = None, by: bool = True
) -> subprocess.CompletedProcess:
    """The same command in this process, through what ``manage.py`` calls, with the module's
    workers behind it (the runs' queue is theirs: the ``cluster`` fixture). An exception that
    would have been a traceback fails the test with it."""
    from durability.management.commands.durability import Command

    argv = ["manage.py", "durability", *(["--by", "tester"] if by else []), *args]
    out, err = io.StringIO(), io.StringIO()
    log = logging.StreamHandler(err)
    log.setLevel(logging.WARNING)
    previous_stdin = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO((stdin or "").encode()), encoding="utf-8")
    logging.getLogger().addHandler(log)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            Command(stdout=out, stderr=err).run_from_argv(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        logging.getLogger().removeHandler(log)
        sys.stdin = previous_stdin
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def one_coded_line(done: subprocess.CompletedProcess, code: str) -> str:
    """An error as the CLI must print it: its code, one or two lines, never a traceback."""
    err = done.stderr.strip()
    assert f"[{code}]" in err, err
    assert "Traceback" not in err and len(err.splitlines()) <= 2, err
    return err


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_start_wait_show_verify(workers, llm):
    done = cli_process(workers, "start", "test-loop", "--input", '{"n": 3}', "--wait")
    assert done.returncode == 0, done.stderr
    assert "succeeded with 4 checkpoints" in done.stdout
    run = Run.objects.get()
    shown = cli_process(workers, "show", str(run.id)[:8], "--json")
    data = json.loads(shown.stdout)
    assert data["status"] == "succeeded" and data["state"]["i"] == 3
    assert len(data["checkpoints"]) == 4 and data["calls"] == 3
    human = cli(workers, "show", str(run.id))
    assert "SUCCEEDED" in human.stdout and "checkpoints:" in human.stdout
    listed = cli(workers, "list")
    assert str(run.id)[:8] in listed.stdout
    verified = cli(workers, "verify", str(run.id))
    assert verified.returncode == 0 and "4 checkpoints verify" in verified.stdout


def test_waiting_for_approval_then_approve(workers, llm):
    started = cli_process(
        workers, "start", "test-loop", "--input", '{"n": 2, "approve_at": 1}', "--wait"
    )
    assert started.returncode == 4, started.stdout + started.stderr
    assert "waits for a person: approval go" in started.stderr
    run = Run.objects.get()
    approved = cli(workers, "approve", str(run.id), "go", "--comment", "looks fine")
    assert approved.returncode == 0 and "approved" in approved.stdout
    again = cli_process(workers, "approve", str(run.id), "go", "--reject", "--comment", "no")
    assert again.returncode == 2 and "already approved by tester" in again.stderr
    wait_until(lambda: Run.objects.get().status == RunStatus.SUCCEEDED, timeout=30)


def test_rollback_fork_cancel_resume(workers, llm, tmp_path):
    cli(workers, "start", "test-loop", "--input", '{"n": 4}', "--wait")
    run = Run.objects.get()
    dry = cli(workers, "rollback", str(run.id), "--to", "2", "--dry-run")
    assert dry.returncode == 0 and "would roll back" in dry.stdout
    assert Checkpoint.objects.filter(run=run).count() == 5
    rolled = cli(workers, "--reason", "redo", "rollback", str(run.id), "--to", "2", "--continue")
    assert rolled.returncode == 0 and "continues at once with step iterate" in rolled.stdout
    wait_until(lambda: Run.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED, timeout=30)
    assert Run.objects.get(pk=run.pk).head_seq == 7  # 5 + the rollback + 2 steps again

    state = tmp_path / "state.json"
    state.write_text(json.dumps({"i": 3, "answers": ["edited"]}))
    forked = cli(workers, "fork", str(run.id), "--from", "1", "--state", str(state))
    assert forked.returncode == 0, forked.stderr
    fork = Run.objects.exclude(pk=run.pk).get()
    wait_until(lambda: Run.objects.get(pk=fork.pk).status == RunStatus.SUCCEEDED, timeout=30)

    slow = cli(workers, "start", "test-loop", "--input", '{"n": 50, "slow_ms": 200}')
    slow_id = slow.stdout.split()[-1]
    assert cli(workers, "cancel", slow_id).returncode == 0
    assert Run.objects.get(pk=slow_id).status == RunStatus.CANCELLED
    assert cli(workers, "cancel", slow_id).returncode == 2
    assert cli(workers, "resume", slow_id).returncode == 0


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["start", "nope"], 2, "unknown agent 'nope'"),
        (["start", "research", "--input", "{bad"], 2, "--input is not valid JSON"),
        (["start", "research", "--input", '{"question": 1}'], 2, "fails the schema"),
        (["show", "ffffffff"], 2, "no run whose id starts with ffffffff"),
        (["rollback", "ffffffff-0000-0000-0000-000000000000", "--to", "1"], 2, "no run"),
        (["fork", "x", "--from", "0"], 2, "'x' is not a run id"),
    ],
)
def test_bad_input_is_a_clear_error_and_a_non_zero_exit(workers, args, code, words):
    done = cli(workers, *args)
    assert done.returncode == code, done.stdout + done.stderr
    assert words in done.stderr
    assert Run.objects.count() == 0


def test_unreadable_state_file(workers, llm):
    cli(workers, "start", "test-loop", "--input", '{"n": 1}', "--wait")
    run = Run.objects.get()
    done = cli(workers, "fork", str(run.id), "--from", "0", "--state", "/nonexistent.json")
    assert done.returncode == 2 and "cannot read /nonexistent.json" in done.stderr
    bad = cli(workers, "fork", str(run.id), "--from", "0", "--state", "-", stdin="[1,")
    assert bad.returncode == 2 and "not valid JSON" in bad.stderr
    assert Run.objects.count() == 1


def test_verify_all_reports_a_corrupted_run(workers, llm):
    from django.db import connection

    cli(workers, "start", "test-loop", "--input", '{"n": 2}', "--wait")
    run = Run.objects.get()
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE durability_checkpoint SET state_hash = repeat('0', 64)"
            " WHERE run_id = %s AND seq = 1",
            [run.pk],
        )
    done = cli_process(workers, "verify")
    assert done.returncode == 3
    assert "checkpoint #1 does not verify" in done.stdout


def test_send_messages_to_a_conversation(workers, llm):
    started = cli(workers, "start", "test-chat", "--idempotency-key", "conv-1")
    run_id = started.stdout.split()[-1]
    again = cli(workers, "start", "test-chat", "--idempotency-key", "conv-1")
    assert again.stdout.split()[-1] == run_id and Run.objects.count() == 1
    wait_until(lambda: Run.objects.get(pk=run_id).wait_reason == "message", timeout=30)
    assert cli(workers, "send", run_id, "user", "--data", '"hello"', "--key", "m1").returncode == 0
    # The client retries the same send: it arrives once.
    assert cli(workers, "send", run_id, "user", "--data", '"hello"', "--key", "m1").returncode == 0
    assert cli(workers, "send", run_id, "user", "--data", '"bye"').returncode == 0
    wait_until(lambda: Run.objects.get(pk=run_id).status == RunStatus.SUCCEEDED, timeout=30)
    shown = json.loads(cli(workers, "show", run_id, "--json").stdout)
    assert [turn[0] for turn in shown["state"]["turns"]] == ["hello", "bye"]
    assert llm.total == 2
    bad = cli(workers, "send", run_id, "user", "--data", '"late"')
    assert bad.returncode == 2 and "takes no more messages" in bad.stderr


# --- errors are coded lines, never tracebacks ---------------------------------------------------


def test_json_nested_too_deeply_is_a_coded_error_from_an_argument_a_file_or_stdin(
    workers, tmp_path
):
    for depth in (5_000, 10_000, 100_000):
        deep = '{"n": ' + "[" * depth + "]" * depth + "}"
        path = tmp_path / f"deep{depth}.json"
        path.write_text(deep)
        ways = [(["--input", f"@{path}"], None), (["--input", "-"], deep)]
        if len(deep) < 100_000:  # a longer argument is over the kernel's limit for one
            ways.append((["--input", deep], None))
        for args, stdin in ways:
            done = cli(workers, "start", "test-loop", *args, stdin=stdin)
            assert done.returncode == 2, (depth, args[1][:20], done.stderr[-300:])
            one_coded_line(done, "DUR103")
        if len(deep) < 100_000:
            done = cli(workers, "send", "ffffffff", "x", "--data", deep)
            assert done.returncode == 2
            one_coded_line(done, "DUR103")
    assert Run.objects.count() == 0


def test_with_the_database_unreachable_every_command_prints_a_coded_line(workers):
    down = {"DATABASE_URL": f"postgres://postgres@127.0.0.1:{closed_port()}/durability"}
    run = "0123abcd-0000-0000-0000-000000000000"
    commands = [
        ["list"],
        ["show", run],
        ["show", run, "--json"],
        ["start", "test-loop", "--input", '{"n": 1}'],
        ["resume", run],
        ["rollback", run, "--to", "0"],
        ["fork", run, "--from", "0"],
        ["cancel", run],
        ["approve", run, "go"],
        ["send", run, "user", "--data", '"hi"'],
        ["resolve", run, "1", "done"],
        ["verify"],
        ["verify", run],
        ["hold", run],
        ["sweep"],
    ]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda args: cli_process(workers, *args, env=down), commands))
    for args, done in zip(commands, results, strict=True):
        assert done.returncode == 6, (args, done.stderr[-500:])
        err = one_coded_line(done, "DUR700")
        assert "the database cannot be reached" in err and "DATABASE_URL" in err, args


def test_with_the_broker_unreachable_start_resume_resolve_succeed_and_say_so_in_one_line(
    workers, llm, effects, faults, monkeypatch
):
    from durability import dispatch, operations
    from durability.models import Effect, EffectStatus
    from durability.testing import drive
    from workers.dispatcher import publish

    down = {"CELERY_BROKER_URL": f"redis://127.0.0.1:{closed_port()}/0"}
    note = "the run is queued in the database and the doorbell will ring at the next sweep"

    def succeeds_with_a_note(done: subprocess.CompletedProcess) -> None:
        assert done.returncode == 0, done.stderr[-2000:]
        err = done.stderr.strip()
        assert note in err and "Traceback" not in err and len(err.splitlines()) == 1, err

    started = cli_process(workers, "start", "test-loop", "--input", '{"n": 2}', env=down)
    succeeds_with_a_note(started)
    run_id = started.stdout.split()[-1]
    # Nobody was told but the database: the sweeper rings for the run, a worker runs it.
    wait_until(lambda: Run.objects.get(pk=run_id).status == RunStatus.SUCCEEDED, timeout=60)

    slow = cli(workers, "start", "test-loop", "--input", '{"n": 40, "slow_ms": 100}')
    slow_id = slow.stdout.split()[-1]
    assert cli(workers, "cancel", slow_id).returncode == 0
    succeeds_with_a_note(cli_process(workers, "resume", slow_id, env=down))
    wait_until(lambda: Run.objects.get(pk=slow_id).head_seq > 0, timeout=60)
    cli(workers, "cancel", slow_id)

    # An effect in doubt, made in this process (the fault is only here), rung by nobody.
    monkeypatch.setenv("TEST_LLM_URL", workers.env["TEST_LLM_URL"])
    monkeypatch.setenv("TEST_EFFECT_URL", workers.env["TEST_EFFECT_URL"])
    dispatch.set_dispatcher(None)
    try:
        doubt = operations.start("test-loop", {"n": 1, "effects": True}, by="seed")
        faults.set({"point": "after_effect", "action": "crash"})
        doubt = drive(doubt.id)
    finally:
        faults.clear()
        dispatch.set_dispatcher(publish)
    assert (doubt.status, doubt.wait_reason) == (RunStatus.WAITING, "in_doubt")
    effect = Effect.objects.get(run=doubt)
    resolved = cli_process(workers, "resolve", str(doubt.id), str(effect.pk), "retry", env=down)
    succeeds_with_a_note(resolved)
    assert Effect.objects.get(pk=effect.pk).status == EffectStatus.RETRY
    wait_until(lambda: Run.objects.get(pk=doubt.id).status == RunStatus.SUCCEEDED, timeout=60)


# --- options --------------------------------------------------------------------------------------


def test_reason_and_by_are_accepted_after_the_subcommand_too(workers, llm):
    from durability.models import Event, EventKind

    started = cli(
        workers,
        "start",
        "test-loop",
        "--input",
        '{"n": 50, "slow_ms": 100}',
        "--by",
        "ann",
        "--reason",
        "after",
        by=False,
    )
    assert started.returncode == 0, started.stderr
    run = Run.objects.get()
    assert (run.created_by, Event.objects.get(run=run, kind=EventKind.CREATED).reason) == (
        "ann",
        "after",
    )
    done = cli(workers, "--by", "bob", "--reason", "before", "cancel", str(run.id), by=False)
    assert done.returncode == 0, done.stderr
    resumed = cli(
        workers,
        "--by",
        "bob",
        "--reason",
        "before",
        "resume",
        str(run.id),
        "--reason",
        "wins",
        by=False,
    )
    assert resumed.returncode == 0, resumed.stderr
    events = {e.kind: (e.actor, e.reason) for e in Event.objects.filter(run=run)}
    assert events[EventKind.CANCELLED] == ("bob", "before")
    assert events[EventKind.RESUMED] == ("bob", "wins")  # the later one, after the subcommand
    cli(workers, "cancel", str(run.id))


def test_start_reads_its_input_from_a_file_or_stdin(workers, llm, tmp_path):
    path = tmp_path / "input.json"
    path.write_text('{"n": 1, "tag": "from a file "}')
    from_file = cli(workers, "start", "test-loop", "--input", f"@{path}", "--wait")
    assert from_file.returncode == 0, from_file.stderr
    from_stdin = cli(
        workers, "start", "test-loop", "--input", "-", "--wait", stdin='{"n": 1, "tag": "piped "}'
    )
    assert from_stdin.returncode == 0, from_stdin.stderr
    inputs = sorted(json.loads(r.input)["tag"] for r in Run.objects.all())
    assert inputs == ["from a file ", "piped "]
    missing = cli(workers, "start", "test-loop", "--input", "@/nonexistent.json")
    assert missing.returncode == 2
    assert "cannot read /nonexistent.json" in one_coded_line(missing, "DUR100")
    bad = cli(workers, "start", "test-loop", "--input", "-", stdin="[1,")
    assert bad.returncode == 2 and "--input - (stdin) is not valid JSON" in bad.stderr
    assert Run.objects.count() == 2


def test_expect_version_acts_only_on_the_version_it_names(workers, llm):
    from durability.models import Event, EventKind

    cli(workers, "start", "test-loop", "--input", '{"n": 2, "approve_at": 1}', "--wait")
    run = Run.objects.get()
    shown = json.loads(cli(workers, "show", str(run.id), "--json").stdout)["version"]
    assert (
        shown == run.lease_token and f"version {shown}" in cli(workers, "show", str(run.id)).stdout
    )
    stale = cli(workers, "cancel", str(run.id), "--expect-version", str(shown - 1))
    assert stale.returncode == 2
    assert "moved on since you saw it" in one_coded_line(stale, "DUR112")
    assert Run.objects.get(pk=run.pk).status == RunStatus.WAITING
    assert cli(workers, "cancel", str(run.id), "--expect-version", str(shown)).returncode == 0
    # The same command again, after a colleague resumed the run: the decision was carried out.
    assert cli(workers, "resume", str(run.id)).returncode == 0
    again = cli(workers, "cancel", str(run.id), "--expect-version", str(shown))
    assert again.returncode == 2 and "[DUR112]" in again.stderr
    assert Event.objects.filter(run=run, kind=EventKind.CANCELLED).count() == 1
    cli(workers, "cancel", str(run.id))


def test_a_reader_that_stops_reading_ends_the_command_quietly(workers):
    """``durability list | head -1``: the pipe closed under the command is no traceback."""
    done = cli(workers, "start", "test-loop", "--input", '{"n": 1}')
    assert done.returncode == 0, done.stderr
    reader = subprocess.Popen(
        [sys.executable, "manage.py", "durability", "list"],
        cwd=ROOT,
        env=workers.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    reader.stdout.close()  # before the command writes its first line
    _, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
