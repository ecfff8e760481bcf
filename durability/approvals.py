"""Approve with edits: which fields of an approval's payload an operator may edit, their
schema, and the agent's check, applied when the decision is recorded.

The agent asks with ``ctx.approval(name, payload, editable=Model, validate=fn)``. The
schema of the editable fields is stored with the approval as JSON Schema (``Approval.editable``),
so the web process and the CLI, which decide, need nothing from the worker that asked.

The check is code, and it runs where the decision is made (the web process or the CLI), not
in the worker. It is stored by its qualified name (``module:qualname``) under
``x-durability-check`` in that schema and looked up again at decision time. Why a name and
not a registration on the agent: the check belongs to the call that asks (two approvals of
one agent check different things), and the agent definition stays as it is. Why restricted
to the modules that define the agent's steps: the name is read back from a database row, and
a row must never be able to name arbitrary code to run (``os:system``); the agent's own
modules are imported by every process that serves it (``DURABILITY_AGENT_MODULES``). A check
that cannot be found there is a refusal that says so, never a silent approval.

Without ``editable`` every field stays editable, typed by its asked value, as before; an
agent that names its editable fields gets only those on the form, the others read-only, and
a decision that changes a read-only field is refused. ``editable=False``: nothing may be
edited, the approval is approved or rejected as asked (the engine's own question before
repeating an effect is one: what it performs is what it showed).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from durability import canonical
from durability.errors import InvalidInput
from durability.redact import is_secret_key

CHECK_KEY = "x-durability-check"
# Stored for ``editable=False``: no field may be edited.
READ_ONLY_KEY = "x-durability-read-only"
# One change's value as shown in an event and the audit log; the full payloads stay on the
# approval row.
SHOWN_CHARS = 200

Check = Callable[[Any, Any], "str | None"]


class EditRefused(InvalidInput):
    """An edited payload that the agent's schema or check refuses, or that changes a field
    the agent did not offer for editing. Nothing was recorded; the approval still waits."""

    code = "DUR113"


# --- when the agent asks ---------------------------------------------------------------------


def spec_for(
    name: str, payload: Any, editable: Any, validate: Check | None, modules: set[str]
) -> str:
    """What ``Approval.editable`` stores for this ask (canonical JSON; "" when the agent gave
    neither). Raises ``ValueError`` with a sentence for the agent's author when the schema or
    the check cannot be used: that is a bug in the agent, found on the first ask."""
    if editable is None and validate is None:
        return ""
    if editable is False:
        if validate is not None:
            raise ValueError(
                f"approval {name!r}: validate checks edits, and editable=False allows none"
            )
        return canonical.dumps({READ_ONLY_KEY: True}).decode()
    schema: dict[str, Any] = {}
    if editable is not None:
        schema = _as_json_schema(name, editable)
        fields = schema.get("properties")
        if not isinstance(fields, dict) or not fields:
            raise ValueError(
                f"approval {name!r}: editable must name the fields an operator may edit"
                " (a pydantic model, or a JSON Schema of an object with properties)"
            )
        if not isinstance(payload, dict):
            raise ValueError(f"approval {name!r}: editable fields need a payload that is a dict")
        missing = sorted(k for k in fields if k not in payload)
        if missing:
            raise ValueError(
                f"approval {name!r}: editable names {', '.join(missing)}, not in the payload"
            )
        secret = sorted(k for k in fields if is_secret_key(k))
        if secret:
            raise ValueError(
                f"approval {name!r}: {', '.join(secret)} is a secret and cannot be editable"
            )
    if validate is not None:
        schema[CHECK_KEY] = check_name(name, validate, modules)
    return canonical.dumps(schema).decode()


def _as_json_schema(name: str, editable: Any) -> dict[str, Any]:
    from pydantic import BaseModel

    if isinstance(editable, type) and issubclass(editable, BaseModel):
        schema = editable.model_json_schema()
    elif isinstance(editable, Mapping):
        schema = dict(editable)
    else:
        raise ValueError(
            f"approval {name!r}: editable must be a pydantic model class or a JSON Schema dict,"
            f" not {type(editable).__name__}"
        )
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(
            f"approval {name!r}: editable is not a valid JSON Schema: {exc.message}"
        ) from None
    canonical.check_json(schema, what=f"editable schema of approval {name!r}")
    return schema


def check_name(name: str, fn: Check, modules: set[str]) -> str:
    """``module:qualname`` of the check, if that name finds this very function again in one
    of the agent's modules."""
    module = getattr(fn, "__module__", None) or ""
    qualname = getattr(fn, "__qualname__", "") or ""
    if not callable(fn) or "<" in qualname:
        raise ValueError(
            f"approval {name!r}: validate must be a function defined at the top level of a"
            f" module (it runs where the decision is made, found by its name), not {qualname!r}"
        )
    if module not in modules:
        raise ValueError(
            f"approval {name!r}: validate must be defined in a module of the agent's steps"
            f" ({', '.join(sorted(modules)) or 'none'}), not in {module!r}"
        )
    if _lookup(module, qualname) is not fn:
        raise ValueError(
            f"approval {name!r}: validate {module}:{qualname} cannot be found again by its name"
        )
    return f"{module}:{qualname}"


