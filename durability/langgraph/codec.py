"""Channel values as JSON: what JSON can carry stays JSON, the rest goes through LangGraph's
serializer, one leaf at a time.

Plain values (strings, numbers, lists, objects with string keys) are stored as they are, so
the dashboard shows them and a patch on its parent names the paths that changed. Anything
else (a LangChain message, a dataclass, a tuple, bytes) becomes ``{"__lg__": type, "b64":
serialized}`` with the saver's ``serde``. Lists and objects are walked, so a list of
messages is a JSON list of such leaves: appending one message changes one element, and the
checkpoint's patch carries that one message, not the whole list.
"""

from __future__ import annotations

import base64
import math
from typing import Any

TAG = "__lg__"
_MAX_INT = 2**63


class Encoder:
    """Encodes values with ``serde``. Messages seen in the previous call are not serialized
    again: LangGraph's message reducer replaces a message by id instead of changing it in
    place, so one kept from step to step is the same object with the same bytes."""

    def __init__(self, serde: Any) -> None:
        self.serde = serde
        self._previous: dict[int, tuple[Any, Any]] = {}
        self._current: dict[int, tuple[Any, Any]] = {}
        try:
            from langchain_core.messages import BaseMessage

            self._kept: tuple[type, ...] = (BaseMessage,)
        except ImportError:  # langchain-core comes with langgraph; without it, no reuse
            self._kept = ()

    def encode(self, value: Any) -> Any:
        self._current = {}
        try:
            return self._encode(value)
        finally:
            self._previous = self._current

    def _encode(self, value: Any) -> Any:
        kind = type(value)
        if kind is str or kind is bool or value is None:
            return value
        if kind is int:
            return value if -_MAX_INT <= value < _MAX_INT else self._leaf(value)
        if kind is float:
            return value if math.isfinite(value) else self._leaf(value)
        if kind is list:
            return [self._encode(item) for item in value]
        if kind is dict and TAG not in value and all(type(k) is str for k in value):
            return {key: self._encode(item) for key, item in value.items()}
        if self._kept and isinstance(value, self._kept):
            seen = self._previous.get(id(value))
            if seen is not None and seen[0] is value:
                self._current[id(value)] = seen
                return seen[1]
            leaf = self._leaf(value)
            self._current[id(value)] = (value, leaf)
            return leaf
        return self._leaf(value)

    def _leaf(self, value: Any) -> dict[str, str]:
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
        if tag is not None:
            return serde.loads_typed((tag, base64.b64decode(value["b64"])))
        return {key: decode(item, serde) for key, item in value.items()}
    return value


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
    if isinstance(obj, tuple):
        return [json_view(item) for item in obj]
    return repr(obj)


class Memo:
    """Decodes the serialized leaves of many states of one thread once each: a message kept
    from checkpoint to checkpoint is the same leaf in every state ``list`` rebuilds."""

    def __init__(self, serde: Any) -> None:
        self.serde = serde
        self._seen: dict[tuple[str, str], Any] = {}

    def decode(self, value: Any) -> Any:
        kind = type(value)
        if kind is list:
            return [self.decode(item) for item in value]
        if kind is dict:
            if TAG in value:
                key = (value[TAG], value["b64"])
                if key not in self._seen:
                    self._seen[key] = decode(value, self.serde)
                return self._seen[key]
            return {key: self.decode(item) for key, item in value.items()}
        return value
