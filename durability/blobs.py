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

Blobs no row refers to any more (their runs were pruned) are collected by retention
(``stored`` and ``delete_if_older`` below, called from ``durability.retention``): only once
older than a grace period, since a step stores its blobs before the checkpoint that refers
to them commits, and storing a blob that exists already refreshes its time for the same
reason.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from durability import redact
from durability.conf import conf
from durability.errors import IntegrityViolation, InvalidInput

KEY = "$blob"


def is_ref(value: Any) -> bool:
    return type(value) is dict and KEY in value and len(value) == 3


def threshold() -> int:
    return conf.BLOB_BYTES


def _name(digest: str) -> str:
    return f"{digest[:2]}/{digest}"


def put(value: str | bytes) -> dict:
    """Store ``value`` (once) and return its reference. A secret of the execution storing it
    is redacted first (``durability.redact``): the reference names what is stored."""
    value = redact.scrub(value)
    if isinstance(value, str):
        data, kind = value.encode(), "text"
    elif isinstance(value, bytes | bytearray | memoryview):
        data, kind = bytes(value), "bytes"
    else:
        raise InvalidInput(f"a blob is text or bytes, not {type(value).__name__}")
    digest = hashlib.sha256(data).hexdigest()
    alias = conf.BLOB_STORAGE
    if alias:
        from django.core.files.base import ContentFile
        from django.core.files.storage import storages

        storage = storages[alias]
        if not storage.exists(_name(digest)):
            storage.save(_name(digest), ContentFile(data))
        elif overwrites(storage):
            # Stored again, so that a collection of it as unreferenced waits another grace
            # period: the checkpoint that refers to it has not committed yet.
            storage.save(_name(digest), ContentFile(data))
    else:
        _put_local(digest, data)
    return {KEY: digest, "bytes": len(data), "kind": kind}


def _folder() -> str:
    return conf.BLOB_DIR


def _put_local(digest: str, data: bytes) -> None:
    path = os.path.join(_folder(), _name(digest))
    if os.path.exists(path):
        try:
            os.utime(path)  # see put() on storages: not collectable for another grace period
            return
        except FileNotFoundError:
            pass  # collected in between: write it again
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
    alias = conf.BLOB_STORAGE
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


# --- collection of blobs nothing refers to ---------------------------------------------------


def overwrites(storage: Any) -> bool:
    """Whether saving under an existing name replaces the file (S3's default, or
    ``FileSystemStorage(allow_overwrite=True)``) instead of picking another name: only then
    can a re-stored blob's time be refreshed, and only then are its blobs collected."""
    # django-storages' S3 names it file_overwrite; Django's FileSystemStorage keeps its
    # allow_overwrite option in a private attribute.
    return any(
        getattr(storage, name, False) is True
        for name in ("file_overwrite", "allow_overwrite", "_allow_overwrite")
    )


def stored() -> Iterator[tuple[str, datetime | None]]:
    """Every blob in the store: its digest and when it was last stored."""
    alias = conf.BLOB_STORAGE
    if alias:
        from django.core.files.storage import storages

        storage = storages[alias]
        try:
            prefixes, _ = storage.listdir("")
        except (FileNotFoundError, NotImplementedError):
            return
        for prefix in prefixes:
            for name in storage.listdir(prefix)[1]:
                if _is_digest(name):
                    try:
                        at = storage.get_modified_time(f"{prefix}/{name}")
                    except (NotImplementedError, OSError):
                        at = None
                    yield name, at
        return
    root = _folder()
    if not os.path.isdir(root):
        return
    for prefix in os.listdir(root):
        folder = os.path.join(root, prefix)
        if len(prefix) != 2 or not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            if _is_digest(name):
                try:
                    mtime = os.stat(os.path.join(folder, name)).st_mtime
                except FileNotFoundError:
                    continue
                yield name, datetime.fromtimestamp(mtime, UTC)


def collectable_here() -> tuple[bool, str]:
    """Whether this store's unreferenced blobs may be collected, and if not, why."""
    alias = conf.BLOB_STORAGE
    if not alias:
        return True, ""
    from django.core.files.storage import storages

    if not overwrites(storages[alias]):
        return False, (
            f"storage {alias!r} does not overwrite on save, so a blob stored again cannot be"
            " protected from collection; set allow_overwrite (or file_overwrite) on it"
        )
    return True, ""


def delete_if_older(digest: str, cutoff: datetime) -> bool:
    """Delete a blob unless it was stored again since ``cutoff``; True if it was deleted."""
    alias = conf.BLOB_STORAGE
    if alias:
        from django.core.files.storage import storages

        storage = storages[alias]
        if storage.get_modified_time(_name(digest)) >= cutoff:
            return False
        storage.delete(_name(digest))
        return True
    path = os.path.join(_folder(), _name(digest))
    # Moved aside first: a put() that touches the blob from here on finds it gone and
    # writes it again, and one that touched it just before is seen in its time.
    aside = os.path.join(os.path.dirname(path), f".collecting-{digest}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    if datetime.fromtimestamp(os.stat(aside).st_mtime, UTC) >= cutoff:
        if not os.path.exists(path):
            os.rename(aside, path)
        else:
            os.unlink(aside)
        return False
    os.unlink(aside)
    return True


def _is_digest(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)
