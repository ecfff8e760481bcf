"""The CLI refuses arguments that cannot mean anything (a negative limit, a timeout of -5 s, a
result with an outcome that returns none, a version the run never had) with the rule, before
it acts: nothing is started or changed."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from durability import Agent, operations, registry
from durability.models import Effect, EffectStatus, Event, Run, RunStatus
from durability.testing import drive

pytestmark = pytest.mark.django_db(transaction=True)


def cli(*args: str) -> str:
    out = io.StringIO()
    call_command("durability", *args, stdout=out)
    return out.getvalue()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["list", "--limit", "-1"], "'-1' is not a whole number of at least 1"),
        (["list", "--limit", "0"], "'0' is not a whole number of at least 1"),
        (["start", "x", "--input", "{}", "--wait", "--timeout", "-5"], "of seconds over 0"),
        (["start", "x", "--input", "{}", "--wait", "--timeout", "nan"], "of seconds over 0"),
        (["cancel", "abcd", "--expect-version", "-1"], "'-1' is not a whole number of at least 0"),
    ],
)
def test_a_number_that_cannot_mean_anything_is_refused(args, said):
    with pytest.raises(CommandError, match=said):
        cli(*args)


def test_a_timeout_without_wait_is_refused_and_starts_nothing():
    with pytest.raises(CommandError) as refused:
        cli("start", "research", "--input", '{"question": "What is a lease?"}', "--timeout", "1")
    assert str(refused.value) == "[DUR100] --timeout goes with --wait; nothing was started"
    assert refused.value.returncode == 2 and not Run.objects.exists()


def test_a_version_the_run_never_had_is_said_so():
    run = operations.start("research", {"question": "What is a lease?"})
    with pytest.raises(CommandError) as refused:
        cli("cancel", str(run.id), "--expect-version", str(run.lease_token + 5))
    assert f"has never been at {run.lease_token + 5}" in str(refused.value)
    assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED


def doubtful(state, ctx):
    state["paid"] = ctx.effect("charge", _charge, "card")


def _charge(what: str, *, idempotency_key: str) -> dict:
    return {"charged": what}


@pytest.fixture
def in_doubt(faults):
    registry.unregister("x-doubtful")
    Agent("x-doubtful", steps=[doubtful])
    faults.set({"point": "after_effect", "action": "crash"})  # done, its outcome not recorded
    run = drive(operations.start("x-doubtful", {}).id)
    faults.clear()
    assert (run.status, run.wait_reason) == (RunStatus.WAITING, "in_doubt"), run.error
    yield run, Effect.objects.get(run=run)
    registry.unregister("x-doubtful")


@pytest.mark.parametrize("outcome", ["failed", "retry"])
def test_a_result_with_an_outcome_that_returns_none_is_refused(in_doubt, outcome):
    run, effect = in_doubt
    with pytest.raises(CommandError) as refused:
        cli("resolve", str(run.id), str(effect.pk), outcome, "--result", '{"x": 1}')
    assert "a result goes with done only" in str(refused.value)
    assert refused.value.returncode == 2
    assert Effect.objects.get(pk=effect.pk).status == EffectStatus.IN_DOUBT
    assert not Event.objects.filter(run=run, kind="effect_resolved").exists()


def test_releasing_a_legal_hold_says_a_rollbacks_hold_remains(in_doubt):
    """Two holds share the word: a legal hold (retention leaves the run alone) and a
    rollback's (the run waits for an operator to continue it). Releasing the first says the
    second remains; show says whether a run is on legal hold."""
    run, effect = in_doubt
    cli("resolve", str(run.id), str(effect.pk), "done", "--result", '{"charged": "card"}')
    assert drive(run.id).status == RunStatus.SUCCEEDED
    operations.rollback(run.id, 0, by="ann", reason="again")
    assert "on legal hold: retention and deletion leave it alone" in cli("hold", str(run.id))
    assert "on legal hold" in cli("show", str(run.id))
    assert '"legal_hold": true' in cli("show", str(run.id), "--json")
    released = cli("hold", str(run.id), "--release")
    assert f"run {run.id} released from legal hold" in released
    assert "still on hold after a rollback (not a legal hold): continue it with" in released
    assert "on legal hold" not in cli("show", str(run.id))


def test_a_retried_start_or_send_says_it_did_nothing_new():
    """The same idempotency key again returns the first run or message: said as such, not as
    a new start or delivery."""
    ask = ["start", "research", "--input", '{"question": "What is a lease?"}']
    first = cli(*ask, "--idempotency-key", "k-1")
    again = cli(*ask, "--idempotency-key", "k-1")
    run = Run.objects.get()
    assert first.startswith("started research@") and str(run.id) in first
    assert again.startswith("already started with this idempotency key, nothing new started:")
    assert again.split()[-1] == str(run.id)  # the id last, as a first start says it
    sent = cli("send", str(run.id), "note", "--data", '"hi"', "--key", "m-1")
    resent = cli("send", str(run.id), "note", "--data", '"hi"', "--key", "m-1")
    assert "delivered to run" in sent
    assert "already delivered with this key, not again, to run" in resent


def test_resuming_a_run_in_doubt_says_the_effect_is_still_to_be_resolved(in_doubt):
    run, effect = in_doubt
    said = cli("resume", str(run.id))
    assert f"effect 'charge' [{effect.pk}] is still in doubt" in said
    assert f"durability resolve {run.id} {effect.pk} done|failed|retry" in said


def test_show_says_when_no_worker_is_running_for_a_queued_run():
    from django.utils import timezone

    from durability.models import WorkerPresence

    run = operations.start("research", {"question": "What is a lease?"})
    assert "no worker is running (none announced itself in the last" in cli("show", str(run.id))
    WorkerPresence.objects.create(
        name="w1", capabilities="{}", started_at=timezone.now(), seen_at=timezone.now()
    )
    assert "no worker is running" not in cli("show", str(run.id))


def test_version_names_the_product():
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        call_command("durability", "--version")
    assert out.getvalue().startswith("durability ") and "(Django " in out.getvalue()
