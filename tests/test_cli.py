"""``python manage.py durability ...`` as an operator runs it: a real process, real exit
codes, against the test database and real workers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from durability.models import Checkpoint, Run, RunStatus
from durability.testing import wait_until
from tests.procs import ROOT

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def workers(cluster):
    cluster.worker()
    cluster.start_beat()
    return cluster


def cli(workers, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", "durability", "--by", "tester", *args],
        cwd=ROOT,
        env=workers.env,
        capture_output=True,
        text=True,
        timeout=120,
        input=stdin,
    )


def test_start_wait_show_verify(workers, llm):
    done = cli(workers, "start", "test-loop", "--input", '{"n": 3}', "--wait")
    assert done.returncode == 0, done.stderr
    assert "succeeded with 4 checkpoints" in done.stdout
    run = Run.objects.get()
    shown = cli(workers, "show", str(run.id)[:8], "--json")
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
    started = cli(workers, "start", "test-loop", "--input", '{"n": 2, "approve_at": 1}', "--wait")
    assert started.returncode == 4, started.stdout + started.stderr
    assert "waits for a person: approval go" in started.stderr
    run = Run.objects.get()
    approved = cli(workers, "approve", str(run.id), "go", "--comment", "looks fine")
    assert approved.returncode == 0 and "approved" in approved.stdout
    again = cli(workers, "approve", str(run.id), "go", "--reject")
    assert again.returncode == 2 and "already approved by tester" in again.stderr
    wait_until(lambda: Run.objects.get().status == RunStatus.SUCCEEDED, timeout=30)


def test_rollback_fork_cancel_resume(workers, llm, tmp_path):
    cli(workers, "start", "test-loop", "--input", '{"n": 4}', "--wait")
    run = Run.objects.get()
    dry = cli(workers, "rollback", str(run.id), "--to", "2", "--dry-run")
    assert dry.returncode == 0 and "would roll back" in dry.stdout
    assert Checkpoint.objects.filter(run=run).count() == 5
    rolled = cli(workers, "--reason", "redo", "rollback", str(run.id), "--to", "2")
    assert rolled.returncode == 0 and "continues at step iterate" in rolled.stdout
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
    done = cli(workers, "verify")
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
