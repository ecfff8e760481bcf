"""Channel values as JSON: what JSON can carry stays JSON, LangChain's messages are stored as
their fields, and the rest goes through LangGraph's serializer, one leaf at a time.

Plain values (strings, numbers, lists, objects with string keys) are stored as they are, so
the dashboard shows them and a patch on its parent names the paths that changed. A LangChain
message (``langchain_core.messages``) whose fields are plain JSON becomes ``{"__lg__":
"message", "class": "AIMessage", "fields": {...}}``: its ``model_dump`` without the fields
left at their defaults, read back with the class's own constructor, as LangGraph's
serializer reads the messages it stores. Anything else (a message with bytes among its
fields, a dataclass, a tuple, bytes) becomes ``{"__lg__": type, "b64": serialized}`` with
the saver's ``serde``. Lists and objects are walked, so a list of messages is a JSON list of
such leaves: appending one message changes one element, and the checkpoint's patch carries
that one message, not the whole list.
"""

from __future__ import annotations

import base64
import math
import operator
from typing import Any

import orjson

TAG = "__lg__"
MESSAGE = "message"
_MAX_INT = 2**63


def _message_classes() -> dict[str, type]:
    """LangChain's message classes by name; none where langchain-core is missing."""
    try:
        import langchain_core.messages as messages
    except ImportError:  # langchain-core comes with langgraph
        return {}
    found = {}
    for name in messages.__all__:
        cls = getattr(messages, name, None)
        if isinstance(cls, type) and issubclass(cls, messages.BaseMessage):
            found[name] = cls
    return found


_CLASSES = _message_classes()
_NAMES = {cls: name for name, cls in _CLASSES.items()}


class Encoder:
    """Encodes values with ``serde``. Messages seen in the previous call are not encoded
    again: LangGraph's message reducer replaces a message by id instead of changing it in
    place, so one kept from step to step is the same object with the same fields."""

    def __init__(self, serde: Any) -> None:
        self.serde = serde
        self._previous: dict[int, tuple[Any, Any]] = {}
        self._current: dict[int, tuple[Any, Any]] = {}
        # The lists of a top-level object's members in the previous call, by member: their
        # elements then and encoded, copies (a list changed in place after the call, or the
        # encoded document patched in place, leaves them as they were).
        self._lists: dict[str, tuple[tuple, tuple]] = {}
        self._leaves = 0  # serialized leaves made so far: a message's fields are plain if none

    def encode(self, value: Any) -> Any:
        self._current = {}
        try:
            if type(value) is dict and TAG not in value and all(type(k) is str for k in value):
                return {
                    key: self._member(key, item) if type(item) is list else self._encode(item)
                    for key, item in value.items()
                }
            return self._encode(value)
        finally:
            self._previous = self._current

    def _member(self, key: str, value: list) -> list:
        """A top-level member's list (a channel's, such as a thread's messages): when it
        starts with every element the previous call's had, the same objects (LangGraph's
        message reducer appends to a copy), those are taken as encoded then, checked and
        copied at C speed rather than one element at a time: a thread's messages list grows
        with every superstep, and most of it never changes."""
        before = self._lists.get(key)
        if before is not None:
            items, encoded = before
            kept = len(items)
            if kept <= len(value) and all(map(operator.is_, items, value)):
                grown = [*encoded, *self._list(value[kept:])]
                self._lists[key] = (tuple(value), tuple(grown))
                return grown
            # Not a list grown at its end: its elements are looked up one at a time.
            for item, leaf in zip(items, encoded, strict=True):
                self._previous.setdefault(id(item), (item, leaf))
        made = self._list(value)
        self._lists[key] = (tuple(value), tuple(made))
        return made

    def _list(self, value: list) -> list:
        # A message kept from the previous call is looked up here rather than in a call of
        # its own: a thread's messages list is most of what a superstep encodes.
        previous, current, encoded = self._previous, self._current, []
        for item in value:
            seen = previous.get(id(item))
            if seen is not None and seen[0] is item:
                current[id(item)] = seen
                encoded.append(seen[1])
            else:
                encoded.append(self._encode(item))
        return encoded

    def _encode(self, value: Any) -> Any:
        kind = type(value)
        if kind is str or kind is bool or value is None:
            return value
        if kind is int:
            return value if -_MAX_INT <= value < _MAX_INT else self._leaf(value)
        if kind is float:
            return value if math.isfinite(value) else self._leaf(value)
        if kind is list:
            return self._list(value)
        if kind is dict and TAG not in value and all(type(k) is str for k in value):
            return {key: self._encode(item) for key, item in value.items()}
        name = _NAMES.get(kind)
        if name is None:
            return self._leaf(value)
        seen = self._previous.get(id(value))
        if seen is not None and seen[0] is value:
            self._current[id(value)] = seen
            return seen[1]
        leaf = self._message(name, value)
        self._current[id(value)] = (value, leaf)
        return leaf

    def _message(self, name: str, value: Any) -> Any:
        before = self._leaves
        fields = self._encode(value.model_dump(exclude_defaults=True))
        if self._leaves != before:  # not plain JSON: the whole message through ``serde``
            return self._leaf(value)
        return {TAG: MESSAGE, "class": name, "fields": fields}

    def _leaf(self, value: Any) -> dict[str, str]:
        self._leaves += 1
        kind, data = self.serde.dumps_typed(value)
        return {TAG: kind, "b64": base64.b64encode(data).decode("ascii")}


