"""Start a run from the dashboard: the same ``operations.start`` as the CLI and the API,
behind the operator role, with every refusal shown next to the field at fault.

The engine decides what is valid (the agent exists, the input passes its schema, the level
can be honoured, the idempotency key is not reused for other input); this page only turns
the form into that call and its coded errors into sentences beside the fields."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import messages
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_http_methods

from dashboard import params
from dashboard.forms import StartForm
from dashboard.permissions import OPERATORS, denied
from dashboard.submissions import AlreadySubmitted, spend
from dashboard.views.common import explain, page, wants_fragment
from durability import operations
from durability.agents import Agent, registry
from durability.errors import DurabilityError, IdempotencyConflict, NotAllowed, UnknownAgent
from durability.models import Durability, Run
from durability.roles import require_operator

NOT_OPERATOR = (
    "Only operators may start runs. Your account can view runs but not change them; ask an"
    f' administrator to add you to the "{OPERATORS}" group.'
)

# Deep enough for any input form a person types; a recursive schema stops here.
EXAMPLE_DEPTH = 6


@require_http_methods(["GET", "POST"])
def start(request: HttpRequest) -> HttpResponse:
    agents = registry.all()
    if request.method == "POST":
        # The page is open to viewers (its button disabled, saying why); starting is not.
        try:
            require_operator(request.user)
        except NotAllowed:
            return denied(request, NOT_OPERATOR)
        return _start_post(request, agents)
    wanted = params.text(request.GET, "agent", 200)
    chosen = _find(agents, wanted) or (agents[0] if agents else None)
    notice = ""
    if wanted and _find(agents, wanted) is None:
        notice = f"There is no agent named “{wanted}”; choose one below."
    form = StartForm(
        initial={"agent": chosen.name if chosen else "", "input": _prefill(chosen)},
        agents=_agent_choices(agents),
        levels=_levels(chosen),
    )
    context = {**_context(agents, chosen, form, notice=notice), "oob": wants_fragment(request)}
    # The agent picker asks for the region that depends on the agent (its description,
    # schema and default level), leaving what the operator typed where it is.
    return page(request, "dashboard/start.html", context, fragment="agent")


def _start_post(request: HttpRequest, agents: list[Agent]) -> HttpResponse:
    chosen = _find(agents, request.POST.get("agent", ""))
    form = StartForm(request.POST, agents=_agent_choices(agents), levels=_levels(chosen))
    if not form.is_valid():
        return page(request, "dashboard/start.html", _context(agents, chosen, form), status=422)
    data = form.cleaned_data
    who = request.user.get_username()
    key = data["idempotency_key"]
    before = None
    if key:  # the run this key already started, if any: a repeat is told so
        before = Run.objects.filter(idempotency_key=key).values_list("id", flat=True).first()
    try:
        with transaction.atomic():
            # The form's one-time token, spent with the start: a double click starts one run.
            sub = spend(data["token"], action="start", username=who) if data["token"] else None
            run = operations.start(
                data["agent"],
                data["input"],
                by=who,
                reason=data["reason"],
                idempotency_key=key,
                durability=data["durability"] or None,
            )
            if sub is not None:
                sub.outcome = f"It started run {run.id}."
                sub.result_run_id = run.id
                sub.save(update_fields=["outcome", "result_run_id"])
    except AlreadySubmitted as dup:
        return _already_submitted(request, dup, form, agents, chosen)
    except DurabilityError as exc:
        form.add_error(_field_for(exc), explain(exc))
        return page(request, "dashboard/start.html", _context(agents, chosen, form), status=422)
    if key and before == run.id:
        messages.warning(
            request,
            f"Nothing new was started: the idempotency key “{key}” already started this run"
            " with the same input.",
        )
    else:
        messages.success(
            request, f"Started run {run.short_id} of {run.agent}; a worker picks it up shortly."
        )
    return redirect("dashboard:run", ref=str(run.id))


def _already_submitted(
    request: HttpRequest,
    dup: AlreadySubmitted,
    form: StartForm,
    agents: list[Agent],
    chosen: Agent | None,
) -> HttpResponse:
    first = dup.first
    said = f"This form was already submitted by {first.username}; nothing new was started."
    if first.result_run_id is not None:
        messages.warning(request, said)
        return redirect("dashboard:run", ref=str(first.result_run_id))
    form.add_error(None, said)
    return page(request, "dashboard/start.html", _context(agents, chosen, form), status=409)


def _field_for(exc: DurabilityError) -> str | None:
    """The form field an engine refusal is about, so its sentence is shown beside it."""
    if isinstance(exc, UnknownAgent):
        return "agent"
    if isinstance(exc, IdempotencyConflict):
        return "idempotency_key"
    text = exc.message
    if text.startswith("durability "):
        return "durability"
    if text.startswith("an idempotency key"):
        return "idempotency_key"
    if "one-time token" in text:
        return None
    # Schema violations, oversized input, an initial state the agent refused: the input.
    return "input"


def _find(agents: list[Agent], name: str) -> Agent | None:
    return next((a for a in agents if a.name == name), None)


def _agent_choices(agents: list[Agent]) -> list[tuple[str, str]]:
    return [
        (a.name, f"{a.name}@{a.version}" + (f" · {a.description}" if a.description else ""))
        for a in agents
    ]


def _levels(agent: Agent | None) -> list[tuple[str, str]]:
    """The levels a run of ``agent`` may be started with: a graph's refuses ``periodic``."""
    own = f"the agent's own ({agent.durability})" if agent is not None else "the agent's own"
    refused = agent.refused_levels if agent is not None else {}
    return [("", own), *((v, label) for v, label in Durability.choices if v not in refused)]


