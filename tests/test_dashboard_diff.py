"""The human diff: what it finds (appends and front inserts as new elements, edits as old ->
new), how it groups and redacts, and the diff page between checkpoints and across a fork."""

from __future__ import annotations

import pytest
from django.urls import reverse

from dashboard import diffview, present
from durability import operations
from durability.testing import drive
from tests.dashboard_helpers import as_operator, dash_agents, operator, text_of, waiting_run

__all__ = ["as_operator", "dash_agents", "operator"]


def kinds(diff: diffview.Diff) -> list[tuple[str, str]]:
    return [(c.kind, c.path) for c in diff.changes]


# --- the walk -----------------------------------------------------------------------------------


def test_appended_messages_are_new_elements_not_a_rewritten_list():
    old = {"messages": [{"role": "user", "content": "hi"}]}
    new = {"messages": [*old["messages"], {"role": "assistant", "content": "hello"}]}
    diff = diffview.compare(old, new)
    assert kinds(diff) == [("added", "/messages/1")]
    assert diff.changes[0].new == {"role": "assistant", "content": "hello"}


def test_front_inserts_and_front_removals_are_elements_too():
    old = {"log": ["c", "d", "e"]}
    assert kinds(diffview.compare(old, {"log": ["a", "b", "c", "d", "e"]})) == [
        ("added", "/log/0"),
        ("added", "/log/1"),
    ]
    assert kinds(diffview.compare(old, {"log": ["e"]})) == [
        ("removed", "/log/0"),
        ("removed", "/log/1"),
    ]


def test_edits_keep_old_and_new_values_and_nested_paths_are_escaped():
    old = {"notes": {"a/b": {"c~d": 0.6}}, "plan": ["x", "y", "z"], "gone": 1}
    new = {"notes": {"a/b": {"c~d": 0.8}}, "plan": ["x", "Y", "z"], "born": True}
    diff = diffview.compare(old, new)
    assert kinds(diff) == [
        ("changed", "/notes/a~1b/c~0d"),
        ("changed", "/plan/1"),
        ("removed", "/gone"),
        ("added", "/born"),
    ]
    assert (diff.changes[0].old, diff.changes[0].new) == (0.6, 0.8)
    assert diff.changes[0].segments == ["notes", "a/b", "c~d"]
    assert (diff.added, diff.removed, diff.changed) == (1, 1, 2)
    assert [g.key for g in diff.groups()] == ["notes", "plan", "gone", "born"]


def test_a_change_of_type_is_a_change_even_when_python_says_equal():
    diff = diffview.compare({"n": 1, "b": 1}, {"n": 1.0, "b": True})
    assert kinds(diff) == [("changed", "/n"), ("changed", "/b")]


def test_identical_states_have_no_changes_and_the_root_can_change():
    state = {"a": [1, {"b": None}]}
    assert diffview.compare(state, {"a": [1, {"b": None}]}).changes == []
    assert kinds(diffview.compare([1], {"x": 1})) == [("changed", "")]


def test_groups_page_through_the_changes():
    old = {"items": []}
    new = {"items": list(range(450))}
    diff = diffview.compare(old, new)
    assert len(diff.changes) == 450
    page = diff.groups(400, 200)
    assert len(page) == 1 and len(page[0].changes) == 50 and page[0].added == 50


def test_word_diff_marks_words():
    segments = diffview.word_diff("the quick brown fox", "the slow brown fox jumps")
    marked = [(s.op, s.text) for s in segments if s.op != "equal"]
    assert marked == [("delete", "quick"), ("insert", "slow"), ("insert", " jumps")]
    assert "".join(s.text for s in segments if s.op != "delete") == "the slow brown fox jumps"


def test_secret_paths_and_secret_keys_inside_values_are_redacted_for_display():
    diff = diffview.compare(
        {"auth": {"api_key": "old-key"}, "cfg": {}},
        {"auth": {"api_key": "new-key"}, "cfg": {"password": "hunter2", "user": "ada"}},
    )
    shown = [present.change_view(c) for c in diff.changes]
    assert shown[0].old.text == "[redacted]" and shown[0].new.text == "[redacted]"
    text = shown[1].new.text + shown[2].new.text if len(shown) > 2 else shown[1].new.text
    assert "hunter2" not in text and "ada" in text


def test_resolve_reads_a_pointer():
    doc = {"a/b": [{"c": 1}]}
    assert diffview.resolve(doc, "/a~1b/0/c") == 1
    assert diffview.resolve(doc, "/a~1b/7") is diffview.MISSING
    assert diffview.resolve(doc, "") == doc


