"""Changing stored bytes behind the engine's back, as corruption or someone with database
access would."""

from __future__ import annotations

from django.db import connection

COLUMNS = {"mutation": "ops", "snapshot": "state"}


def rewrite(table: str, checkpoint_id: int, old: str, new: str) -> None:
    """Replace ``old`` with ``new`` in a checkpoint's stored patch or snapshot."""
    column = COLUMNS[table]
    with connection.cursor() as cur:
        cur.execute(
            f"UPDATE durability_{table} SET {column} = replace({column}, %s, %s)"
            " WHERE checkpoint_id = %s",
            [old, new, checkpoint_id],
        )
        assert cur.rowcount == 1, f"no {table} row for checkpoint id {checkpoint_id}"
