"""Starting a run from the dashboard (``/runs/new/``): an operator starts one and lands on
its page; a viewer is refused and nothing is created; bad input (JSON that does not parse,
input failing the agent's schema, an unknown agent, a reused idempotency key, a bad level)
gets the engine's sentence next to the field at fault, keeps what was typed, and creates
nothing; the audit event names the operator."""

from __future__ import annotations

import json

import pytest
from django.test import Client
from django.urls import reverse
from pydantic import BaseModel

from dashboard.views.start import example
from durability import Agent, registry
from durability.models import Event, EventKind, Run
from tests import langgraph_agents as graphs
from tests.dashboard_helpers import (
    as_operator,
    as_viewer,
    csrf_from,
    dash_agents,
    form_token,
    make_user,
    operator,
    text_of,
    viewer,
)

pytestmark = pytest.mark.django_db(transaction=True)
__all__ = ["as_operator", "as_viewer", "dash_agents", "operator", "viewer"]

URL = "/runs/new/"

INPUT_SCHEMA = {
    "type": "object",
    "required": ["question", "depth"],
    "properties": {
        "question": {"type": "string", "examples": ["Why is the sky blue?"]},
        "depth": {"type": "integer", "minimum": 1},
        "notes": {"type": "string"},
    },
    "additionalProperties": False,
}


class Ticket(BaseModel):
    order: str
    amount_eur: float


def _noop(state: dict, ctx) -> str:
    return "end"


@pytest.fixture(autouse=True)
def start_agents(dash_agents):
    asker = Agent(
        "asker",
        version="3",
        input_schema=INPUT_SCHEMA,
        description="answers one question",
        durability="relaxed",
    )
    asker.step(_noop, name="answer", start=True)
    refunds = Agent("refunds", input_schema=Ticket, description="refunds an order")
    refunds.step(_noop, name="refund", start=True)
    yield
    registry.unregister("asker")
    registry.unregister("refunds")


def post(client: Client, **fields) -> object:
    data = {"agent": "asker", "input": '{"question": "Why?", "depth": 2}', **fields}
    return client.post(URL, data)


@pytest.mark.parametrize("name", ["support", "research", "concierge"])
def test_a_demo_agents_prefilled_example_starts_a_run_and_a_misspelt_field_is_refused(name):
    from dashboard.views.start import _prefill
    from durability import operations
    from durability.errors import SchemaViolation

    value = json.loads(_prefill(registry.get(name)))
    assert operations.start(name, value).agent == name  # what the form offers is accepted
    if name != "concierge":
        with pytest.raises(SchemaViolation):
            operations.start(name, {**value, "slowms": 800})


def test_the_page_lists_every_agent_and_prefills_an_example(as_operator):
    assert reverse("dashboard:start") == URL
    html = text_of(as_operator.get(URL + "?agent=asker"))
    assert "asker@3 · answers one question" in html
    assert "dash-chain@2" in html and "refunds@1 · refunds an order" in html
    assert '<option value="asker" selected>' in html
    # An example built from the input schema: its own example, the minimum, required only.
    textarea = html.split('name="input"', 1)[1].split("</textarea>", 1)[0]
    assert "Why is the sky blue?" in textarea and "&quot;depth&quot;: 1" in textarea
    assert "notes" not in textarea
    assert "the agent&#x27;s own (relaxed)" in html  # the default level, named
    assert "the same key and input start nothing new" in html.lower()
    assert "Starts a new run of <strong>asker</strong>" in html
    assert "nothing else changes" in html


def test_a_pydantic_input_schema_gives_an_example_too(as_operator):
    html = text_of(as_operator.get(URL + "?agent=refunds"))
    textarea = html.split('name="input"', 1)[1].split("</textarea>", 1)[0]
    assert "&quot;order&quot;: &quot;&quot;" in textarea
    assert "&quot;amount_eur&quot;: 0" in textarea
    assert "refunds input schema" in html


