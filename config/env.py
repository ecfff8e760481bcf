"""Tiny typed readers for settings from the environment that fail loudly on bad values, and
the embedded default's private files (its var dir, database and generated secret key)."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path
from typing import Any

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str | None = None) -> str:
    # Empty counts as unset everywhere, so a copied .env.example with blank lines means the
    # defaults it names, not empty values.
    value = os.environ.get(name)
    if value is None or not value.strip():
        if default is None:
            raise ImproperlyConfigured(f"environment variable {name} is required")
        return default
    return value


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a whole number") from None


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from None


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use 1/0, true/false)")


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices``, as given in any case."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    for choice in choices:
        if raw.strip().lower() == choice.lower():
            return choice
    raise ImproperlyConfigured(f"{name}={raw!r} is not one of {', '.join(choices)}")


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]


def private_dir(path: Path, *, tighten: bool = True) -> Path:
    """``path`` as a directory only its owner can enter (0700): created so, and an existing
    one of ours tightened (``tighten``), since it holds the database and the secret key."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        if not tighten:
            return path
    # mkdir's mode is masked by the umask; chmod is not. Only our own folder, never one
    # another user set up for us.
    if path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o777 != 0o700:
        path.chmod(0o700)
    return path


def private_sqlite_files(sender: Any = None, connection: Any = None, **kwargs: Any) -> None:
    """On each new SQLite connection (``connection_created``): its database file and the
    -wal and -shm files SQLite made beside it, readable by this user only (0600). They hold
    password hashes and sessions. SQLite creates them with the umask's mode, before any row
    is written; the var dir around them is 0700 already. Done when a connection opens, not
    when settings load, so that a build step (collectstatic in an image) creates nothing."""
    if connection is None:
        return
    from durability.store import for_connection

    for path in for_connection(connection).private_files():
        try:
            found = os.stat(path)
        except FileNotFoundError:
            continue
        if found.st_uid == os.getuid() and found.st_mode & 0o077:
            os.chmod(path, 0o600)


def generated_secret(path: Path) -> str:
    """A random key kept in ``path`` (0600): made on first start, read on every later one.
    Web, worker and beat may start at the same moment: the key is written to a private
    temporary file and published with link(), which fails if another process published
    first; then that one's key is used."""
    for _ in range(50):
        try:
            key = path.read_text().strip()
        except FileNotFoundError:
            key = ""
        except PermissionError:
            # Another user's key in our own folder: left by a build step run as root (an
            # image's collectstatic). It cannot sign our sessions: ours replaces it.
            if path.parent.stat().st_uid != os.getuid():
                raise
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_uid != os.getuid():  # not one a sibling just published
                    path.unlink()
            continue
        if key:
            if path.stat().st_mode & 0o077 and path.stat().st_uid == os.getuid():
                path.chmod(0o600)
            return key
        if not path.exists():
            temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
            fd = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(50) + "\n")
                out.flush()
                os.fsync(out.fileno())
            try:
                os.link(temporary, path)
            except FileExistsError:
                pass
            finally:
                temporary.unlink()
            continue
        time.sleep(0.02)  # an empty file: someone else's key is on its way
    raise ImproperlyConfigured(f"{path} is empty: delete it, or set SECRET_KEY")
