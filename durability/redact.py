"""Redaction of secrets before anything is written, so no secret enters the hash chain.

Two nets: values under keys that look like secrets (``api_key``, ``password``,
``authorization``...) and any string that contains a value the run read through
``ctx.secret``. A redacted value reads as ``REDACTED`` everywhere; forms that round-trip
state treat that placeholder as "unchanged".
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from django.conf import settings

REDACTED = "[redacted]"

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
    return _compiled(getattr(settings, "DURABILITY_SECRET_KEY_PATTERN", "") or DEFAULT_PATTERN)


def is_secret_key(key: str) -> bool:
    return bool(key_pattern().match(key))


def redact(value: Any, secrets: Iterable[str] = ()) -> tuple[Any, bool]:
    """Return ``(value with secrets replaced, whether anything was replaced)``.

    Containers are changed in place; a bare string is returned anew."""
    pattern = key_pattern()
    values = tuple(s for s in secrets if s)
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
