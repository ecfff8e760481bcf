"""The store: every SQL statement the engine writes by hand and every difference between the
databases it runs on, behind one interface (``base.Store``) with one implementation per
dialect (``postgres.PostgresStore``, ``sqlite.SqliteStore``) and one policy for a lost
connection (``reconnect``).

Callers ask ``store()`` for the store of Django's default connection (or
``for_connection(conn)`` for another one) and call its named methods; ORM queries through
the models' managers stay with their callers, since they read the same on both databases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import connection as _default

if TYPE_CHECKING:
    from durability.store.base import Store

_by_dialect: dict[str, type[Store]] = {}


def _implementation(dialect: str) -> type[Store]:
    if not _by_dialect:
        # Imported on first use: the store's modules import the models, which need the apps.
        from durability.store.postgres import PostgresStore
        from durability.store.sqlite import SqliteStore

        _by_dialect.update(postgresql=PostgresStore, sqlite=SqliteStore)
    try:
        return _by_dialect[dialect]
    except KeyError:
        raise NotImplementedError(
            f"the engine runs on PostgreSQL or SQLite, not on {dialect!r}"
        ) from None


def for_connection(conn: Any) -> Store:
    """The store of one Django connection (a wrapper from ``django.db.connections``)."""
    return _implementation(conn.vendor)(conn)


_stores: dict[str, Store] = {}


def store() -> Store:
    """The store of Django's default connection (this thread's session)."""
    dialect = _default.vendor
    found = _stores.get(dialect)
    if found is None:
        found = _stores[dialect] = _implementation(dialect)(_default)
    return found


def unmigrated(exc: BaseException) -> str | None:
    """What to do when ``exc`` says the product's tables are missing (the database was never
    migrated: PostgreSQL's "relation ... does not exist", SQLite's "no such table"), on one
    line; None for any other error."""
    text = str(exc).strip()
    if 'relation "durability_' not in text and "no such table: durability_" not in text:
        return None
    # The first line: PostgreSQL's next ones point into the statement.
    return (
        f"{text.splitlines()[0]}: this database has no tables of the product's; create them"
        " with python manage.py migrate"
    )


__all__ = ["for_connection", "store", "unmigrated"]
