"""Forms for operator actions. They check shape (JSON that parses, a reason where one is
required); the engine checks meaning (the agent's schema, the run's status) and its errors
are shown on the same form."""

from __future__ import annotations

import json
from typing import Any

from django import forms

from dashboard.params import ID_MAX, INT_MAX
from dashboard.submissions import new_token
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
    reason = forms.CharField(
        max_length=REASON_MAX, widget=forms.TextInput, help_text="Recorded in the audit log."
    )
    token = TokenField()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial.setdefault("token", new_token())


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
    token = TokenField()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial.setdefault("token", new_token())

    def clean_state(self) -> Any:
        state = parse_json(self.cleaned_data["state"], "the state")
        if not isinstance(state, dict):
            raise forms.ValidationError("the state must be a JSON object ({...})")
        return state


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
    go back unchanged. Keys are untrusted, so fields are named by position, not by key."""

    comment = forms.CharField(max_length=REASON_MAX, required=False, widget=forms.TextInput)

    def __init__(self, payload: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.payload = payload
        self.keys: list[str] = []
        if isinstance(payload, dict):
            for i, (key, value) in enumerate(payload.items()):
                self.keys.append(key)
                self.fields[f"f{i}"] = self._field_for(key, value)
        else:
            self.fields["whole"] = forms.CharField(
                label="payload",
                widget=forms.Textarea(attrs={"rows": 8, "spellcheck": "false", "class": "code"}),
                initial=json.dumps(payload, indent=2, ensure_ascii=False),
            )
        # Keep the comment last.
        self.fields["comment"] = self.fields.pop("comment")

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
        else:
            data["value"] = text
        return data
