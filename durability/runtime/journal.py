"""Recording a journaled call's result: one statement, committed as soon as the call returns.

The insert-if-absent is the store's (``Store.insert_journal_if_absent``): on PostgreSQL a
single prepared ``INSERT ... ON CONFLICT DO NOTHING`` in autocommit, one round trip and one
flush, where the ORM's ``save()`` in a transaction took three round trips and about four
times as long (a ``ctx.call`` is on every agent's hot path). Elsewhere (SQLite), and inside
an explicit transaction, the model's manager does it.
"""

from __future__ import annotations

from durability.models import JournalEntry
from durability.store import store


def insert_if_absent(entry: JournalEntry) -> JournalEntry:
    """Store ``entry`` unless its operation identity (base, key, occurrence) is recorded
    already; return the stored one (``entry`` itself, saved, or the earlier record)."""
    return store().insert_journal_if_absent(entry)
