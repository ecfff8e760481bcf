"""Outcomes, recoveries and failures in plain sight: the outcome an agent names is stored
with the run's final commit; a claim that takes a run over from a dead worker counts a
recovery; calls a re-run takes from the journal are written into the event that ends the
step; the runs list and the run page show all three (and a failed run's traceback and what
can be done next)."""

from __future__ import annotations

import html as entities
import io
import json
import re
from collections import Counter

import pytest
from django.core.management import call_command
from django.urls import reverse

from durability import END, Agent, operations, registry
from durability.models import Event, EventKind, JournalEntry, Run, RunStatus
from durability.runtime.executor import execute
from durability.runtime.faults import SimulatedCrash
from durability.testing import drive, wait_until
from tests.dashboard_helpers import as_operator, operator

pytestmark = pytest.mark.django_db(transaction=True)
__all__ = ["as_operator", "operator"]

RUNS = reverse("dashboard:runs")
PAID: Counter = Counter()


def paid_call(prompt: str) -> dict:
    PAID[prompt] += 1
    return {"text": f"answer to {prompt}"}


@pytest.fixture(autouse=True)
def agents():
    PAID.clear()
    ending = Agent("outcome-end", version="1")

    @ending.step(start=True)
    def decide(state, ctx):
        state["answer"] = ctx.call("llm", paid_call, "decide")["text"]
        if state.get("how") == "named":
            ctx.outcome("rejected at publish")
            return None
        if state.get("how") == "plain":
            return None
        if state.get("how") == "early":
            ctx.outcome("said too early")
            return "finish"
        if state.get("how") == "bad":
            return END(42)
        return END("declined")

    @ending.step
    def finish(state, ctx):
        state["finished"] = True
        return None

    broken = Agent("outcome-broken", version="1")

    @broken.step(start=True)
    def explode(state, ctx):
        ctx.call("llm", paid_call, "before the error")
        raise ValueError("the order service answered nonsense")

    yield
    registry.unregister("outcome-end")
    registry.unregister("outcome-broken")


def text_of(response) -> str:
    """What a person reads: the page's text without its tags, spaces collapsed."""
    text = re.sub(r"<[^>]+>", " ", response.content.decode())
    return " ".join(entities.unescape(text).split()).replace(" ·", " ·")


def finished(run_id, timeout: float = 60.0) -> Run:
    return wait_until(
        lambda: (r := Run.objects.get(pk=run_id)).is_finished and r,
        timeout=timeout,
        what=f"run {run_id} to finish",
    )


# --- the engine ---------------------------------------------------------------------------------


@pytest.mark.smoke
def test_an_outcome_is_stored_by_the_final_commit_and_only_by_it(faults):
    run = operations.start("outcome-end", {"how": "end"})
    # Killed inside the final commit: nothing of it is written, the outcome included.
    faults.set({"point": "in_commit", "when": {"seq": 1}, "action": "crash"})
    with pytest.raises(SimulatedCrash):
        execute(run.id, worker="test-worker")
    half = Run.objects.get(pk=run.id)
    assert (half.status, half.outcome, half.head_seq) == (RunStatus.RUNNING, "", 0)
    done = drive(run.id)
    assert (done.status, done.outcome) == (RunStatus.SUCCEEDED, "declined")
    ended = Event.objects.get(run=run, kind=EventKind.SUCCEEDED)
    assert json.loads(ended.data) == {"outcome": "declined"}
    # The re-run took the call from the journal: paid once, and said so on its checkpoint.
    assert PAID["decide"] == 1
    call = JournalEntry.objects.get(run=run, key="llm")
    checkpoint = Event.objects.get(run=run, kind=EventKind.CHECKPOINT, seq=1)
    assert json.loads(checkpoint.data)["replayed"] == [[call.id, "llm"]]
    assert done.recoveries == 1


@pytest.mark.smoke
def test_ctx_outcome_names_the_end_and_plain_none_names_nothing():
    named = drive(operations.start("outcome-end", {"how": "named"}).id)
    plain = drive(operations.start("outcome-end", {"how": "plain"}).id)
    # Named in a step that did not end the run: the step that ended it named nothing.
    early = drive(operations.start("outcome-end", {"how": "early"}).id)
    assert named.outcome == "rejected at publish"
    assert plain.outcome == "" and plain.status == RunStatus.SUCCEEDED
    assert early.outcome == "" and early.status == RunStatus.SUCCEEDED
    assert Event.objects.get(run=plain, kind=EventKind.SUCCEEDED).data == ""
    # A run that ends without a replay writes no replay list.
    assert "replayed" not in Event.objects.get(run=named, kind=EventKind.CHECKPOINT, seq=1).data


def test_an_outcome_that_is_not_text_fails_the_run_with_a_sentence():
    done = drive(operations.start("outcome-end", {"how": "bad"}).id)
    assert done.status == RunStatus.FAILED
    assert "an outcome is text, not int" in done.error
    assert done.outcome == ""


@pytest.fixture(scope="module")
def running(cluster):
    cluster.worker(wait=False)
    cluster.start_beat()
    return cluster


