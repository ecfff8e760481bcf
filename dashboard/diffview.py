"""The human diff between two states: what was added, removed and changed, with old and new
values, grouped by top-level key.

Built beside ``durability.diff`` (which produces RFC 6902 operations for storage) because a
person needs the old value too. The walk is the same shape: equal subtrees are skipped with
one C-level ``==``; lists are compared by element after stripping their common prefix and
suffix, so a message appended or inserted at the front is one added element, never a
rewritten list. On two 1 MB states differing in 1,000 paths this costs about as much as
parsing them (see bench/dashboard.py).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from durability.diff import escape, split_path
from durability.redact import REDACTED, is_secret_key

ADDED, REMOVED, CHANGED = "added", "removed", "changed"


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


@dataclass(slots=True)
class Change:
    path: str
    kind: str
    old: Any = MISSING
    new: Any = MISSING

    @property
    def segments(self) -> list[str]:
        return split_path(self.path)

    @property
    def top(self) -> str:
        segments = self.segments
        return segments[0] if segments else ""

    @property
    def redacted(self) -> bool:
        """A change under a secret-looking key: its values are never shown."""
        return any(is_secret_key(s) for s in self.segments)


@dataclass
class Group:
    key: str
    changes: list[Change] = field(default_factory=list)
    added: int = 0
    removed: int = 0
    changed: int = 0


@dataclass
class Diff:
    changes: list[Change]

    @property
    def added(self) -> int:
        return sum(1 for c in self.changes if c.kind == ADDED)

    @property
    def removed(self) -> int:
        return sum(1 for c in self.changes if c.kind == REMOVED)

    @property
    def changed(self) -> int:
        return sum(1 for c in self.changes if c.kind == CHANGED)

    def groups(self, offset: int = 0, limit: int | None = None) -> list[Group]:
        """Changes ``offset`` to ``offset + limit``, grouped by top-level key in the order
        the keys first appear."""
        window = self.changes[offset : None if limit is None else offset + limit]
        groups: dict[str, Group] = {}
        for change in window:
            group = groups.get(change.top)
            if group is None:
                group = groups[change.top] = Group(change.top)
            group.changes.append(change)
            setattr(group, change.kind, getattr(group, change.kind) + 1)
        return list(groups.values())


def compare(old: Any, new: Any) -> Diff:
    changes: list[Change] = []
    _walk(old, new, "", changes)
    return Diff(changes)


def _eq(a: Any, b: Any) -> bool:
    # Python's == says 1 == 1.0 == True; a person reading a diff wants to see such a change.
    return a is b or (type(a) is type(b) and a == b)


def _walk(a: Any, b: Any, path: str, out: list[Change]) -> None:
    ta, tb = type(a), type(b)
    if ta is dict and tb is dict:
        for key, va in a.items():
            where = path + "/" + escape(key)
            if key in b:
                vb = b[key]
                if not _eq(va, vb):
                    _walk(va, vb, where, out)
            else:
                out.append(Change(where, REMOVED, old=va))
        if len(b) > len(a) or any(key not in a for key in b):
            for key, vb in b.items():
                if key not in a:
                    out.append(Change(path + "/" + escape(key), ADDED, new=vb))
    elif ta is list and tb is list:
        _walk_list(a, b, path, out)
    elif not _eq(a, b):
        out.append(Change(path, CHANGED, old=a, new=b))


_CHUNK = 64
# Beyond this many elements on each side, aligning a list is not worth its cost: compare
# by position instead.
MAX_ALIGN = 20_000


def _prefix(a: list, b: list) -> int:
    """Length of the common prefix, a chunk at a time at C speed where it can."""
    n = min(len(a), len(b))
    i = 0
    while i + _CHUNK <= n and a[i : i + _CHUNK] == b[i : i + _CHUNK]:
        i += _CHUNK
    while i < n and _eq(a[i], b[i]):
        i += 1
    return i


def _suffix(a: list, b: list, limit: int) -> int:
    la, lb = len(a), len(b)
    j = 0
    while j + _CHUNK <= limit and a[la - j - _CHUNK : la - j] == b[lb - j - _CHUNK : lb - j]:
        j += _CHUNK
    while j < limit and _eq(a[la - 1 - j], b[lb - 1 - j]):
        j += 1
    return j


def _walk_list(a: list, b: list, path: str, out: list[Change]) -> None:
    la, lb = len(a), len(b)
    # The common cases first, one C-level comparison each: appended, inserted at the front,
    # dropped from either end.
    if lb >= la:
        if b[:la] == a:
            out.extend(Change(f"{path}/{i}", ADDED, new=b[i]) for i in range(la, lb))
            return
        if b[lb - la :] == a:
            out.extend(Change(f"{path}/{i}", ADDED, new=b[i]) for i in range(lb - la))
            return
    elif a[:lb] == b:
        out.extend(Change(f"{path}/{i}", REMOVED, old=a[i]) for i in range(lb, la))
        return
    elif a[la - lb :] == b:
        out.extend(Change(f"{path}/{i}", REMOVED, old=a[i]) for i in range(la - lb))
        return
    start = _prefix(a, b)
    end = _suffix(a, b, min(la, lb) - start)
    middle_a, middle_b = la - start - end, lb - start - end
    if (
        middle_a
        and middle_b
        and max(middle_a, middle_b) > 1
        and max(middle_a, middle_b) <= MAX_ALIGN
    ):
        _align(a, b, start, la - end, lb - end, path, out)
        return
    _pair(a, b, start, start, middle_a, middle_b, path, out)


def _pair(
    a: list, b: list, i0: int, j0: int, count_a: int, count_b: int, path: str, out: list[Change]
) -> None:
    """Compare ``a[i0:i0+count_a]`` with ``b[j0:j0+count_b]`` by position; the surplus is
    added or removed. Unpaired elements are named by their index in the list they belong
    to: a removed one by its place in the old list, an added one by its place in the new."""
    paired = min(count_a, count_b)
    for k in range(paired):
        _walk(a[i0 + k], b[j0 + k], f"{path}/{j0 + k}", out)
    for k in range(paired, count_a):
        out.append(Change(f"{path}/{i0 + k}", REMOVED, old=a[i0 + k]))
    for k in range(paired, count_b):
        out.append(Change(f"{path}/{j0 + k}", ADDED, new=b[j0 + k]))


def _fingerprint(value: Any) -> Any:
    """A hashable stand-in that is equal only for equal elements, types included (unlike
    ==, which says 1 == 1.0 == True). A flat object (a chat message) becomes a tuple of its
    items, cheap to build and to hash; anything nested is dumped: states come from
    canonical JSON (sorted keys), so equal elements dump to equal bytes."""
    kind = type(value)
    if kind is dict:
        items = tuple((k, type(v), v) for k, v in value.items())
        try:
            hash(items)
        except TypeError:  # a container inside
            return orjson.dumps(value)
        return items
    if kind is list:
        return orjson.dumps(value)
    return (kind, value)


def _align(
    a: list, b: list, start: int, end_a: int, end_b: int, path: str, out: list[Change]
) -> None:
    """Match the elements between the common prefix and suffix (messages inserted at the
    front *and* appended *and* edited in between), so that a shifted element is not taken
    for a changed one."""
    left = [_fingerprint(x) for x in a[start:end_a]]
    right = [_fingerprint(x) for x in b[start:end_b]]
    matcher = difflib.SequenceMatcher(None, left, right, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        _pair(a, b, start + i1, start + j1, i2 - i1, j2 - j1, path, out)


# --- reading one value at a path --------------------------------------------------------------


def resolve(document: Any, pointer: str) -> Any:
    """The value at an RFC 6901 pointer, or ``MISSING``."""
    node = document
    for segment in split_path(pointer):
        if type(node) is dict:
            if segment not in node:
                return MISSING
            node = node[segment]
        elif type(node) is list:
            if not segment.isdigit() or int(segment) >= len(node):
                return MISSING
            node = node[int(segment)]
        else:
            return MISSING
    return node


def secret_path(pointer: str) -> bool:
    return any(is_secret_key(s) for s in split_path(pointer))


# --- words ------------------------------------------------------------------------------------

_TOKENS = re.compile(r"\s+|[^\s\w]|\w+")
# Beyond this many tokens a word diff is quadratic enough to stall a request: lines instead.
MAX_WORD_TOKENS = 20_000


@dataclass(slots=True)
class Segment:
    op: str  # "equal" | "insert" | "delete"
    text: str


def word_diff(old: str, new: str) -> list[Segment]:
    """Word-level marks between two texts, for reading a long edited string."""
    a, b = _TOKENS.findall(old), _TOKENS.findall(new)
    if len(a) + len(b) > MAX_WORD_TOKENS:
        a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    segments: list[Segment] = []
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            segments.append(Segment("equal", "".join(a[i1:i2])))
            continue
        if op in ("delete", "replace"):
            segments.append(Segment("delete", "".join(a[i1:i2])))
        if op in ("insert", "replace"):
            segments.append(Segment("insert", "".join(b[j1:j2])))
    return segments


__all__ = [
    "ADDED",
    "CHANGED",
    "MISSING",
    "REDACTED",
    "REMOVED",
    "Change",
    "Diff",
    "Group",
    "compare",
    "resolve",
    "secret_path",
    "word_diff",
]
