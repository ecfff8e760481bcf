"""A fast structural diff that produces RFC 6902 JSON Patch operations.

``jsonpatch.make_patch`` costs ~60 ms on two 1 MB states; this walk skips equal subtrees
with C-level ``==`` and pays only for what changed. Lists are compared by element after
stripping the common prefix and suffix, so an appended or front-inserted message is one
``add`` operation, not a rewritten list.

Python's ``==`` says ``1 == 1.0 == True``. The fast walk can therefore miss a change of
number type; callers that must be exact (the checkpoint writer) check the patched result
against the canonical bytes and fall back to ``strict=True``, which compares types too.
"""

from __future__ import annotations

import math
import operator
from itertools import compress, count
from typing import Any

import jsonpatch

from durability import canonical


def escape(key: str) -> str:
    """RFC 6901 escaping of one path segment."""
    if "~" in key or "/" in key:
        return key.replace("~", "~0").replace("/", "~1")
    return key


def unescape(segment: str) -> str:
    if "~" in segment:
        return segment.replace("~1", "/").replace("~0", "~")
    return segment


def split_path(path: str) -> list[str]:
    if not path:
        return []
    return [unescape(s) for s in path.split("/")[1:]]


def same(a: Any, b: Any) -> bool:
    """Deep equality that also compares types, so 1, 1.0 and True differ, and so do 0.0
    and -0.0: for JSON values, true exactly when their canonical bytes are the same. An
    object is the same as itself without a walk, so two documents that share what did not
    change compare at the cost of what did."""
    if a is b:
        return True
    ta = type(a)
    if ta is not type(b):
        return False
    if ta is dict:
        if len(a) != len(b):
            return False
        for key, value in a.items():
            if key not in b:
                return False
            other = b[key]
            if value is not other and not same(value, other):
                return False
        return True
    if ta is list:
        if len(a) != len(b):
            return False
        # The elements that are not the same object are found at C speed: in two states
        # of a growing list (a thread's messages), nearly all are.
        return all(same(a[i], b[i]) for i in compress(count(), map(operator.is_not, a, b)))
    if ta is float:
        return a == b and (a != 0.0 or math.copysign(1.0, a) == math.copysign(1.0, b))
    return a == b


def diff(old: Any, new: Any, *, strict: bool = False) -> list[dict[str, Any]]:
    """Operations that turn ``old`` into ``new``. Values in the operations are references
    into ``new``: copy them before applying the patch to another live document."""
    ops: list[dict[str, Any]] = []
    eq = same if strict else _fast_eq
    _walk(old, new, "", ops, eq)
    return ops


def _fast_eq(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and a == b)


def _walk(a: Any, b: Any, path: str, ops: list, eq) -> None:
    ta, tb = type(a), type(b)
    if ta is dict and tb is dict:
        # Most members of a state are the same object as before: they cost a look-up each,
        # and a path is made only for one that changed.
        for key, va in a.items():
            if key in b:
                vb = b[key]
                if va is not vb and not eq(va, vb):
                    _walk(va, vb, path + "/" + escape(key), ops, eq)
            else:
                ops.append({"op": "remove", "path": path + "/" + escape(key)})
        if not b.keys() <= a.keys():  # in b's order: the same patch for the same states
            for key, vb in b.items():
                if key not in a:
                    ops.append({"op": "add", "path": path + "/" + escape(key), "value": vb})
    elif ta is list and tb is list:
        _walk_list(a, b, path, ops, eq)
    elif not eq(a, b):
        ops.append({"op": "replace", "path": path, "value": b})


_CHUNK = 64
_MAX_SHIFT = 16


def _common_prefix(a: list, b: list, eq) -> int:
    """Length of the common prefix, compared a chunk at a time at C speed where it can."""
    n = min(len(a), len(b))
    i = 0
    if eq is not same:
        while i + _CHUNK <= n and a[i : i + _CHUNK] == b[i : i + _CHUNK]:
            i += _CHUNK
    while i < n and eq(a[i], b[i]):
        i += 1
    return i


def _common_suffix(a: list, b: list, limit: int, eq) -> int:
    la, lb = len(a), len(b)
    j = 0
    if eq is not same:
        while j + _CHUNK <= limit and a[la - j - _CHUNK : la - j] == b[lb - j - _CHUNK : lb - j]:
            j += _CHUNK
    while j < limit and eq(a[la - 1 - j], b[lb - 1 - j]):
        j += 1
    return j


def _shift(a: list, b: list) -> tuple[int, int] | None:
    """A window that slid: ``k`` elements gone from the front and new ones appended
    (``(k, +1)``), or gone from the end and new ones in front (``(k, -1)``)."""
    la, lb = len(a), len(b)
    for k in range(1, min(_MAX_SHIFT, la) + 1):
        keep = la - k
        if keep == 0 or keep > lb:
            continue
        # The first element settles most candidates before any slice is made.
        if b[0] == a[k] and b[:keep] == a[k:]:
            return k, +1
        if b[lb - keep] == a[0] and b[lb - keep :] == a[:keep]:
            return k, -1
    return None