def test_the_example_follows_refs_and_stops_on_recursion():
    schema = {
        "$defs": {
            "Node": {
                "type": "object",
                "required": ["next"],
                "properties": {"next": {"$ref": "#/$defs/Node"}},
            }
        },
        "$ref": "#/$defs/Node",
    }
    value = example(schema, schema)
    depth = 0
    while isinstance(value, dict):
        value, depth = value["next"], depth + 1
    assert value is None and 3 < depth < 10


def test_the_agent_picker_swaps_only_the_agent_region(as_operator):
    response = as_operator.get(URL + "?agent=refunds", HTTP_HX_REQUEST="true")
    html = text_of(response)
    assert 'id="agent-help"' in html and "refunds input schema" in html
    assert 'name="input"' not in html  # what the operator typed stays
    assert 'id="start-consequence" hx-swap-oob="true"' in html
    # The level's default is the agent's own: its select follows the agent too.
    assert 'id="start-levels" class="stack" hx-swap-oob="true"' in html
    assert "the agent&#x27;s own (strict)" in html


def test_an_unknown_agent_in_the_link_is_said(as_operator):
    html = text_of(as_operator.get(URL + "?agent=nope"))
    assert "There is no agent named “nope”" in html


@pytest.mark.smoke
def test_an_operator_starts_a_run_and_lands_on_its_page(as_operator):
    page = text_of(as_operator.get(URL))
    response = as_operator.post(
        URL,
        {
            "agent": "asker",
            "input": '{"question": "Why?", "depth": 2}',
            "reason": "a customer asked",
            "token": form_token(page),
        },
    )
    run = Run.objects.get()
    assert response.status_code == 302
    assert response["Location"] == reverse("dashboard:run", args=[run.id])
    assert run.agent == "asker" and run.agent_version == "3" and run.created_by == "olive"
    assert json.loads(run.input) == {"question": "Why?", "depth": 2}
    event = Event.objects.get(run=run, kind=EventKind.CREATED)
    assert event.actor == "olive" and event.reason == "a customer asked"
    landed = text_of(as_operator.get(response["Location"]))
    assert "Started run" in landed


def test_a_double_submit_starts_one_run(as_operator):
    token = form_token(text_of(as_operator.get(URL)))
    first = post(as_operator, token=token)
    second = post(as_operator, token=token)
    run = Run.objects.get()
    assert first["Location"] == second["Location"] == reverse("dashboard:run", args=[run.id])
    assert "already submitted" in text_of(as_operator.get(second["Location"]))


def test_the_level_chosen_is_the_runs(as_operator):
    post(as_operator, durability="strict")
    run = Run.objects.get()
    assert run.durability == "strict"


def test_a_viewer_sees_the_button_disabled_and_is_refused(as_viewer):
    html = text_of(as_viewer.get(URL))
    assert 'disabled title="operators only">Start the run' in html
    assert "Only operators may start runs" in html
    response = post(as_viewer)
    assert response.status_code == 403
    assert "Only operators may start runs" in text_of(response)
    assert Run.objects.count() == 0 and Event.objects.count() == 0


def test_an_account_with_no_role_gets_the_no_role_page(db):
    nobody = Client()
    nobody.force_login(make_user("nora", None))
    for response in (nobody.get(URL), post(nobody)):
        assert response.status_code == 403
        assert "has no role" in text_of(response)
    assert Run.objects.count() == 0


def test_csrf_is_enforced(operator):
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    assert post(client).status_code == 403
    token = csrf_from(text_of(client.get(URL)))
    assert post(client, csrfmiddlewaretoken=token).status_code == 302
    assert Run.objects.count() == 1


def _refused(response, field_error_id: str) -> str:
    assert response.status_code == 422
    assert Run.objects.count() == 0 and Event.objects.count() == 0
    html = text_of(response)
    assert f'id="{field_error_id}"' in html, html
    return html.split(f'id="{field_error_id}">', 1)[1].split("</div>", 1)[0]


def test_json_that_does_not_parse_says_where(as_operator):
    typed = '{"question": "Why?",\n "depth": }'
    response = post(as_operator, input=typed)
    said = _refused(response, "input-error")
    assert "the input is not valid JSON" in said and "line 2, column 11" in said
    assert '"depth": }' in text_of(response).replace("&quot;", '"')  # kept as typed


