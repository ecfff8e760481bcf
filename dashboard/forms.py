"""Forms for operator actions. They check shape (JSON that parses, a reason where one is
required); the engine checks meaning (the agent's schema, the run's status) and its errors
are shown on the same form."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from django import forms
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from dashboard.params import ID_MAX, INT_MAX
from dashboard.submissions import new_token
from durability import approvals
from durability.redact import REDACTED, is_secret_key

REASON_MAX = 2000


class TokenField(forms.CharField):
    widget = forms.HiddenInput

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(required=False, **kwargs)


class VersionField(forms.IntegerField):
    """The run version the page showed (its fencing token): the engine refuses the action if
    the run moved on since, so a decision happens once however often it is posted. Optional
    here so that the view can refuse a form without it with a 400 and its own sentence."""

    widget = forms.HiddenInput

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(required=False, min_value=0, max_value=2**63 - 1, **kwargs)


# Deeper than any state an agent keeps, and well within what the engine walks recursively
# (redaction, canonical JSON: orjson stops at 255 levels).
MAX_JSON_DEPTH = 100


def parse_json(text: str, what: str) -> Any:
    """JSON from a text box, or a ValidationError that says where it breaks."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise forms.ValidationError(
            f"{what} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from None
    except ValueError:
        # The one other refusal of Python's parser: an integer of more digits than it
        # converts (sys.get_int_max_str_digits(), 4,300 by default).
        raise forms.ValidationError(
            f"{what} has a number of more than {sys.get_int_max_str_digits():,} digits,"
            " which cannot be read; write it as a string"
        ) from None
    except RecursionError:
        value = None
    else:
        if _depth_within(value, MAX_JSON_DEPTH):
            return value
    raise forms.ValidationError(
        f"{what} is nested too deeply (more than {MAX_JSON_DEPTH} levels)"
    ) from None