def agent_modules(agent: Any) -> set[str]:
    """The modules that define an agent's steps: where its checks may live."""
    if agent is None:
        return set()
    return {getattr(fn, "__module__", "") for fn in agent.steps.values()} - {""}


def _lookup(module: str, qualname: str) -> Any:
    """The function ``qualname`` defined in ``module``, or None. Defined there, not only
    reachable from there: ``examples.agents:os.system`` names a function the module imported,
    and is refused."""
    if not qualname or any(
        part.startswith("_") and part.endswith("__") for part in qualname.split(".")
    ):
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    if not callable(found) or getattr(found, "__module__", None) != module:
        return None
    if getattr(found, "__qualname__", None) != qualname:
        return None
    return found


# --- when an operator decides ----------------------------------------------------------------


def load_spec(text: str) -> dict[str, Any] | None:
    return canonical.loads(text) if text else None


def editable_fields(text: str) -> list[str] | None:
    """The fields an operator may edit, in the agent's order; None: all of them (the agent
    did not say); empty: none (``editable=False``)."""
    spec = load_spec(text)
    if spec and spec.get(READ_ONLY_KEY):
        return []
    fields = spec.get("properties") if spec else None
    return list(fields) if isinstance(fields, dict) else None


def takes_edits(text: str) -> bool:
    """Whether an operator may approve with edits at all (not ``editable=False``)."""
    return editable_fields(text) != []


def field_schemas(text: str) -> dict[str, dict[str, Any]]:
    spec = load_spec(text) or {}
    fields = spec.get("properties")
    return dict(fields) if isinstance(fields, dict) else {}


def complete(text: str, asked: Any, edited: Any) -> Any:
    """An edit of an object may give only the fields it changes: the fields it leaves out
    keep their asked values (``--payload '{"amount_eur": 200}'`` on the command line), with
    editable fields named or not (a LangGraph ``interrupt()``'s value names none)."""
    if isinstance(asked, dict) and isinstance(edited, dict):
        return {**asked, **edited}
    return edited


def _kind(value: Any) -> str:
    """A JSON value's type as a person reads it: whole and decimal numbers are one kind."""
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return "null"


def _check_kinds(name: str, asked: Any, edited: Any, run_id: Any) -> None:
    """Without a schema, each field keeps its asked value's type (and the payload its own):
    an amount asked as a number is not approved as text. A field asked as null takes any."""
    pairs = [("the payload", asked, edited)]
    if isinstance(asked, dict) and isinstance(edited, dict):
        pairs = [(repr(k), asked[k], edited[k]) for k in asked if k in edited]
    for what, was, now in pairs:
        if was is not None and _kind(was) != _kind(now):
            raise EditRefused(
                f"approval {name!r}: {what} was asked as {_kind(was)}, so it must stay"
                f" {_kind(was)}, not {_kind(now)} ({canonical.dumps(now).decode()[:60]});"
                " nothing was recorded",
                run_id=run_id,
                field=what.strip("'") if what != "the payload" else "",
            )


