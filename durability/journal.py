"""Recording a journaled call's result: one statement, committed as soon as the call returns.

On PostgreSQL the insert-if-absent is a single prepared ``INSERT ... ON CONFLICT DO NOTHING``
in autocommit: one round trip and one flush, where the ORM's ``save()`` in a transaction
took three round trips and about four times as long (a ``ctx.call`` is on every agent's
hot path). Elsewhere (SQLite), and inside an explicit transaction, the ORM does it.
"""

from __future__ import annotations

from django.db import IntegrityError, connection, transaction

from durability.checkpoints import fetch_one_prepared
from durability.models import JournalEntry

_INSERT = """
INSERT INTO durability_journalentry
    (run_id, base_id, key, occurrence, kind, step, function, args_hash, result, duration_ms,
     meta, replays, reused_from, created_at)
VALUES (%(run)s::uuid, %(base)s::bigint, %(key)s::text, %(occurrence)s::integer,
        %(kind)s::text, %(step)s::text, %(function)s::text, %(args_hash)s::text,
        %(result)s::text, %(duration_ms)s::float8, %(meta)s::text, 0,
        %(reused_from)s::bigint, now())
ON CONFLICT ON CONSTRAINT journal_identity DO NOTHING
RETURNING id, created_at
"""


def insert_if_absent(entry: JournalEntry) -> JournalEntry:
    """Store ``entry`` unless its operation identity (base, key, occurrence) is recorded
    already; return the stored one (``entry`` itself, saved, or the earlier record)."""
    if connection.vendor == "postgresql" and not connection.in_atomic_block:
        row = fetch_one_prepared(
            _INSERT,
            {
                "run": entry.run_id,
                "base": entry.base_id,
                "key": entry.key,
                "occurrence": entry.occurrence,
                "kind": entry.kind,
                "step": entry.step,
                "function": entry.function,
                "args_hash": entry.args_hash,
                "result": entry.result,
                "duration_ms": entry.duration_ms,
                "meta": entry.meta,
                "reused_from": entry.reused_from,
            },
        )
        if row is not None:
            entry.pk, entry.created_at = row
            entry._state.adding = False
            entry._state.db = connection.alias
            return entry
    else:
        try:
            with transaction.atomic():
                entry.save(force_insert=True)
            return entry
        except IntegrityError:
            pass
    return JournalEntry.objects.get(
        base_id=entry.base_id, key=entry.key, occurrence=entry.occurrence
    )