def test_sigkill_counts_a_recovery_and_the_replayed_call_is_paid_once(
    running, llm, cluster_faults, as_operator
):
    # The worker process dies inside the checkpoint of iteration 3, after that iteration's
    # LLM call was journaled: the run is taken over, and the call answered from the journal.
    cluster_faults.set({"point": "in_commit", "when": {"seq": 4}, "action": "kill"})
    run = operations.start("test-loop", {"n": 6})
    done = finished(run.id)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert cluster_faults.fired() == 1
    assert done.recoveries == 1
    assert llm.prompts["iteration 3"] == 1 and llm.total == 6, dict(llm.prompts)
    call = JournalEntry.objects.get(run=run, step="iterate", result__contains="iteration 3")
    checkpoint = Event.objects.get(run=run, kind=EventKind.CHECKPOINT, seq=4)
    assert json.loads(checkpoint.data)["replayed"] == [[call.id, "llm"]]
    for worker in running.workers:
        if not worker.alive():
            worker.start()

    page = text_of(as_operator.get(reverse("dashboard:run", args=[run.id])))
    assert "1 call replayed from the journal (not paid again); 0 effects repeated" in page
    assert "replayed, not paid" in page
    listed = text_of(as_operator.get(RUNS, {"recovered": "yes"}))
    assert run.short_id in listed and "recovered" in listed


# --- the dashboard ------------------------------------------------------------------------------


def test_the_list_shows_and_filters_outcomes_and_recoveries(as_operator):
    declined = drive(operations.start("outcome-end", {"how": "end"}).id)
    plain = drive(operations.start("outcome-end", {"how": "plain"}).id)
    Run.objects.filter(pk=plain.pk).update(recoveries=2)

    html = text_of(as_operator.get(RUNS))
    assert "succeeded · declined" in html
    assert "recovered ×2" in html

    by_outcome = text_of(as_operator.get(RUNS, {"outcome": "declined"}))
    assert declined.short_id in by_outcome and plain.short_id not in by_outcome
    recovered = text_of(as_operator.get(RUNS, {"recovered": "yes"}))
    assert plain.short_id in recovered and declined.short_id not in recovered

    unknown = as_operator.get(RUNS, {"outcome": "exploded"})
    assert unknown.status_code == 400
    assert "no run ended with “exploded”" in text_of(unknown)
    assert as_operator.get(RUNS, {"recovered": "twice"}).status_code == 400

    page = text_of(as_operator.get(reverse("dashboard:run", args=[declined.id])))
    assert "succeeded · declined" in page


def test_a_failed_run_shows_its_traceback_and_what_can_be_done_next(as_operator):
    run = drive(operations.start("outcome-broken", {}).id)
    assert run.status == RunStatus.FAILED
    response = as_operator.get(reverse("dashboard:run", args=[run.id]))
    html = response.content.decode()
    page = text_of(response)
    assert "ValueError: the order service answered nonsense" in page
    assert "<summary>Traceback</summary>" in html and "in explode" in page
    assert "runs step explode again from checkpoint #0, on the same state it failed on" in page
    assert f"{reverse('dashboard:fork', args=[run.id])}?from=0" in html
    assert "waiting for</dt>" not in html


def test_an_outcome_shows_only_on_a_run_that_succeeded(as_operator):
    # A run resumed or rolled back after it ended may still carry its last outcome: once it
    # has failed, the outcome is not what happened.
    run = drive(operations.start("outcome-end", {"how": "end"}).id)
    Run.objects.filter(pk=run.pk).update(status=RunStatus.FAILED, error="ValueError: later")
    assert "failed · declined" not in text_of(as_operator.get(RUNS))
    page = text_of(as_operator.get(reverse("dashboard:run", args=[run.id])))
    assert "failed · declined" not in page and "failed" in page
    assert run.short_id not in text_of(as_operator.get(RUNS, {"outcome": "declined"}))


def test_a_run_rolled_back_or_resumed_before_its_end_has_no_outcome_until_it_ends_again():
    run = drive(operations.start("outcome-end", {"how": "named"}).id)
    assert run.outcome == "rejected at publish"
    operations.rollback(run.id, 0, by="ann")
    held = Run.objects.get(pk=run.pk)
    assert (held.status, held.outcome) == (RunStatus.WAITING, "")
    operations.resume(run.id, by="ann")
    assert drive(run.id).outcome == "rejected at publish"
    # The CLI says it beside the status, as the dashboard does.
    out = io.StringIO()
    call_command("durability", "show", str(run.id), stdout=out)
    assert "SUCCEEDED · rejected at publish" in out.getvalue()
    out = io.StringIO()
    call_command("durability", "show", str(run.id), "--json", stdout=out)
    assert json.loads(out.getvalue())["outcome"] == "rejected at publish"


def test_the_support_demo_names_how_each_conversation_ended():
    def support(customer: str, message: str) -> Run:
        return drive(operations.start("support", {"customer": customer, "message": message}).id)

    refunded = support("ada@example.com", "Refund order A-1001 please")
    declined = support("mallory@example.com", "Refund order A-1001 please")  # not her order
    asked = support("grace@example.com", "I want to return order A-1002")
    assert asked.wait_reason == "approval"
    operations.decide(asked.id, "refund", approve=False, by="ops", comment="outside the window")
    rejected = drive(asked.id)
    assert [r.status for r in (refunded, declined, rejected)] == [RunStatus.SUCCEEDED] * 3
    assert [r.outcome for r in (refunded, declined, rejected)] == [
        "refunded",
        "declined",
        "rejected",
    ]