def _depth_within(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return False
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return True


class ReasonForm(forms.Form):
    reason = forms.CharField(max_length=REASON_MAX, required=False, widget=forms.TextInput)
    token = TokenField()
    # The run's status as the page showed it: acting on a run that changed meanwhile (a
    # colleague cancelled it) is refused. Absent, from a script: not checked.
    status = forms.CharField(max_length=16, required=False, widget=forms.HiddenInput)
    version = VersionField()

    def __init__(self, *args: Any, reason_required: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["reason"].required = reason_required
        self.initial.setdefault("token", new_token())


class RollbackForm(forms.Form):
    # Bounded by the columns: a larger number names nothing and the database would refuse it.
    checkpoint_id = forms.IntegerField(min_value=1, max_value=ID_MAX, widget=forms.HiddenInput)
    # The head the confirmation was shown for: if the run moved on meanwhile (another
    # operator acted, the run advanced), the confirmation is stale and is refused.
    expected_head = forms.IntegerField(min_value=0, max_value=INT_MAX, widget=forms.HiddenInput)
    expected_status = forms.CharField(max_length=16, required=False, widget=forms.HiddenInput)
    version = VersionField()
    # Needed to roll back, not to preview the choices made (``clean``): the browser would
    # otherwise refuse "Preview these choices" until a reason is typed.
    reason = forms.CharField(
        max_length=REASON_MAX,
        required=False,
        widget=forms.TextInput,
        help_text="Recorded in the audit log.",
    )
    then = forms.ChoiceField(
        choices=[
            ("hold", "Roll back and hold: nothing runs until someone continues it"),
            ("continue", "Roll back and continue at once"),
        ],
        initial="hold",
        required=False,  # absent (a script's form): hold, the safe default
        widget=forms.RadioSelect,
        label="Then",
    )
    token = TokenField()

    def __init__(self, *args: Any, effects: list | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial.setdefault("token", new_token())
        self.initial.setdefault("then", "hold")
        # One choice per effect done on the branch left behind: what the run does when it
        # reaches that effect again (DESIGN: "A rollback never repays on its own").
        self.effects = [e for e in effects or [] if not e.is_compensation]
        for e in self.effects:
            self.fields[f"effect-{e.id}"] = forms.ChoiceField(
                choices=e.choices, initial="ask", required=False, label=e.what
            )

    def effect_fields(self) -> list[tuple[Any, Any, Any]]:
        """(effect, its bound field, its select as HTML), for the template. The select is
        built here, escaped by ``format_html``: a hundred effects rendered through the
        widget templates cost the preview more than everything else on it."""
        rows = []
        for e in self.effects:
            field = self[f"effect-{e.id}"]
            chosen = str(field.value() or "ask")
            options = format_html_join(
                "",
                '<option value="{}"{}>{}</option>',
                (
                    (v, mark_safe(" selected") if v == chosen else "", label)
                    for v, label in e.choices
                ),
            )
            select = format_html(
                '<select name="{}" id="{}">{}</select>', field.html_name, field.auto_id, options
            )
            rows.append((e, field, select))
        return rows

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if self.data.get("action") != "preview" and not (data.get("reason") or "").strip():
            self.add_error("reason", "say why you roll back: it is recorded in the audit log")
        return data

    def decisions(self) -> dict[int, str]:
        """The operator's per-effect choices (valid once the form is)."""
        chosen = {}
        for e in self.effects:
            choice = self.cleaned_data.get(f"effect-{e.id}") or "ask"
            if choice != "ask":
                chosen[e.id] = choice
        return chosen


class ForkForm(forms.Form):
    from_seq = forms.IntegerField(min_value=0, max_value=INT_MAX, widget=forms.HiddenInput)
    state = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 24, "spellcheck": "false", "class": "code"}),
        help_text=(
            f'Edit the JSON. Values shown as "{REDACTED}" are kept as they are: leave them'
            " unchanged."
        ),
    )
    reason = forms.CharField(max_length=REASON_MAX, required=False, widget=forms.TextInput)
    # What-if by default: a fork is mostly a question ("what would it have done?"), and a
    # live one reaches customers, so it takes a second decision (``perform``).
    mode = forms.ChoiceField(
        choices=[
            (
                "what_if",
                "What-if: calls that match this run's recorded ones are reused, not paid"
                " again; effects are recorded, not performed. Nothing reaches a customer.",
            ),
            (
                "live",
                "Live: a real run. Its calls are made and its effects (payments, emails) are"
                " performed, under new idempotency keys.",
            ),
        ],
        initial="what_if",
        required=False,  # a form posted without it: what-if
        widget=forms.RadioSelect,
    )
    perform = forms.BooleanField(
        required=False, label="Yes, the new run performs its effects for real"
    )
    token = TokenField()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial.setdefault("token", new_token())

    def clean_state(self) -> Any:
        state = parse_json(self.cleaned_data["state"], "the state")
        if not isinstance(state, dict):
            raise forms.ValidationError("the state must be a JSON object ({...})")
        return state

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        data["mode"] = data.get("mode") or "what_if"
        if data["mode"] == "live" and not data.get("perform"):
            self.add_error(
                "perform",
                "a live fork performs its effects for real: tick this to confirm, or choose"
                " what-if",
            )
        return data


