"""What the CLI's subcommands share: exit codes, reading JSON arguments and writing JSON,
ages."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.utils import timezone

from durability import rollbacks
from durability.errors import InvalidInput, StateNotJSON

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTEGRITY, EXIT_WAITING, EXIT_TIMEOUT = 1, 2, 3, 4, 5
EXIT_DATABASE = 6


def json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise StateNotJSON(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        # The parser recurses once per level: past Python's limit it would otherwise end
        # the command with a traceback.
        raise StateNotJSON(f"{what} is nested too deeply to be read as JSON") from None


class _Encoder(DjangoJSONEncoder):
    """The API's renderer's: datetimes in RFC 3339 to the millisecond, UTC as ``Z``."""

    def default(self, o: Any) -> Any:
        try:
            return super().default(o)
        except TypeError:
            return str(o)


def json_text(value: Any) -> str:
    """``value`` as ``--json`` prints it: indented, with the API's time format."""
    return json.dumps(value, indent=2, cls=_Encoder)


def effect_decisions(plan: Any, given: list[str]) -> dict[int, str]:
    """``--effect ID=CHOICE`` (ID: an effect id, or the key of effects done after the target)
    as the engine's decisions; the engine checks each choice."""
    decisions: dict[int, str] = {}
    for item in given:
        ref, sep, choice = item.partition("=")
        if not sep:
            raise InvalidInput(
                f"--effect {item!r}: give ID=CHOICE, e.g. --effect refund=compensate"
            )
        matched = [e.id for e in plan.done_not_undone if str(e.id) == ref or e.key == ref]
        if not matched:
            raise InvalidInput(
                f"--effect {item!r}: no effect {ref!r} was done after checkpoint #{plan.target.seq}"
            )
        for effect_id in matched:
            before = decisions.get(effect_id)
            if before is not None and before != choice.strip():
                # Two choices for one effect (by its id and by its key, say): which one the
                # operator meant is theirs to say, not the last one's.
                raise InvalidInput(
                    f"--effect {item!r}: effect {effect_id} was given {before!r} already;"
                    " give one choice per effect"
                )
            decisions[effect_id] = choice.strip()
    try:
        return rollbacks.check_decisions(plan.done_not_undone, decisions)
    except ValueError as exc:
        raise InvalidInput(str(exc), run_id=plan.run.id) from None


def age(when: datetime | None) -> str:
    if when is None:
        return "-"
    seconds = max(0, int((timezone.now() - when).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"
