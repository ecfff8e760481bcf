"""Turning agent data into plain text for templates: previews, chat bubbles, tree nodes.

Everything here returns *text*; templates escape it. Nothing is marked safe: agent output,
keys and names are untrusted wherever they appear. Values under secret-looking keys are
replaced by the redaction placeholder before they are shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from dashboard.diffview import MISSING, Change, secret_path
from durability.diff import escape
from durability.redact import REDACTED, is_secret_key, redact

PREVIEW_CHARS = 240
PRETTY_CHARS = 4_000
# A long string is shown whole up to this size inside a panel; beyond, download the JSON.
FULL_TEXT_CHARS = 100_000
TREE_PAGE = 100
ROLES = {"system", "user", "assistant", "tool"}


def kind_of(value: Any) -> str:
    if value is MISSING:
        return "missing"
    if value is None:
        return "null"
    kind = type(value)
    if kind is bool:
        return "bool"
    if kind in (int, float):
        return "number"
    if kind is str:
        return "string"
    if kind is list:
        return "array"
    if kind is dict:
        return "object"
    return "other"


def safe_copy(value: Any) -> Any:
    """A deep copy with secrets redacted: the original stays as it was read."""
    if type(value) in (dict, list):
        copied = orjson.loads(orjson.dumps(value))
        redact(copied)
        return copied
    return value


def _clip(text: str, limit: int) -> tuple[str, int]:
    if len(text) <= limit:
        return text, 0
    return text[:limit], len(text) - limit


def json_text(value: Any, *, pretty: bool = False) -> str:
    option = orjson.OPT_SORT_KEYS | (orjson.OPT_INDENT_2 if pretty else 0)
    return orjson.dumps(safe_copy(value), option=option).decode()


@dataclass(slots=True)
class Shown:
    """One value as a person reads it."""

    kind: str
    text: str = ""
    more: int = 0  # characters left out
    role: str = ""  # a chat message: its role and content
    content: str = ""
    redacted: bool = False

    @property
    def is_message(self) -> bool:
        return bool(self.role)

    @property
    def role_class(self) -> str:
        # The role is agent data: only known roles become a CSS class.
        return self.role if self.role in ROLES else "other"


def is_message(value: Any) -> bool:
    return (
        type(value) is dict
        and type(value.get("role")) is str
        and type(value.get("content")) is str
        and len(value) <= 4
    )


def show(value: Any, *, limit: int = PREVIEW_CHARS, pretty: bool = False) -> Shown:
    kind = kind_of(value)
    if kind == "missing":
        return Shown(kind)
    if kind == "string":
        text, more = _clip(value, limit)
        return Shown(kind, text, more, redacted=value == REDACTED)
    if kind == "object" and is_message(value):
        content, more = _clip(value["content"], limit)
        return Shown(kind, role=value["role"], content=content, more=more)
    text, more = _clip(json_text(value, pretty=pretty), limit)
    return Shown(kind, text, more)


@dataclass(slots=True)
class ChangeView:
    path: str
    kind: str
    old: Shown
    new: Shown
    # Both sides are text long enough for a word diff to help (loaded on expand).
    words: bool = False


def change_view(change: Change, *, limit: int = PREVIEW_CHARS) -> ChangeView:
    if change.redacted or secret_path(change.path):
        hidden = Shown("string", REDACTED, redacted=True)
        return ChangeView(
            change.path,
            change.kind,
            hidden if change.old is not MISSING else Shown("missing"),
            hidden if change.new is not MISSING else Shown("missing"),
        )
    pretty = change.kind != "changed"
    old = show(change.old, limit=limit, pretty=pretty)
    new = show(change.new, limit=limit, pretty=pretty)
    words = (
        type(change.old) is str
        and type(change.new) is str
        and max(len(change.old), len(change.new)) > 80
    )
    return ChangeView(change.path, change.kind, old, new, words)


# --- the collapsible JSON tree ----------------------------------------------------------------


@dataclass(slots=True)
class Node:
    label: str
    pointer: str
    kind: str
    count: int = 0  # children of a container, characters of a string
    text: str = ""
    more: int = 0
    redacted: bool = False

    @property
    def container(self) -> bool:
        return self.kind in ("object", "array")


def _node(label: str, pointer: str, value: Any, secret: bool) -> Node:
    if secret and value is not None:
        return Node(label, pointer, "string", text=REDACTED, redacted=True)
    kind = kind_of(value)
    if kind in ("object", "array"):
        return Node(label, pointer, kind, count=len(value))
    if kind == "string":
        text, more = _clip(value, PREVIEW_CHARS)
        return Node(label, pointer, kind, count=len(value), text=text, more=more)
    return Node(label, pointer, kind, text=orjson.dumps(value).decode())


def tree_children(
    value: Any, pointer: str, *, offset: int = 0, limit: int = TREE_PAGE
) -> tuple[list[Node], int]:
    """Nodes for the children of a container (a page of them) and how many there are."""
    if type(value) is dict:
        keys = list(value)
        page = keys[offset : offset + limit]
        nodes = [
            _node(key, f"{pointer}/{escape(key)}", value[key], is_secret_key(key)) for key in page
        ]
        return nodes, len(keys)
    if type(value) is list:
        end = min(len(value), offset + limit)
        nodes = [_node(str(i), f"{pointer}/{i}", value[i], False) for i in range(offset, end)]
        return nodes, len(value)
    return [], 0


def full_text(value: Any) -> Shown:
    """A string shown whole (up to a limit), for a node expanded in the tree."""
    if type(value) is str:
        text, more = _clip(value, FULL_TEXT_CHARS)
        return Shown("string", text, more)
    return show(value, limit=FULL_TEXT_CHARS, pretty=True)
