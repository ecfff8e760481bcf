"""Canonical JSON bytes and the hashes computed over them.

Hashes are computed over exactly the bytes that are stored (text columns, never jsonb,
which reorders keys and rewrites numbers). orjson gives sorted keys and one fixed
rendering per number; values that JSON cannot carry exactly are refused, not coerced.

A checkpoint's state hash commits to its full state without hashing it on every step:

- a checkpoint stored whole (a run's start, a fork) hashes its canonical state;
- a checkpoint stored as a patch on its parent hashes the parent's state hash and the
  patch's canonical bytes (``patched``), so the work follows the change, not the state
  (SHA-256 of a 1 MB state costs more than a whole 10 KB step's bookkeeping). An empty
  patch leaves the state, and its hash, as they were;
- a snapshot written later, for rebuild speed, carries a digest that binds its bytes to
  the state hash they are the state of (``seal``).
"""

from __future__ import annotations

import hashlib
import hmac
import math
from typing import Any

import orjson

from durability.errors import StateNotJSON

_DUMP_OPTIONS = (
    orjson.OPT_SORT_KEYS
    # A datetime or dataclass would come back from storage as a string or a dict: refuse
    # them instead of letting the live state and the stored state drift apart.
    | orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_DATACLASS
)

JSON_SCALARS = (str, int, float, bool, type(None))


def _refuse(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def dumps(value: Any, *, what: str = "value") -> bytes:
    """Canonical JSON bytes of ``value`` (sorted keys), or ``StateNotJSON``."""
    try:
        return orjson.dumps(value, default=_refuse, option=_DUMP_OPTIONS)
    except TypeError as exc:
        raise StateNotJSON(f"{what} is not JSON: {exc}") from None


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


def loads_object(text: str) -> dict:
    """A stored JSON object such as an event's data, or ``{}`` when the text is empty, not
    JSON, or not an object: readers of the timeline take what they know and skip the rest."""
    if not text:
        return {}
    try:
        value = orjson.loads(text)
    except ValueError:  # orjson.JSONDecodeError is one
        return {}
    return value if isinstance(value, dict) else {}


def check_json(value: Any, *, what: str = "value", path: str = "") -> None:
    """Walk ``value`` and refuse what orjson would silently change (NaN, infinities, tuples,
    non-string keys, integers beyond 64 bits) or cannot represent."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        kind = type(item)
        if kind is dict:
            for key, child in item.items():
                if type(key) is not str:
                    raise StateNotJSON(
                        f"{what} is not JSON: key {key!r} at {where or '/'} is not a string"
                    )
                stack.append((child, f"{where}/{key}"))
        elif kind is list:
            stack.extend((child, f"{where}/{i}") for i, child in enumerate(item))
        elif kind is float:
            if not math.isfinite(item):
                raise StateNotJSON(f"{what} is not JSON: {item} at {where or '/'}")
        elif kind is int:
            if not -(2**63) <= item < 2**64:
                raise StateNotJSON(f"{what} is not JSON: integer at {where or '/'} exceeds 64 bits")
        elif kind is str or kind is bool or item is None:
            continue
        else:
            raise StateNotJSON(
                f"{what} is not JSON: {kind.__name__} at {where or '/'}"
                " (use only dict, list, str, int, float, bool and None)"
            )


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


EMPTY_PATCH = b"[]"


def patched(parent_hash: str, ops_bytes: bytes) -> str:
    """The state hash of a checkpoint stored as the patch ``ops_bytes`` on a parent whose
    state hash is ``parent_hash``. The preimage starts with a word no JSON text starts with,
    so it can never be mistaken for a whole state's."""
    if ops_bytes == EMPTY_PATCH:
        return parent_hash
    h = hashlib.sha256(b"patch\n")
    h.update(parent_hash.encode())
    h.update(b"\n")
    h.update(ops_bytes)
    return h.hexdigest()


def seal(state_hash: str, data: bytes, key: bytes = b"") -> str:
    """A snapshot's digest: its bytes bound to the state hash they are the state of. With
    ``key`` (kept outside the database) an HMAC, so a snapshot cannot be forged either."""
    material = b"snapshot\n" + state_hash.encode() + b"\n" + hashlib.sha256(data).digest()
    if key:
        return hmac.new(key, material, hashlib.sha256).hexdigest()
    return hashlib.sha256(material).hexdigest()


def chain_hash(
    parent_chain: str,
    state_hash: str,
    *,
    run_id: str,
    seq: int,
    step: str,
    next_step: str,
    schema_version: int,
    agent_version: str,
    key: bytes = b"",
) -> str:
    """Hash linking a checkpoint to its parent. With ``key`` (kept outside the database)
    it is an HMAC, so a writer with database access alone cannot forge a valid chain."""
    material = "\x1f".join(
        (
            parent_chain,
            state_hash,
            run_id,
            str(seq),
            step,
            next_step,
            str(schema_version),
            agent_version,
        )
    ).encode()
    if key:
        return hmac.new(key, material, hashlib.sha256).hexdigest()
    return hashlib.sha256(material).hexdigest()
