"""Once per decision: resume, cancel, resolve and send name the run version the operator saw,
and the engine, under the run's row lock, refuses a decision made on a version the run has
left. Twenty copies of one decision, each on its own thread and database connection, race a
worker that moves the run on and back to where the decision expects it (fails it again,
puts the effect in doubt again, waits again): the decision happens exactly once, whether it
comes through the engine or as dashboard POSTs without the one-time form token."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse

from durability import Agent, operations, registry
from durability.errors import InvalidTransition, Permanent, Stale
from durability.models import (
    FINISHED,
    TIMED_WAITS,
    Effect,
    EffectStatus,
    Event,
    EventKind,
    Message,
    Run,
    RunStatus,
)
from durability.runtime import inflight
from durability.runtime.executor import execute
from durability.runtime.faults import SimulatedCrash
from durability.testing import drive, state_of, wait_until
from tests.dashboard_helpers import (
    as_operator,
    counts,
    dash_agents,
    finished_run,
    operator,
    text_of,
    waiting_run,
)

pytestmark = pytest.mark.django_db(transaction=True)
__all__ = ["as_operator", "dash_agents", "operator"]

COPIES = 20
PERFORMED: list[str] = []


def pay(amount: int, *, idempotency_key: str) -> dict:
    PERFORMED.append(idempotency_key)
    return {"paid": amount}


@pytest.fixture(autouse=True)
def decision_agents():
    PERFORMED.clear()
    names = ("dec-fail", "dec-listen", "dec-pay")
    for name in names:
        registry.unregister(name)

    def boom(state, ctx):
        raise Permanent("the tool is broken")

    def listen(state, ctx):
        state["heard"].append(ctx.wait_for("go"))
        return "listen"  # and wait again: the run keeps taking messages

    def charge(state, ctx):
        state["receipt"] = ctx.effect("pay", pay, 5)

    Agent("dec-fail", steps=[boom])
    listener = Agent("dec-listen", initial_state=lambda inp: {"heard": []})
    listener.step(listen, name="listen", start=True)
    Agent("dec-pay", steps=[charge])
    yield
    for name in names:
        registry.unregister(name)


class Worker(threading.Thread):
    """Executes the run whenever it is runnable, on its own connection, as a worker process
    would: a failing run fails again at once, an effect that crashes goes in doubt again."""

    def __init__(self, run_id: Any) -> None:
        super().__init__(daemon=True)
        self.run_id = run_id
        self.stop = threading.Event()
        self.executions = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                run = Run.objects.get(pk=self.run_id)
                idle = run.status in FINISHED or (
                    run.status == RunStatus.WAITING and run.wait_reason not in TIMED_WAITS
                )
                if idle:
                    time.sleep(0.002)
                    continue
                self.executions += 1
                with contextlib.suppress(SimulatedCrash):
                    execute(self.run_id, worker="racing-worker")
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            # Its commits went over a session of this thread's own: gone with the thread.
            inflight.channel().close()
            connection.close()

    def __enter__(self) -> Worker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join(30)
        assert not self.is_alive(), "the worker thread did not stop"
        assert self.error is None, self.error


def concurrently(
    decision: Callable[[int], Any], moved_on_and_back: Callable[[], Any], copies: int = COPIES
) -> list[Any]:
    """``decision(i)`` on ``copies`` threads, each with its own database connection, in two
    waves: half at once (they race each other for the run's lock), then, once the worker has
    moved the run on and back to what the decision expects (``moved_on_and_back``), the
    other half at once: the late copies a retried request or a second click would send.
    Returns what each returned or raised."""
    results: list[Any] = [None] * copies

    def wave(indices: range) -> None:
        start = threading.Barrier(len(indices))

        def one(i: int) -> None:
            try:
                start.wait()
                time.sleep(random.uniform(0, 0.05))
                results[i] = decision(i)
            except BaseException as exc:
                results[i] = exc
            finally:
                connection.close()

        threads = [threading.Thread(target=one, args=(i,)) for i in indices]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)

    wave(range(copies // 2))
    wait_until(moved_on_and_back, timeout=30, what="the run to move on and come back")
    wave(range(copies // 2, copies))
    return results


def _post(client: Client, path: str, data: dict) -> int:
    # Each thread its own client (the session cookie copied), so requests do not share state.
    mine = Client()
    mine.cookies = client.cookies
    return mine.post(path, data).status_code


def _answered(via: str, results: list[Any]) -> None:
    """Every copy got an answer, none an error: through the engine, the one that acted its
    row and the others a refusal naming why; through the dashboard, a redirect or a refusal
    page, never a 5xx. (How many acted is counted in the database, by the tests.)"""
    if via == "engine":
        acted = [r for r in results if isinstance(r, Run | Effect | Message)]
        refused = [r for r in results if r not in acted]
        assert len(acted) == 1, results
        assert all(isinstance(r, InvalidTransition) for r in refused), refused
    else:
        assert set(results) <= {302, 409}, results


@pytest.fixture(params=["engine", "dashboard"])
def via(request):
    return request.param


def test_twenty_copies_of_a_resume_resume_a_failed_run_once(via, as_operator):
    run = drive(operations.start("dec-fail", {}, by="seed").id)
    assert run.status == RunStatus.FAILED
    shown = run.lease_token

    def resume(i: int) -> Any:
        if via == "engine":
            return operations.resume(
                run.id, by="olive", expected_status="failed", expected_version=shown
            )
        return _post(
            as_operator,
            reverse("dashboard:resume", args=[run.id]),
            {"resume-status": "failed", "resume-version": shown, "resume-reason": f"copy {i}"},
        )

    def failed_again() -> bool:
        return Event.objects.filter(run=run, kind=EventKind.FAILED).count() == 2 and (
            Run.objects.get(pk=run.id).status == RunStatus.FAILED
        )

    with Worker(run.id) as worker:
        results = concurrently(resume, failed_again)
        wait_until(lambda: Run.objects.get(pk=run.id).status == RunStatus.FAILED, timeout=10)
    _answered(via, results)
    assert Event.objects.filter(run=run, kind=EventKind.RESUMED).count() == 1, results
    assert Event.objects.filter(run=run, kind=EventKind.FAILED).count() == 2
    assert worker.executions >= 1
    if via == "engine":
        assert any(isinstance(r, Stale) for r in results), results


def test_twenty_copies_of_a_cancel_cancel_once_though_a_colleague_resumes_it(via, as_operator):
    run = drive(operations.start("dec-listen", {}, by="seed").id)
    assert (run.status, run.wait_reason) == (RunStatus.WAITING, "message")
    shown = run.lease_token
    stop = threading.Event()

    def colleague() -> None:
        # Another operator's decision, made on what they see: resume it once it is cancelled.
        try:
            while not stop.is_set():
                now = Run.objects.get(pk=run.id)
                if now.status == RunStatus.CANCELLED:
                    operations.resume(
                        run.id,
                        by="colleague",
                        expected_status="cancelled",
                        expected_version=now.lease_token,
                    )
                time.sleep(0.002)
        finally:
            connection.close()

    def cancel(i: int) -> Any:
        if via == "engine":
            return operations.cancel(run.id, by="olive", reason="stop", expected_version=shown)
        return _post(
            as_operator,
            reverse("dashboard:cancel", args=[run.id]),
            {"cancel-version": shown, "cancel-reason": f"copy {i}"},
        )

    def waiting_again() -> bool:
        resumed = Event.objects.filter(run=run, kind=EventKind.RESUMED).exists()
        return resumed and Run.objects.get(pk=run.id).status == RunStatus.WAITING

    helper = threading.Thread(target=colleague, daemon=True)
    helper.start()
    try:
        with Worker(run.id):
            results = concurrently(cancel, waiting_again)
    finally:
        stop.set()
        helper.join(30)
    _answered(via, results)
    assert Event.objects.filter(run=run, kind=EventKind.CANCELLED, actor="olive").count() == 1


def test_twenty_copies_of_a_resolve_settle_an_effect_in_doubt_once(via, as_operator, faults):
    # The effect's process dies after every call, so each retry puts it in doubt again.
    faults.set({"point": "after_effect", "action": "crash", "repeat": True})
    run = drive(operations.start("dec-pay", {}, by="seed").id)
    assert (run.status, run.wait_reason) == (RunStatus.WAITING, "in_doubt")
    effect = Effect.objects.get(run=run)
    shown = run.lease_token
    assert [effect.idempotency_key] == PERFORMED

    def resolve(i: int) -> Any:
        if via == "engine":
            return operations.resolve_effect(
                run.id, effect.pk, outcome="retry", by="olive", expected_version=shown
            )
        return _post(
            as_operator,
            reverse("dashboard:resolve", args=[run.id, effect.pk]),
            {"outcome": "retry", "version": shown, "note": f"copy {i}"},
        )

    def in_doubt_again() -> bool:
        again = Effect.objects.get(pk=effect.pk)
        return again.attempts > effect.attempts and again.status == EffectStatus.IN_DOUBT

    with Worker(run.id):
        results = concurrently(resolve, in_doubt_again)
        wait_until(
            lambda: Effect.objects.get(pk=effect.pk).status == EffectStatus.IN_DOUBT, timeout=10
        )
    _answered(via, results)
    assert Event.objects.filter(run=run, kind=EventKind.EFFECT_RESOLVED).count() == 1
    assert len(PERFORMED) == 2  # the first call and the one retry: never a third
    assert Effect.objects.get(pk=effect.pk).attempts == effect.attempts + 1


def test_twenty_copies_of_a_send_deliver_the_message_once(via, as_operator):
    run = drive(operations.start("dec-listen", {}, by="seed").id)
    shown = run.lease_token

    def send(i: int) -> Any:
        if via == "engine":
            return operations.send(run.id, "go", {"n": 1}, by="olive", expected_version=shown)
        return _post(
            as_operator,
            reverse("dashboard:send", args=[run.id]),
            {
                "send-name": "go",
                "send-data": '{"n": 1}',
                "send-as_json": "on",
                "send-version": shown,
            },
        )

    def waiting_again() -> bool:
        now = Run.objects.get(pk=run.id)
        return now.head_seq > run.head_seq and now.wait_reason == "message"

    with Worker(run.id):
        results = concurrently(send, waiting_again)
        wait_until(lambda: Run.objects.get(pk=run.id).wait_reason == "message", timeout=10)
    assert Message.objects.filter(run=run).count() == 1, results
    assert Event.objects.filter(run=run, kind=EventKind.MESSAGE_RECEIVED).count() == 1
    assert state_of(run.id)["heard"] == [{"n": 1}]
    if via == "dashboard":
        assert set(results) == {302}  # a copy is answered with the first delivery
    else:
        assert {r.pk for r in results} == {Message.objects.get(run=run).pk}


# --- the version is required from the dashboard and checked by the engine --------------------


def test_a_dashboard_action_without_the_run_version_is_a_400_that_changes_nothing(
    as_operator, faults
):
    waiting = waiting_run("No version?")
    failed = drive(operations.start("dec-fail", {}, by="seed").id)
    listening = drive(operations.start("dec-listen", {}, by="seed").id)
    finished = finished_run("Roll back without a version?")
    faults.set({"point": "after_effect", "action": "crash"})
    doubt = drive(operations.start("dec-pay", {}, by="seed").id)
    faults.clear()
    effect = Effect.objects.get(run=doubt)
    posts = [
        ("resume", [failed.id], {"resume-status": "failed", "resume-reason": "x"}),
        ("cancel", [waiting.id], {"cancel-reason": "x"}),
        ("send", [listening.id], {"send-name": "go", "send-data": "hi"}),
        ("resolve", [doubt.id, effect.pk], {"outcome": "retry"}),
        (
            "rollback",
            [finished.id],
            {
                "checkpoint_id": finished.checkpoints.get(seq=1).id,
                "expected_head": finished.head_seq,
                "reason": "x",
                "token": "11111111-2222-3333-4444-555555555555",
            },
        ),
    ]
    before = counts(), Message.objects.count()
    for name, args, data in posts:
        for bad in (None, "", "abc", "-1", "1e3", "9" * 40):
            field = {"resume": "resume-", "cancel": "cancel-", "send": "send-"}.get(name, "")
            sent = dict(data) if bad is None else {**data, f"{field}version": bad}
            response = as_operator.post(reverse(f"dashboard:{name}", args=args), sent)
            assert response.status_code == 400, (name, bad, response.status_code)
            assert "does not say which version of the run" in text_of(response), name
    assert (counts(), Message.objects.count()) == before


def test_the_engine_refuses_a_decision_on_a_version_the_run_left_and_names_what_changed():
    failed = drive(operations.start("dec-fail", {}, by="seed").id)
    shown = failed.lease_token
    operations.resume(failed.id, by="ann", reason="once more", expected_version=shown)
    assert drive(failed.id).status == RunStatus.FAILED  # failed again: the status it had
    listening = drive(operations.start("dec-listen", {}, by="seed").id)
    seen = listening.lease_token
    operations.cancel(listening.id, by="ann", reason="pause", expected_version=seen)
    operations.resume(listening.id, by="ann", expected_version=seen + 1)
    assert drive(listening.id).wait_reason == "message"  # waiting again, as it was seen
    before = counts(), Message.objects.count()
    with pytest.raises(Stale) as refused:
        operations.resume(failed.id, by="bob", expected_status="failed", expected_version=shown)
    text = str(refused.value)
    assert "[DUR112]" in text and f"at version {shown}, it is at {shown + 2} now" in text
    assert "last: failed" in text and "review it again" in text
    for late in (
        lambda: operations.cancel(listening.id, by="bob", expected_version=seen),
        lambda: operations.send(listening.id, "go", 1, by="bob", expected_version=seen),
    ):
        with pytest.raises(Stale, match="moved on since you saw it"):
            late()
    assert (counts(), Message.objects.count()) == before
    # Without a version the caller acts on what it reads in the same locked transaction.
    assert operations.resume(failed.id, by="bob").status == RunStatus.QUEUED