def check_edit(approval: Any, agent_name: str, asked: Any, edited: Any) -> None:
    """Raise ``EditRefused`` unless the agent accepts ``edited`` in place of ``asked``:
    read-only fields unchanged, editable ones valid under the schema, and the agent's check
    (if any) returning no error. Both payloads are as stored (secret values redacted)."""
    spec = load_spec(approval.editable)
    if spec is None:
        _check_kinds(approval.name, asked, edited, approval.run_id)
        return
    run_id, name = approval.run_id, approval.name
    if spec.get(READ_ONLY_KEY):
        raise EditRefused(
            f"approval {name!r} cannot be edited: approve it as asked, or reject it; nothing"
            " was recorded",
            run_id=run_id,
        )
    fields = spec.get("properties")
    if isinstance(fields, dict):
        if not isinstance(edited, dict) or not isinstance(asked, dict):
            raise EditRefused(
                f"approval {name!r}: the edited payload must be an object with the fields"
                f" {', '.join(fields)}",
                run_id=run_id,
            )
        missing = object()
        read_only = [
            k
            for k in [*asked, *(k for k in edited if k not in asked)]
            if k not in fields and asked.get(k, missing) != edited.get(k, missing)
        ]
        if read_only:
            raise EditRefused(
                f"approval {name!r}: {', '.join(read_only)}"
                f" {'is' if len(read_only) == 1 else 'are'} read-only; the agent lets you edit"
                f" only {', '.join(fields)}",
                run_id=run_id,
                field=read_only[0],
            )
        schema = {k: v for k, v in spec.items() if k != CHECK_KEY}
        _check_schema(name, schema, {k: edited[k] for k in fields if k in edited}, run_id)
    ref = spec.get(CHECK_KEY)
    if ref:
        check = resolve_check(name, agent_name, str(ref), run_id)
        try:
            problem = check(asked, edited)
        except Exception as exc:  # the agent's code: its failure refuses, never approves
            raise EditRefused(
                f"approval {name!r}: the agent's check {ref} failed ({type(exc).__name__}:"
                f" {exc}); nothing was recorded",
                run_id=run_id,
            ) from None
        if problem:
            raise EditRefused(str(problem), run_id=run_id)


def _check_schema(name: str, schema: dict, value: dict, run_id: Any) -> None:
    import jsonschema

    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(value), key=lambda e: list(e.path))
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in first.path)
        raise EditRefused(
            f"{where or name}: {first.message}" if where else first.message,
            run_id=run_id,
            field=str(first.path[0]) if first.path else "",
        )


def resolve_check(name: str, agent_name: str, ref: str, run_id: Any = None) -> Check:
    """The agent's check named ``ref``, found only among the agent's modules in this
    process; ``EditRefused`` saying why when it cannot be."""
    from durability.agents import registry
    from durability.errors import UnknownAgent

    try:
        agent = registry.get(agent_name)
    except UnknownAgent:
        raise EditRefused(
            f"approval {name!r}: agent {agent_name} is not loaded in this process, so its check"
            f" {ref} cannot run; nothing was recorded (add the agent's module to"
            " DURABILITY_AGENT_MODULES)",
            run_id=run_id,
        ) from None
    module, _, qualname = ref.partition(":")
    found = _lookup(module, qualname) if module in agent_modules(agent) else None
    if found is None:
        raise EditRefused(
            f"approval {name!r}: the agent's check {ref} cannot be found among the modules of"
            f" agent {agent_name} in this process; nothing was recorded",
            run_id=run_id,
        )
    return found


# --- showing what changed --------------------------------------------------------------------


def changes(asked: Any, decided: Any) -> list[dict[str, Any]]:
    """What the operator changed, field by field (top-level keys of an object; the whole
    value otherwise), each value as short JSON text: ``[{"field", "asked", "decided"}]``."""
    if isinstance(asked, dict) and isinstance(decided, dict):
        keys = [*asked, *(k for k in decided if k not in asked)]
        missing = object()
        return [
            {
                "field": k,
                "asked": _short(asked.get(k, missing), missing),
                "decided": _short(decided.get(k, missing), missing),
            }
            for k in keys
            if asked.get(k, missing) != decided.get(k, missing)
        ]
    if asked == decided:
        return []
    return [{"field": "", "asked": _short(asked), "decided": _short(decided)}]


def _short(value: Any, missing: object = None) -> str:
    if missing is not None and value is missing:
        return "(absent)"
    text = canonical.dumps(value).decode()
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


def describe(found: list[dict[str, Any]]) -> str:
    """``amount_eur 349.0 → 200.0; note "" → "partial"``."""
    return "; ".join(
        f"{c['field'] + ' ' if c.get('field') else ''}{c.get('asked')} → {c.get('decided')}"
        for c in found
    )


def stored_changes(approval: Any) -> list[dict[str, Any]]:
    """The changes of a decided approval, read from its two stored payloads."""
    if not approval.edited_payload:
        return []
    try:
        return changes(canonical.loads(approval.payload), canonical.loads(approval.edited_payload))
    except ValueError:
        return []