class ResolveForm(forms.Form):
    outcome = forms.ChoiceField(
        choices=[
            ("done", "It happened: mark done with this result"),
            ("failed", "It did not happen: mark failed (the step sees an error)"),
            ("retry", "Unknown: perform it again with the same idempotency key"),
        ],
        widget=forms.RadioSelect,
    )
    result = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 6, "spellcheck": "false", "class": "code"}),
        help_text='Only for "done": the JSON the step receives as the effect\'s result.',
    )
    note = forms.CharField(max_length=REASON_MAX, required=False, widget=forms.TextInput)
    token = TokenField()
    version = VersionField()
    # The attempts the page showed: a decision about attempt 1 must not settle attempt 2.
    attempts = forms.IntegerField(
        min_value=0, max_value=INT_MAX, required=False, widget=forms.HiddenInput
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial.setdefault("token", new_token())

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if data.get("outcome") == "done":
            text = (data.get("result") or "").strip()
            if not text:
                self.add_error("result", "give the result the effect returned (JSON)")
            else:
                try:
                    data["result_value"] = parse_json(text, "the result")
                except forms.ValidationError as exc:
                    self.add_error("result", exc)
        return data


class DecisionForm(forms.Form):
    decision = forms.ChoiceField(choices=[("approve", "Approve"), ("reject", "Reject")])
    comment = forms.CharField(max_length=REASON_MAX, required=False, widget=forms.TextInput)

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if data.get("decision") == "reject" and not (data.get("comment") or "").strip():
            self.add_error("comment", "say why you reject it: the agent and the audit log see it")
        return data


class PayloadForm(forms.Form):
    """Approve with edits: one typed field per top-level key of the payload, so a number
    stays a number. Secret values are shown as the placeholder and cannot be edited: they
    go back unchanged. Keys are untrusted, so fields are named by position, not by key.

    When the agent named its editable fields (``editable``: the approval's stored schema),
    only those are inputs, typed from their schema; the others are ``read_only`` rows and
    are not sent (the engine keeps their asked values). The agent's schema and check are
    applied by the engine, whose refusal the view shows on this form."""

    comment = forms.CharField(max_length=REASON_MAX, required=False, widget=forms.TextInput)

    def __init__(self, payload: Any, *args: Any, editable: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.payload = payload
        self.keys: list[str] = []
        self.read_only: list[str] = []
        allowed = approvals.editable_fields(editable) if isinstance(payload, dict) else None
        schemas = approvals.field_schemas(editable)
        if isinstance(payload, dict):
            for i, (key, value) in enumerate(payload.items()):
                self.keys.append(key)
                if allowed is not None and key not in allowed:
                    self.read_only.append(key)
                elif key in schemas and not is_secret_key(key):
                    self.fields[f"f{i}"] = _field_from_schema(key, schemas[key], value)
                else:
                    self.fields[f"f{i}"] = self._field_for(key, value)
        else:
            self.fields["whole"] = forms.CharField(
                label="payload",
                widget=forms.Textarea(attrs={"rows": 8, "spellcheck": "false", "class": "code"}),
                initial=json.dumps(payload, indent=2, ensure_ascii=False),
            )
        # Keep the comment last.
        self.fields["comment"] = self.fields.pop("comment")

    def field_name(self, key: str) -> str:
        """The form field that edits payload key ``key`` ("" if none does)."""
        name = f"f{self.keys.index(key)}" if key in self.keys else ""
        return name if name in self.fields and not self.fields[name].disabled else ""

    @staticmethod
    def _field_for(key: str, value: Any) -> forms.Field:
        if is_secret_key(key):
            return forms.CharField(
                label=key,
                initial=REDACTED,
                disabled=True,
                required=False,
                help_text="secret: kept as it is",
            )
        if isinstance(value, bool):
            return forms.BooleanField(label=key, initial=value, required=False)
        if isinstance(value, int):
            return forms.IntegerField(label=key, initial=value)
        if isinstance(value, float):
            return forms.FloatField(
                label=key, initial=value, widget=forms.NumberInput(attrs={"step": "any"})
            )
        if isinstance(value, str):
            widget = (
                forms.Textarea(attrs={"rows": 6})
                if len(value) > 80 or "\n" in value
                else forms.TextInput
            )
            return forms.CharField(
                label=key, initial=value, required=False, widget=widget, strip=False
            )
        return forms.CharField(
            label=key,
            initial=json.dumps(value, indent=2, ensure_ascii=False),
            widget=forms.Textarea(attrs={"rows": 4, "spellcheck": "false", "class": "code"}),
            help_text="JSON",
        )

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if not isinstance(self.payload, dict):
            if "whole" in data:
                try:
                    data["edited"] = parse_json(data["whole"], "the payload")
                except forms.ValidationError as exc:
                    self.add_error("whole", exc)
            return data
        edited: dict[str, Any] = {}
        for i, key in enumerate(self.keys):
            name = f"f{i}"
            original = self.payload[key]
            if key in self.read_only:
                continue  # not offered: the engine keeps the asked value
            if getattr(self.fields.get(name), "from_schema", False):
                if name in data:
                    edited[key] = data[name]
                continue
            if is_secret_key(key):
                edited[key] = REDACTED  # the engine puts the original value back
                continue
            if name not in data:
                continue  # the field has its own error
            value = data[name]
            if not isinstance(original, bool | int | float | str):
                try:
                    value = parse_json(value, key)
                except forms.ValidationError as exc:
                    self.add_error(name, exc)
                    continue
            edited[key] = value
        data["edited"] = edited
        return data


def _field_from_schema(key: str, schema: dict[str, Any], value: Any) -> forms.Field:
    """A typed input for one editable field from its JSON Schema (what a pydantic model
    gives: ``type``, ``enum``, bounds, ``anyOf`` with null for an optional value). The
    bounds become input attributes for the person; the engine checks them again."""
    options = [s for s in schema.get("anyOf", []) if isinstance(s, dict)]
    if options:
        schema = {**schema, **next((s for s in options if s.get("type") != "null"), {})}
    kind = schema.get("type")
    help_text = str(schema.get("description", ""))[:300]
    common: dict[str, Any] = {"label": key, "initial": value, "help_text": help_text}
    bounds = {
        attr: schema[word]
        for attr, word in (("min", "minimum"), ("max", "maximum"))
        if isinstance(schema.get(word), int | float) and not isinstance(schema[word], bool)
    }
    field: forms.Field
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        choices = [(json.dumps(v), str(v)) for v in schema["enum"]]
        field = _JSONChoiceField(choices=choices, **{**common, "initial": json.dumps(value)})
    elif kind == "boolean":
        field = forms.BooleanField(required=False, **common)
    elif kind == "integer":
        field = forms.IntegerField(widget=forms.NumberInput(attrs=bounds), **common)
    elif kind == "number":
        attrs = {"step": "any", **bounds}
        field = forms.FloatField(widget=forms.NumberInput(attrs=attrs), **common)
    elif kind == "string":
        long = isinstance(value, str) and (len(value) > 80 or "\n" in value)
        widget = forms.Textarea(attrs={"rows": 6}) if long else forms.TextInput
        field = forms.CharField(required=False, strip=False, widget=widget, **common)
    else:
        field = _JSONTextField(
            widget=forms.Textarea(attrs={"rows": 4, "spellcheck": "false", "class": "code"}),
            **{**common, "initial": json.dumps(value, indent=2, ensure_ascii=False)},
        )
        field.help_text = help_text or "JSON"
    field.from_schema = True  # type: ignore[attr-defined]
    return field


class _JSONChoiceField(forms.ChoiceField):
    def clean(self, value: Any) -> Any:
        return json.loads(super().clean(value))


class _JSONTextField(forms.CharField):
    def clean(self, value: Any) -> Any:
        return parse_json(super().clean(value), self.label or "the value")


class SendForm(forms.Form):
    """A message to a run (what ``ctx.wait_for(name)`` returns): text, or JSON."""

    name = forms.CharField(max_length=200)
    data = forms.CharField(widget=forms.Textarea(attrs={"rows": 3}), strip=False, required=False)
    as_json = forms.BooleanField(required=False, label="the message is JSON")
    token = TokenField()
    version = VersionField()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial.setdefault("token", new_token())

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        text = data.get("data", "")
        if data.get("as_json"):
            try:
                data["value"] = parse_json(text, "the message")
            except forms.ValidationError as exc:
                self.add_error("data", exc)
        elif not text.strip():
            # A click on Send with nothing typed: a message consumed at once cannot be taken
            # back without a rollback. An empty text on purpose is sent as JSON: "".
            self.add_error(
                "data", 'the message is empty: type it (or send "" with "the message is JSON")'
            )
        else:
            data["value"] = text
        return data


IDEMPOTENCY_KEY_MAX = 255


class StartForm(forms.Form):
    """Start a run. The agent and the durability level are free text here, not choices, so
    that a stale or hand-made form gets the engine's own sentence (unknown agent, a level
    this database cannot honour) next to the field, not Django's generic one."""

    agent = forms.CharField(max_length=200, widget=forms.Select)
    input = forms.CharField(
        required=False,
        strip=False,
        widget=forms.Textarea(attrs={"rows": 14, "spellcheck": "false", "class": "code"}),
    )
    idempotency_key = forms.CharField(
        max_length=IDEMPOTENCY_KEY_MAX,
        required=False,
        label="Idempotency key",
        help_text=(
            "Optional. The same key and input start nothing new; the same key with another"
            " input is refused."
        ),
    )
    durability = forms.CharField(max_length=32, required=False, widget=forms.Select)
    reason = forms.CharField(
        max_length=REASON_MAX,
        required=False,
        widget=forms.TextInput,
        help_text="Optional; kept in the audit log.",
    )
    token = TokenField()

    def __init__(
        self,
        *args: Any,
        agents: Sequence[tuple[str, str]] = (),
        levels: Sequence[tuple[str, str]] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.initial.setdefault("token", new_token())
        self.fields["agent"].widget.choices = list(agents)
        self.fields["durability"].widget.choices = list(levels)

    def clean_input(self) -> Any:
        # An empty box is no input at all (null), as when the CLI is given no --input.
        text = self.cleaned_data["input"]
        return parse_json(text, "the input") if text.strip() else None
