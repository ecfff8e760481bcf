"""What-if forks: edit one value and see what the agent would have done, paying only for
the calls the edit changed, and running no effect."""

from __future__ import annotations

import pytest

from durability import operations
from durability.models import Effect, EffectStatus, Event, EventKind, JournalEntry, RunStatus
from durability.testing import drive, state_of

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def outside(llm, effects, monkeypatch):
    monkeypatch.setenv("TEST_LLM_URL", llm.url)
    monkeypatch.setenv("TEST_EFFECT_URL", effects.url)


def test_a_what_if_fork_reuses_calls_until_it_diverges_and_runs_no_effect(llm, effects):
    source = operations.start("test-whatif", {"topic": "locks"})
    assert drive(source.id).status == RunStatus.SUCCEEDED
    assert llm.total == 4 and sum(effects.requests.values()) == 4

    fork = operations.fork(
        source.id,
        0,
        state={**state_of(source.id, 0), "style": "fancy"},
        what_if=True,
        by="dev",
        reason="what if fancy?",
    )
    assert drive(fork.id).status == RunStatus.SUCCEEDED
    # Parts 0 and 1 did not depend on the style: their calls were reused. Parts 2 and 3 did.
    assert llm.total == 6
    assert llm.prompts["locks part 2 in fancy style"] == 1
    reused = JournalEntry.objects.filter(run=fork).exclude(reused_from=None)
    assert reused.count() == 2
    diverged = Event.objects.get(run=fork, kind=EventKind.DIVERGED)
    assert diverged.seq == 2
    # No effect ran; each is recorded with its arguments as "would have run".
    assert sum(effects.requests.values()) == 4
    would = Effect.objects.filter(run=fork)
    assert would.count() == 4 and {e.status for e in would} == {EffectStatus.WOULD_RUN}
    assert "locks part 3" in would.last().args
    assert state_of(fork.id)["out"][:2] == state_of(source.id)["out"][:2]


def test_an_unedited_what_if_fork_makes_no_call_at_all(llm):
    source = operations.start("test-whatif", {"topic": "queues"})
    drive(source.id)
    fork = operations.fork(source.id, 1, what_if=True)
    drive(fork.id)
    assert llm.total == 4  # the source's four, none more
    assert not Event.objects.filter(run=fork, kind=EventKind.DIVERGED).exists()
    assert state_of(fork.id)["out"] == state_of(source.id)["out"]


def test_a_live_what_if_fork_runs_its_effects_with_new_keys(llm, effects):
    source = operations.start("test-whatif", {"topic": "logs"})
    drive(source.id)
    fork = operations.fork(source.id, 2, what_if=True, live=True)
    drive(fork.id)
    assert llm.total == 4
    assert sum(effects.requests.values()) == 6 and set(effects.requests.values()) == {1}


def test_the_fork_timeline_marks_reused_calls_and_the_divergence(llm):
    from dashboard import timeline

    source = operations.start("test-whatif", {"topic": "maps"})
    drive(source.id)
    fork = operations.fork(
        source.id, 0, state={**state_of(source.id, 0), "style": "bold"}, what_if=True
    )
    drive(fork.id)
    items = timeline.latest(fork).items
    reused = [i for i in items if ("reused", "from the source run, not called again") in i.facts]
    assert len(reused) == 2
    assert any(i.title == "diverged from the source run" for i in items)


def test_the_api_says_which_calls_a_what_if_fork_reused(llm, live_server):
    from tests.api_helpers import api_for, user_with

    source = operations.start("test-whatif", {"topic": "leases"})
    drive(source.id)
    edited = {**state_of(source.id, 0), "style": "fancy"}
    fork = operations.fork(source.id, 0, state=edited, what_if=True)
    drive(fork.id)
    viewer = api_for(live_server, user_with("viewer", "vera"))
    calls = viewer.get(f"/runs/{fork.id}/calls").json()["items"]
    reused = [c["reused_from"] for c in calls if c["reused_from"] is not None]
    sources = set(JournalEntry.objects.filter(run=source).values_list("id", flat=True))
    assert len(reused) == 2 and set(reused) <= sources
    assert any(c["reused_from"] is None for c in calls)  # the calls the edit changed


def test_a_what_if_runs_children_perform_no_effect_either(effects):
    """What a what-if run would have started is a what-if run too: its effects are recorded
    as "would have run", none is sent; a live what-if run's children perform theirs."""
    from durability import Agent, registry
    from durability.models import Run
    from tests.agents import post_effect

    def pay(state, ctx):
        state["paid"] = ctx.effect("pay", post_effect, f"pay {ctx.input['order']}")

    def delegate(state, ctx):
        child = ctx.spawn("x-payer", {"order": ctx.input["order"]})
        state["children"] = ctx.join([child])

    registry.unregister("x-payer")
    registry.unregister("x-delegator")
    Agent("x-payer", steps=[pay])
    Agent("x-delegator", steps=[delegate])

    def finished(run_id):
        for _ in range(10):  # the parent waits for its child, which the driver runs next
            for child in Run.objects.filter(parent_run_id=run_id):
                drive(child.id)
            if drive(run_id).status != RunStatus.WAITING:
                break
        return Run.objects.get(pk=run_id)

    try:
        source = operations.start("x-delegator", {"order": "K-1"})
        assert finished(source.id).status == RunStatus.SUCCEEDED
        assert sum(effects.requests.values()) == 1
        fork = operations.fork(source.id, 0, what_if=True)
        assert finished(fork.id).status == RunStatus.SUCCEEDED
        child = Run.objects.get(parent_run=fork)
        assert child.what_if and not child.what_if_live
        assert [e.status for e in Effect.objects.filter(run=child)] == [EffectStatus.WOULD_RUN]
        assert sum(effects.requests.values()) == 1  # nothing sent
        live = operations.fork(source.id, 0, what_if=True, live=True)
        assert finished(live.id).status == RunStatus.SUCCEEDED
        assert Run.objects.get(parent_run=live).what_if_live
        assert sum(effects.requests.values()) == 2
    finally:
        registry.unregister("x-payer")
        registry.unregister("x-delegator")


def test_the_cli_says_whether_a_what_if_fork_performs_its_effects(llm):
    import io
    import json

    from django.core.management import call_command

    from durability.models import Run

    source = operations.start("test-whatif", {"topic": "cli"})
    drive(source.id)
    said = {}
    for mode in ("--what-if", "--live"):
        out = io.StringIO()
        extra = ["--what-if", "--live"] if mode == "--live" else ["--what-if"]
        call_command("durability", "fork", str(source.id), "--from", "1", *extra, stdout=out)
        said[mode] = out.getvalue()
    assert "recorded as would have run, not performed" in said["--what-if"]
    assert "live: its effects (and its child runs') are performed for real" in said["--live"]
    fork = Run.objects.filter(forked_from=source, what_if_live=False).get()
    out = io.StringIO()
    call_command("durability", "show", str(fork.id), stdout=out)
    assert f"forked from {source.id} at #1 (what-if: its effects are recorded as" in out.getvalue()
    out = io.StringIO()
    call_command("durability", "show", str(fork.id), "--json", stdout=out)
    shown = json.loads(out.getvalue())
    assert (shown["forked_from"], shown["forked_from_seq"]) == (str(source.id), 1)
    assert shown["what_if"] == {"live": False}