# --- the page -----------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_diff_between_two_checkpoints_shows_the_appended_message(as_operator):
    run = waiting_run("Diff?")
    url = reverse("dashboard:diff", args=[run.id])
    html = text_of(as_operator.get(url, {"a": 0, "b": 2}))
    assert "+3 added" in html and "~1 changed" in html
    assert 'class="bubble role-assistant"' in html and "An answer to: Diff?" in html
    assert 'class="bubble role-tool"' in html and "paid" in html
    split = text_of(as_operator.get(url, {"a": 0, "b": 2, "view": "split"}))
    assert 'class="changes layout-split"' in split and 'class="sides"' in split
    # The default is the head against the checkpoint before it.
    default = as_operator.get(url)
    assert default.context["a_cp"].seq == 1 and default.context["b_cp"].seq == 2


@pytest.mark.django_db(transaction=True)
def test_diff_with_a_fork_across_runs(as_operator):
    run = waiting_run("Fork diff?")
    state = operations.state_at(run.id, 1)
    state["messages"].insert(0, {"role": "system", "content": "Be brief."})
    state["count"] = 7
    fork = operations.fork(run.id, 1, state=state, by="olive", reason="try a system prompt")
    fork = drive(fork.id)
    # A fork's first checkpoint compares with the checkpoint it came from by default.
    response = as_operator.get(reverse("dashboard:diff", args=[fork.id]), {"b": 0})
    assert response.context["a_run"].id == run.id and response.context["a_cp"].seq == 1
    html = text_of(response)
    assert "across runs" in html and "Be brief." in html and "/messages/0" in html
    assert "+1 added" in html and "~1 changed" in html
    # Any two checkpoints of the two runs.
    other = as_operator.get(
        reverse("dashboard:diff", args=[run.id]),
        {"a": 2, "b_run": str(fork.id), "b": fork.head_seq},
    )
    assert other.status_code == 200 and "across runs" in text_of(other)


@pytest.mark.django_db(transaction=True)
def test_long_text_word_diff_loads_on_expand(as_operator):
    before = "Leases expire. " * 10 + "A fencing token orders writers."
    run = waiting_run("Words?", extra={"draft": before})
    state = operations.state_at(run.id, 2)
    state["draft"] = before.replace("orders writers", "orders every writer")
    fork = operations.fork(run.id, 2, state=state, by="olive")
    url = reverse("dashboard:diff", args=[fork.id])
    html = text_of(as_operator.get(url, {"b": 0}))
    assert "word diff" in html
    words = as_operator.get(
        reverse("dashboard:diff_words", args=[fork.id]),
        {"a_run": str(run.id), "a": 2, "b_run": str(fork.id), "b": 0, "path": "/draft"},
        HTTP_HX_REQUEST="true",
    )
    text = text_of(words)
    assert "<del>writers</del><ins>every writer</ins>" in text


@pytest.mark.django_db(transaction=True)
def test_diff_pages_through_many_changes(as_operator):
    run = waiting_run("Many?", extra={"items": []})
    state = operations.state_at(run.id, 2)
    state["items"] = [{"n": i} for i in range(450)]
    fork = operations.fork(run.id, 2, state=state, by="olive")
    url = reverse("dashboard:diff", args=[fork.id])
    first = as_operator.get(url, {"b": 0})
    assert first.context["shown_to"] == 200 and "offset=200" in first.context["next_url"]
    last = as_operator.get(url, {"b": 0, "a_run": str(run.id), "a": 2, "offset": 400})
    assert last.context["shown_to"] == 450 and last.context["next_url"] == ""
    assert text_of(last).count('class="change change-added"') == 50


@pytest.mark.django_db(transaction=True)
def test_bad_input_is_a_clear_404(as_operator):
    run = waiting_run()
    url = reverse("dashboard:diff", args=[run.id])
    assert as_operator.get(url, {"a": 99}).status_code == 404
    assert as_operator.get(url, {"a": 0, "a_run": "feedface"}).status_code == 404
    assert as_operator.get(url, {"a": "x"}).status_code == 404


def test_front_inserts_appends_and_edits_in_one_list_are_aligned_not_rewritten():
    old = [{"role": "user", "content": f"m{i}"} for i in range(10)]
    new = [{"role": "system", "content": "first"}] + [dict(m) for m in old]
    new += [{"role": "assistant", "content": "last"}]
    new[5]["content"] = "m4 edited"  # old[4], shifted by one
    diff = diffview.compare({"messages": old}, {"messages": new})
    assert kinds(diff) == [
        ("added", "/messages/0"),
        ("changed", "/messages/5/content"),
        ("added", "/messages/11"),
    ]
    assert (diff.changes[1].old, diff.changes[1].new) == ("m4", "m4 edited")


def test_aligned_elements_still_tell_1_from_true():
    old = [{"n": 1}, {"n": 2}, {"n": 3}]
    new = [{"n": 0}, {"n": True}, {"n": 2}, {"n": 3}, {"n": 4}]
    diff = diffview.compare(old, new)
    # {"n": True} is not taken for the old {"n": 1}: it is new.
    assert kinds(diff) == [("changed", "/0/n"), ("added", "/1"), ("added", "/4")]
