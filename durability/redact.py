"""Keeping secrets out of everything that is written: one gate, and keyed argument hashes.

Two nets. Values under keys that look like secrets (``api_key``, ``password``,
``authorization``...) are replaced in JSON documents (``redact``) where a document is built.
And any text that contains a value the execution read through ``ctx.secret`` is scrubbed by
one gate on its way out of the process, whatever wrote it:

- the executor opens a ``scope`` for each execution, holding the secrets it has read so far
  (the set grows as steps call ``ctx.secret``); nothing else needs to know about secrets;
- every SQL statement on a Django connection passes ``_gate`` (an execute wrapper added to
  every connection as it is created, first in line, so other wrappers see scrubbed
  parameters), and so do the engine's statements that bypass Django's cursors: the prepared
  hot statements (``checkpoints.fetch_one_prepared``) and the commits sent ahead
  (``inflight``) call ``scrub`` on their parameters;
- log records are scrubbed when they are made (a record factory, see ``install_log_gate``),
- spans when they end (``durability.spans.Redacting``, in front of the SDK's processors),
- blobs before their content is hashed (``durability.blobs``).

Why a scope and a gate rather than redacting at each call site: a write path added later
(an error column, an event, a log line) is covered without knowing about secrets, which is
how the effect error and the transient retry's error leaked before. The gate is a context
variable lookup when the scope is empty (every process but an executing worker, every thread
but the executing one), so it costs nothing where there is nothing to hide. Records are
scrubbed at creation rather than by handler filters because handlers are added after this
app is ready (Celery's, a deployment's) and some format on other threads, where the scope is
not visible.

Hashed bytes never change under the gate: the executor redacts a step's state before it
hashes it and refuses a state that still holds a secret (in a key), the values a step gets
back (call and effect results, approval payloads) are redacted before they are recorded or
hashed so that a replay sees what the first run saw, and the snapshot thread has no scope.

Inside a scope, ``redact`` also replaces the scope's secrets, so that a document built in
memory by code a step calls (a message it sends, a child's input) is the document the gate
lets through: a repeated send compares equal to the stored one. A text clipped to a column's
size in the middle of a secret loses the part it kept (at least ``MIN_SECRET_CHARS`` of it).

A secret shorter than ``MIN_SECRET_CHARS`` is refused by ``ctx.secret``: scrubbing every
statement for a short string would also rewrite identifiers and lookups that happen to
contain it.

Argument hashes (``keyed_hash``) are HMAC-SHA256 under a key that is not in the database,
so a stored hash is no verifier of a secret among the arguments: ``DURABILITY_HMAC_KEY``
when set, else derived from Django's ``SECRET_KEY``, each through a purpose string. A stored
hash is accepted (``accepted_hashes``) under the current key, under the fallback keys
(``DURABILITY_HMAC_KEY_FALLBACKS``, ``SECRET_KEY_FALLBACKS``, and the ``SECRET_KEY``-derived
key once an explicit key is set), and as the plain SHA-256 that rows written before keyed
hashes hold: a run in flight across the upgrade or a key rotation replays without a false
non-determinism error. The stored form stays 64 hex characters with no mark of its scheme,
so nothing is migrated: either form matches only the arguments it was made of, so which one
a row holds never needs telling apart. (An approval's payload hash stays a plain SHA-256: it
is taken over the redacted payload, which is stored next to it anyway.)
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from typing import Any

from django.conf import settings

from durability.conf import conf

REDACTED = "[redacted]"
MIN_SECRET_CHARS = 8

DEFAULT_PATTERN = (
    r"(?i)^(?:.*[_\-.])?(?:api[_\-]?key|apikey|secret|secret[_\-]?key|client[_\-]?secret"
    r"|token|access[_\-]?token|refresh[_\-]?token|id[_\-]?token|auth[_\-]?token|bearer"
    r"|password|passwd|pwd|passphrase|authorization|credentials?|private[_\-]?key"
    r"|cookie|set[_\-]?cookie|session[_\-]?(?:id|key))$"
)


@lru_cache(maxsize=4)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern or DEFAULT_PATTERN)


def key_pattern() -> re.Pattern[str]:
    return _compiled(conf.SECRET_KEY_PATTERN or DEFAULT_PATTERN)


def is_secret_key(key: str) -> bool:
    return bool(key_pattern().match(key))


# --- the scope: the secrets of the execution running in this context ------------------------

_scope: ContextVar[set[str] | None] = ContextVar("durability_secrets", default=None)


@contextmanager
def scope(secrets: set[str]) -> Iterator[set[str]]:
    """Scrub ``secrets`` (a set the caller may add to while the scope is open) from
    everything written in this context until the scope closes."""
    token = _scope.set(secrets)
    try:
        yield secrets
    finally:
        _scope.reset(token)


def remember(secret: str) -> None:
    """Add ``secret`` to the open scope, if any."""
    current = _scope.get()
    if current is not None:
        current.add(secret)


def active() -> set[str] | None:
    """The open scope's secrets, or None (also when it holds none yet)."""
    return _scope.get() or None


