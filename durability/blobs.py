"""A content-addressed store for values too large for a state row.

A blob is kept once, under the SHA-256 of its bytes, and the state holds a reference
``{"$blob": "<sha256>", "bytes": n, "kind": "text"|"bytes"}``: checkpoints that share a
value share the blob, and the hash chain covers the blob's hash because the reference is
part of the hashed state. Nothing loads a blob when a run is rehydrated; a step reads one
when it needs it (``ctx.blob(value)``), and its bytes are checked against the hash.

Where blobs live: a local folder by default (``DURABILITY_BLOB_DIR``; written to a
temporary file, flushed and renamed, so a blob is durable before the checkpoint that refers
to it commits), or any Django storage backend (S3...) named by ``DURABILITY_BLOB_STORAGE``
(an alias in ``STORAGES``).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

from django.conf import settings

from durability.errors import IntegrityViolation, InvalidInput

KEY = "$blob"


def is_ref(value: Any) -> bool:
    return type(value) is dict and KEY in value and len(value) == 3


def threshold() -> int:
    return int(getattr(settings, "DURABILITY_BLOB_BYTES", 256 * 1024))


def _name(digest: str) -> str:
    return f"{digest[:2]}/{digest}"


def put(value: str | bytes) -> dict:
    """Store ``value`` (once) and return its reference."""
    if isinstance(value, str):
        data, kind = value.encode(), "text"
    elif isinstance(value, bytes | bytearray | memoryview):
        data, kind = bytes(value), "bytes"
    else:
        raise InvalidInput(f"a blob is text or bytes, not {type(value).__name__}")
    digest = hashlib.sha256(data).hexdigest()
    alias = getattr(settings, "DURABILITY_BLOB_STORAGE", "")
    if alias:
        from django.core.files.base import ContentFile
        from django.core.files.storage import storages

        storage = storages[alias]
        if not storage.exists(_name(digest)):
            storage.save(_name(digest), ContentFile(data))
    else:
        _put_local(digest, data)
    return {KEY: digest, "bytes": len(data), "kind": kind}


def _folder() -> str:
    return str(getattr(settings, "DURABILITY_BLOB_DIR", "") or settings.VAR_DIR / "blobs")


def _put_local(digest: str, data: bytes) -> None:
    path = os.path.join(_folder(), _name(digest))
    if os.path.exists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".incoming-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def get(ref: dict) -> str | bytes:
    """The value a reference names, checked against its hash."""
    if not is_ref(ref):
        raise InvalidInput("not a blob reference")
    digest = ref[KEY]
    alias = getattr(settings, "DURABILITY_BLOB_STORAGE", "")
    try:
        if alias:
            from django.core.files.storage import storages

            with storages[alias].open(_name(digest), "rb") as f:
                data = f.read()
        else:
            with open(os.path.join(_folder(), _name(digest)), "rb") as f:
                data = f.read()
    except (FileNotFoundError, OSError) as exc:
        raise IntegrityViolation(f"blob {digest} is missing ({exc})") from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise IntegrityViolation(f"blob {digest} does not match its hash")
    return data.decode() if ref.get("kind") == "text" else data


def offload(value: Any, limit: int) -> tuple[Any, bool]:
    """Replace, in place, strings longer than ``limit`` bytes with blob references."""
    kind = type(value)
    if kind is str:
        if len(value) > limit // 4 and len(value.encode()) > limit:
            return put(value), True
        return value, False
    changed = False
    if kind is dict:
        if is_ref(value):
            return value, False
        for key, child in value.items():
            new, did = offload(child, limit)
            if did:
                value[key] = new
                changed = True
    elif kind is list:
        for i, child in enumerate(value):
            new, did = offload(child, limit)
            if did:
                value[i] = new
                changed = True
    return value, changed


def needs_offload(value: Any, limit: int) -> bool:
    """Whether ``value`` holds a string that ``offload`` would move (without moving it)."""
    kind = type(value)
    if kind is str:
        return len(value) > limit // 4 and len(value.encode()) > limit
    if kind is dict:
        return not is_ref(value) and any(needs_offload(v, limit) for v in value.values())
    if kind is list:
        return any(needs_offload(v, limit) for v in value)
    return False