def _context(
    agents: list[Agent], chosen: Agent | None, form: StartForm, *, notice: str = ""
) -> dict[str, Any]:
    schema = input_schema(chosen) if chosen is not None else None
    return {
        "nav": "runs",
        "form": form,
        "agents": agents,
        "chosen": chosen,
        "notice": notice,
        "not_operator": NOT_OPERATOR,
        "schema": json.dumps(schema, indent=2, sort_keys=True) if schema else "",
        "graph": getattr(chosen, "langgraph_state", False),
        "example": _prefill(chosen) if schema else "",
    }


def input_schema(agent: Agent) -> dict | None:
    """The agent's input schema as a JSON Schema document (a pydantic model's own), or None."""
    schema = agent.input_schema
    if schema is None:
        return None
    if hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    return dict(schema) if isinstance(schema, dict) else None


def _prefill(agent: Agent | None) -> str:
    schema = input_schema(agent) if agent is not None else None
    if not schema:
        return "{}"
    value = example(schema, schema)
    return json.dumps({} if value is None else value, indent=2, ensure_ascii=False)


def example(node: Any, root: dict, depth: int = 0) -> Any:
    """A value shaped like ``node`` (a JSON Schema): its own example or default where it
    gives one, else an empty value of its type; objects get their required properties (all
    of them when none is required). A starting point to edit, not a promise it validates."""
    if not isinstance(node, dict) or depth > EXAMPLE_DEPTH:
        return None
    node = _resolved(node, root)
    for key in ("examples", "enum"):
        if isinstance(node.get(key), list) and node[key]:
            return node[key][0]
    for key in ("example", "default", "const"):
        if key in node:
            return node[key]
    for key in ("anyOf", "oneOf", "allOf"):
        variants = [v for v in node.get(key) or [] if _resolved(v, root).get("type") != "null"]
        if variants:
            return example(variants[0], root, depth + 1)
    kind = node.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "object" or "properties" in node:
        props = node.get("properties") or {}
        names = [n for n in node.get("required") or [] if n in props] or list(props)
        return {n: example(props[n], root, depth + 1) for n in names}
    if kind == "array":
        if node.get("minItems"):
            return [example(node.get("items"), root, depth + 1)]
        return []
    blank: dict[Any, Any] = {"string": "", "boolean": False, "null": None}
    if kind in ("integer", "number"):
        return node.get("minimum", 0)
    return blank.get(kind)


def _resolved(node: Any, root: dict) -> dict:
    """``node`` with a local ``$ref`` (``#/$defs/X``, pydantic's nested models) followed."""
    if not isinstance(node, dict):
        return {}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        if isinstance(target, dict):
            return target
    return node