@lru_cache(maxsize=256)
def _forms(secret: str) -> tuple[str, ...]:
    """The ways ``secret`` is spelled in written text: as it is, escaped in JSON (as orjson and
    as ``json`` with ASCII escapes write it), escaped twice (a JSON text held in a JSON
    string: a row bound as one JSON object, whose columns hold JSON texts) and in a Python
    ``repr``."""
    import json

    import orjson

    escaped = [orjson.dumps(secret).decode()[1:-1], json.dumps(secret)[1:-1]]
    forms = [
        secret,
        *escaped,
        *(orjson.dumps(form).decode()[1:-1] for form in escaped),
        repr(secret)[1:-1],
    ]
    return tuple(sorted(set(forms), key=len, reverse=True))


@lru_cache(maxsize=256)
def _byte_forms(secret: str) -> tuple[bytes, ...]:
    return tuple(form.encode() for form in _forms(secret))


def _scrub_str(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        for form in _forms(secret):
            if form in text:
                text = text.replace(form, REDACTED)
        if len(secret) > MIN_SECRET_CHARS:
            text = _clip_tail(text, secret)
    return text


def _clip_tail(text: str, secret: str) -> str:
    """A text cut short in the middle of a secret (an error clipped to a column's size) ends
    with the secret's beginning: at least ``MIN_SECRET_CHARS`` of it are replaced too."""
    head = secret[:MIN_SECRET_CHARS]
    at = text.find(head, max(0, len(text) - len(secret) + 1))
    while at != -1:
        if secret.startswith(text[at:]):
            return text[:at] + REDACTED
        at = text.find(head, at + 1)
    return text


def _scrub_bytes(data: bytes, secrets: Iterable[str]) -> bytes:
    for secret in secrets:
        for form in _byte_forms(secret):
            if form in data:
                data = data.replace(form, REDACTED.encode())
    return data


def scrub(value: Any, secrets: Iterable[str] | None = None) -> Any:
    """``value`` with the open scope's secrets (or ``secrets``) replaced by ``REDACTED`` in
    every text and byte string, through lists, tuples and dicts (a statement's parameters);
    ``value`` itself when there is nothing to replace. Other types are left as they are."""
    if secrets is None:
        secrets = _scope.get()
        if not secrets:
            return value
    return _scrub(value, tuple(secrets))


def _scrub(value: Any, secrets: tuple[str, ...]) -> Any:
    kind = type(value)
    if kind is str:
        return _scrub_str(value, secrets)
    if kind is bytes:
        return _scrub_bytes(value, secrets)
    if kind is bytearray or kind is memoryview:
        data = bytes(value)
        new = _scrub_bytes(data, secrets)
        return value if new == data else new
    if kind is list:
        return [_scrub(v, secrets) for v in value]
    if kind is tuple:
        return tuple(_scrub(v, secrets) for v in value)
    if kind is dict:
        return {k: _scrub(v, secrets) for k, v in value.items()}
    if isinstance(value, str):  # an enum member and the like: written as its text
        text = _scrub_str(str(value), secrets)
        return value if text == str(value) else text
    return value


def contains_secret(data: bytes | str, secrets: Iterable[str]) -> bool:
    """Whether ``data`` holds any spelling of any of ``secrets``."""
    if isinstance(data, str):
        return any(form in data for s in secrets for form in _forms(s))
    return any(form in data for s in secrets for form in _byte_forms(s))


def _gate(execute: Any, sql: str, params: Any, many: bool, context: dict) -> Any:
    """The execute wrapper every Django connection runs its statements through."""
    secrets = _scope.get()
    if secrets:
        found = tuple(secrets)
        sql = _scrub_str(sql, found) if isinstance(sql, str) else sql
        if params is not None:
            params = [_scrub(p, found) for p in params] if many else _scrub(params, found)
    return execute(sql, params, many, context)


def install_database_gate(connection: Any) -> None:
    """Put the gate first among ``connection``'s execute wrappers, once. First, so that
    ``connection.execute_wrapper()`` blocks, which pop the last wrapper on their way out,
    never take the gate with them, and so that they see scrubbed parameters."""
    wrappers = connection.execute_wrappers
    if _gate not in wrappers:
        wrappers.insert(0, _gate)


def on_connection_created(sender: Any, connection: Any, **kwargs: Any) -> None:
    install_database_gate(connection)


# --- log records ---------------------------------------------------------------------------


def _scrub_record(record: logging.LogRecord, secrets: tuple[str, ...]) -> None:
    try:
        message = record.getMessage()
    except Exception:  # a record that cannot format: logging reports it later, as usual
        return
    clean = _scrub_str(message, secrets)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and not record.exc_text:
        text = logging.Formatter().formatException(record.exc_info)
        clean = _scrub_str(text, secrets)
        if clean != text:
            # Formatters print exc_text when it is set; the exception itself goes, so that no
            # formatter of its own writes its message again.
            record.exc_text, record.exc_info = clean, None
    if record.stack_info:
        record.stack_info = _scrub_str(record.stack_info, secrets)


def install_log_gate() -> None:
    """Scrub every log record made while a scope holds secrets, once per process."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "durability_gate", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        secrets = _scope.get()
        if secrets:
            _scrub_record(record, tuple(secrets))
        return record

    factory.durability_gate = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


# --- JSON documents --------------------------------------------------------------------------


def redact(value: Any, secrets: Iterable[str] = ()) -> tuple[Any, bool]:
    """Return ``(value with secrets replaced, whether anything was replaced)``: values under
    secret-looking keys, and strings holding ``secrets`` or the open scope's secrets.

    Containers are changed in place; a bare string is returned anew."""
    pattern = key_pattern()
    values = tuple(s for s in secrets if s)
    scoped = _scope.get()
    if scoped:
        values = tuple(dict.fromkeys((*values, *scoped)))
    return _redact(value, pattern, values)


def _redact(value: Any, pattern: re.Pattern[str], secrets: tuple[str, ...]) -> tuple[Any, bool]:
    kind = type(value)
    changed = False
    if kind is dict:
        for key, child in value.items():
            if isinstance(key, str) and pattern.match(key):
                if child is not None and child != REDACTED:
                    value[key] = REDACTED
                    changed = True
                continue
            if type(child) in (dict, list) or (secrets and type(child) is str):
                new, did = _redact(child, pattern, secrets)
                if did:
                    value[key] = new
                    changed = True
    elif kind is list:
        for i, child in enumerate(value):
            if type(child) in (dict, list) or (secrets and type(child) is str):
                new, did = _redact(child, pattern, secrets)
                if did:
                    value[i] = new
                    changed = True
    elif kind is str and secrets:
        for secret in secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
                changed = True
    return value, changed


def restore_placeholders(edited: Any, original: Any) -> Any:
    """Where an edited document still holds the placeholder, put back the original value,
    so that a redacted value round-trips as "unchanged" and the placeholder is never saved.
    """
    if edited == REDACTED:
        return original
    if type(edited) is dict and type(original) is dict:
        return {k: restore_placeholders(v, original.get(k)) for k, v in edited.items()}
    if type(edited) is list and type(original) is list:
        return [
            restore_placeholders(v, original[i] if i < len(original) else None)
            for i, v in enumerate(edited)
        ]
    return edited


# --- keyed hashes ----------------------------------------------------------------------------

_ARGS_PURPOSE = b"durability.args-hash"


@lru_cache(maxsize=8)
def _keys(
    explicit: str, fallbacks: tuple[str, ...], secret_key: str, secret_fallbacks: tuple[str, ...]
) -> tuple[bytes, ...]:
    # The current key first; then every key a row in flight may have been hashed under.
    materials = [explicit or secret_key, *fallbacks, secret_key, *secret_fallbacks]
    keys = []
    for material in dict.fromkeys(m for m in materials if m):
        # A key of its own for this purpose: an argument hash and a chain hash are never
        # made with the same key.
        keys.append(hmac.digest(material.encode(), _ARGS_PURPOSE, "sha256"))
    if not keys:  # no key configured at all: still keyed, by the purpose alone
        keys.append(_ARGS_PURPOSE)
    return tuple(keys)


_KEY_SETTINGS = frozenset(
    ("DURABILITY_HMAC_KEY", "DURABILITY_HMAC_KEY_FALLBACKS", "SECRET_KEY", "SECRET_KEY_FALLBACKS")
)
_current_keys: tuple[bytes, ...] | None = None


def _hash_keys() -> tuple[bytes, ...]:
    # Kept between calls (reading four settings, absent ones raising inside getattr, cost
    # twice the hash itself); a changed setting drops it (``on_setting_changed``).
    global _current_keys
    if _current_keys is None:
        _current_keys = _keys(
            conf.HMAC_KEY,
            conf.HMAC_KEY_FALLBACKS,
            getattr(settings, "SECRET_KEY", "") or "",
            tuple(getattr(settings, "SECRET_KEY_FALLBACKS", ()) or ()),
        )
    return _current_keys


def on_setting_changed(setting: str = "", **kwargs: Any) -> None:
    global _current_keys
    if setting in _KEY_SETTINGS:
        _current_keys = None


def keyed_hash(data: bytes) -> str:
    """HMAC-SHA256 of ``data`` under the current key, as 64 hex characters."""
    return hmac.new(_hash_keys()[0], data, hashlib.sha256).hexdigest()


def accepted_hashes(data: bytes) -> set[str]:
    """Every stored hash of ``data`` a replay accepts: under each key (current and
    fallbacks), and the plain SHA-256 of rows written before argument hashes were keyed."""
    found = {hashlib.sha256(data).hexdigest()}
    found.update(hmac.new(key, data, hashlib.sha256).hexdigest() for key in _hash_keys())
    return found