def decode(value: Any, serde: Any) -> Any:
    """The value ``Encoder.encode`` was given, in new objects (the encoded document is left
    as it is)."""
    kind = type(value)
    if kind is list:
        return [decode(item, serde) for item in value]
    if kind is dict:
        tag = value.get(TAG)
        if tag is None:
            return {key: decode(item, serde) for key, item in value.items()}
        if tag == MESSAGE:
            return _message(value)
        return serde.loads_typed((tag, base64.b64decode(value["b64"])))
    return value


def _message(leaf: dict) -> Any:
    name = leaf["class"]
    cls = _CLASSES.get(name)
    if cls is None:
        raise ValueError(f"a stored message names {name!r}, not a LangChain message class")
    # The fields are plain JSON: copied by the walk, so the message shares nothing with
    # the document (which the saver patches in place).
    return cls(**{key: decode(item, None) for key, item in leaf["fields"].items()})


def readable(value: Any, serde: Any) -> Any:
    """A JSON view of an encoded value for people: each serialized leaf decoded and shown
    as LangChain's JSON form (messages), a model's fields, or its ``repr``."""
    kind = type(value)
    if kind is list:
        return [readable(item, serde) for item in value]
    if kind is not dict:
        return value
    if value.get(TAG) is None:
        return {key: readable(item, serde) for key, item in value.items()}
    try:
        obj = decode(value, serde)
    except Exception as exc:  # noqa: BLE001 - a view must not fail on one bad leaf
        return {"undecodable": f"{type(exc).__name__}: {exc}"}
    return json_view(obj)


def json_view(obj: Any) -> Any:
    """A decoded value as JSON for people: a LangChain message as its type and the fields
    it sets, else LangChain's JSON form, a model's fields, or its ``repr``."""
    if type(obj) in (str, int, float, bool) or obj is None:
        return obj
    if isinstance(obj, list):
        return [json_view(item) for item in obj]
    if isinstance(obj, dict):
        return {str(key): json_view(item) for key, item in obj.items()}
    kind = getattr(obj, "type", None)
    dump = getattr(obj, "model_dump", None)
    if isinstance(kind, str) and callable(dump) and hasattr(obj, "content"):
        try:  # a message: {"type": "ai", "content": ..., "tool_calls": ...}
            return {"type": kind, **dump(mode="json", exclude_defaults=True)}
        except Exception:  # noqa: BLE001 - a view must not fail on one odd value
            pass
    try:
        from langchain_core.load import dumpd

        view = dumpd(obj)
        if isinstance(view, dict) and view.get("type") != "not_implemented":
            return view
    except ImportError:
        pass
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        try:
            return dump(mode="json")
        except Exception:  # noqa: BLE001
            pass
    if isinstance(obj, (bytes, bytearray)):
        return {"bytes": len(obj)}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple: by its fields
        return {name: json_view(getattr(obj, name)) for name in obj._fields}
    if isinstance(obj, tuple):
        return [json_view(item) for item in obj]
    return repr(obj)


class Memo:
    """Decodes the leaves of many states of one thread once each: a message kept from
    checkpoint to checkpoint is the same leaf in every state ``list`` rebuilds."""

    def __init__(self, serde: Any) -> None:
        self.serde = serde
        self._seen: dict[Any, Any] = {}

    def decode(self, value: Any) -> Any:
        kind = type(value)
        if kind is list:
            return [self.decode(item) for item in value]
        if kind is dict:
            tag = value.get(TAG)
            if tag is None:
                return {key: self.decode(item) for key, item in value.items()}
            key = orjson.dumps(value) if tag == MESSAGE else (tag, value["b64"])
            if key not in self._seen:
                self._seen[key] = decode(value, self.serde)
            return self._seen[key]
        return value