def _walk_list(a: list, b: list, path: str, ops: list, eq) -> None:
    la, lb = len(a), len(b)
    strict = eq is same
    if not strict:
        # The common cases first, each a C-level comparison: appended, inserted in front,
        # and a window that slid (dropped at one end, added at the other). Lists of the same
        # length that differ can be neither of the first two: those comparisons would only
        # walk the list twice more.
        if lb > la and b[:la] == a:
            ops.extend({"op": "add", "path": f"{path}/{i}", "value": b[i]} for i in range(la, lb))
            return
        if lb > la and b[lb - la :] == a:
            ops.extend({"op": "add", "path": f"{path}/{i}", "value": b[i]} for i in range(lb - la))
            return
        shifted = _shift(a, b)
        if shifted is not None:
            k, direction = shifted
            keep = la - k
            if direction > 0:
                ops.extend({"op": "remove", "path": f"{path}/0"} for _ in range(k))
                ops.extend(
                    {"op": "add", "path": f"{path}/{i}", "value": b[i]} for i in range(keep, lb)
                )
            else:
                ops.extend(
                    {"op": "remove", "path": f"{path}/{i}"} for i in range(la - 1, keep - 1, -1)
                )
                ops.extend(
                    {"op": "add", "path": f"{path}/{i}", "value": b[i]} for i in range(lb - keep)
                )
            return
    start = _common_prefix(a, b, eq)
    end = _common_suffix(a, b, min(la, lb) - start, eq)
    middle_a, middle_b = la - start - end, lb - start - end
    paired = min(middle_a, middle_b)
    for i in range(start, start + paired):
        _walk(a[i], b[i], f"{path}/{i}", ops, eq)
    if middle_a > middle_b:
        # Remove from the highest index down so earlier indices stay valid.
        for i in range(start + middle_a - 1, start + paired - 1, -1):
            ops.append({"op": "remove", "path": f"{path}/{i}"})
    else:
        for i in range(start + paired, start + middle_b):
            ops.append({"op": "add", "path": f"{path}/{i}", "value": b[i]})


def apply(document: Any, ops: list[dict[str, Any]]) -> Any:
    """Apply ``ops`` to ``document`` in place (RFC 6902, through the jsonpatch library) and
    return the result (a new object when the root itself is replaced)."""
    if not ops:
        return document
    return jsonpatch.apply_patch(document, ops, in_place=True)


def apply_own(document: Any, ops: list[dict[str, Any]], *, shared: bool = False) -> Any:
    """Apply ops that ``diff`` made (add, remove, replace; numeric list indices) and return
    the result: in place, or with ``shared`` leaving ``document`` as it is (each list and
    object an operation changes is copied first, once per call, so the result shares every
    part the patch does not touch with ``document``).

    Building jsonpatch's operation and pointer objects costs more than the rest of a small
    step's bookkeeping, and dominated rebuilding a state from a thousand patches. The
    worker proves with this function, before it commits a patch, that the patch reproduces
    the step's state byte for byte; rehydration rebuilds with the same function, so it gets
    the state that was proven. ``verify`` applies patches with ``apply`` (the library)
    instead, and compares the result with every snapshot: a second opinion."""
    return _apply(document, ops, shared, None)[0]


def apply_sized(
    document: Any, ops: list[dict[str, Any]], size: int, *, shared: bool = False
) -> tuple[Any, int]:
    """``apply_own``, and the length of the result's canonical bytes, given ``size``,
    ``document``'s: each operation adds its value's bytes and takes away those of what it
    replaces or removes, with the comma, key and colon around them. Canonical JSON has no
    whitespace and its keys' order does not change its length, so the count is exact, and
    it costs what changed rather than a serialization of the whole state."""
    result, after = _apply(document, ops, shared, size)
    assert after is not None
    return result, after


def _apply(
    document: Any, ops: list[dict[str, Any]], shared: bool, size: int | None
) -> tuple[Any, int | None]:
    # The containers this call copied, by id. The caller's own stay alive with ``document``
    # and ``ops``, so none of theirs can take an id that is here.
    made: set[int] = set()
    for op in ops:
        path = op["path"]
        if not path:
            if op["op"] == "remove":
                raise ValueError("cannot remove the root")
            document = op["value"]
            if size is not None:
                size = _size(document)
            continue
        parts = path.split("/")[1:]
        if shared and id(document) not in made:
            document = _copied(document, made)
        parent = document
        for part in parts[:-1]:
            key: Any = int(part) if type(parent) is list else unescape(part)
            child = parent[key]
            if shared and id(child) not in made:
                child = parent[key] = _copied(child, made)
            parent = child
        last = parts[-1]
        kind = op["op"]
        if type(parent) is list:
            index = int(last)
            if kind == "add":
                if size is not None:
                    size += _size(op["value"]) + bool(parent)
                parent.insert(index, op["value"])
            elif kind == "remove":
                if size is not None:
                    size -= _size(parent[index]) + (len(parent) > 1)
                del parent[index]
            else:
                if size is not None:
                    size += _size(op["value"]) - _size(parent[index])
                parent[index] = op["value"]
        else:
            key = unescape(last)
            if size is not None:
                if key in parent:
                    size -= _size(parent[key])
                    if kind == "remove":  # its key, colon and a comma go too
                        size -= _size(key) + 1 + (len(parent) > 1)
                else:  # a new member: its key, colon and a comma come too
                    size += _size(key) + 1 + bool(parent)
                if kind != "remove":
                    size += _size(op["value"])
            if kind == "remove":
                del parent[key]
            else:
                parent[key] = op["value"]
    return document, size


def _size(value: Any) -> int:
    return len(canonical.dumps(value))


def _copied(container: Any, made: set[int]) -> Any:
    copy = list(container) if type(container) is list else dict(container)
    made.add(id(copy))
    return copy