def test_a_number_too_long_to_read_is_refused_not_a_server_error(as_operator):
    """Python's parser refuses integers of more than 4,300 digits with a ValueError of its
    own, not a JSONDecodeError: the page says so at the field, creating nothing."""
    said = _refused(post(as_operator, input='{"question": ' + "9" * 4301 + "}"), "input-error")
    assert "a number of more than 4,300 digits" in said and "write it as a string" in said


def test_input_failing_the_schema_gets_the_engines_message_with_its_path(as_operator):
    response = post(as_operator, input='{"question": "Why?", "depth": 0}')
    said = _refused(response, "input-error")
    assert "DUR102" in said and "/depth" in said and "minimum" in said
    assert "&quot;depth&quot;: 0" in text_of(response)


def test_an_unknown_agent_is_refused_beside_the_picker(as_operator):
    said = _refused(post(as_operator, agent="ghost"), "agent-error")
    assert "unknown agent &#x27;ghost&#x27;" in said and "DUR101" in said


def test_a_bad_durability_level_is_refused_beside_its_field(as_operator):
    said = _refused(post(as_operator, durability="eventually"), "durability-error")
    assert "durability must be one of" in said and "DUR100" in said


def test_the_same_key_and_input_start_nothing_new(as_operator):
    first = post(as_operator, idempotency_key="order-17")
    again = post(as_operator, idempotency_key="order-17")
    run = Run.objects.get()
    assert first["Location"] == again["Location"] == reverse("dashboard:run", args=[run.id])
    landed = text_of(as_operator.get(again["Location"]))
    assert "Nothing new was started" in landed and "order-17" in landed
    assert Event.objects.filter(kind=EventKind.CREATED).count() == 1


def test_the_same_key_with_other_input_is_a_conflict(as_operator):
    post(as_operator, idempotency_key="order-17")
    before = (Run.objects.count(), Event.objects.count())
    response = post(
        as_operator, idempotency_key="order-17", input='{"question": "Other?", "depth": 2}'
    )
    assert response.status_code == 422
    assert (Run.objects.count(), Event.objects.count()) == before
    html = text_of(response)
    said = html.split('id="idempotency-error">', 1)[1].split("</div>", 1)[0]
    assert "DUR115" in said and "order-17" in said
    assert 'value="order-17"' in html and "Other?" in html


def test_a_graph_registered_as_an_agent_is_startable_the_same_way(as_operator):
    assert '<option value="lg-support"' in text_of(as_operator.get(URL))
    response = as_operator.post(
        URL, {"agent": "lg-support", "input": json.dumps(graphs.first_input())}
    )
    run = Run.objects.get()
    assert response["Location"] == reverse("dashboard:run", args=[run.id])
    assert run.agent == "lg-support" and run.created_by == "olive"
    # The form says what a graph's input is, and offers no level a graph refuses.
    page = text_of(as_operator.get(URL, {"agent": "lg-support"}))
    assert "lg-support is a LangGraph graph: its input is the graph's first values" in page
    assert '<option value="periodic"' not in page and '<option value="relaxed"' in page
    # Input the graph does not take is refused next to the field, and starts nothing.
    refused = as_operator.post(URL, {"agent": "lg-support", "input": '"hello"'})
    assert refused.status_code == 422 and "the graph does not take it" in text_of(refused)
    assert Run.objects.count() == 1


def test_the_runs_list_offers_the_button_to_operators_only(as_operator, as_viewer):
    mine = text_of(as_operator.get(reverse("dashboard:runs")))
    assert f'id="start-run" href="{URL}">Start a run</a>' in mine
    # The empty state links to the form as well as giving the command.
    assert f'<a href="{URL}">Start a run from this dashboard</a>' in mine
    theirs = text_of(as_viewer.get(reverse("dashboard:runs")))
    assert 'id="start-run" disabled' in theirs and "Only operators may start runs" in theirs


def test_a_form_with_a_broken_one_time_token_is_refused_whole(as_operator):
    response = post(as_operator, token="not-a-token")
    assert response.status_code == 422
    assert "no valid one-time token" in text_of(response)
    assert Run.objects.count() == 0 and Event.objects.count() == 0
