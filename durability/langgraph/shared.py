"""A database connection a saver owns and uses from whichever thread LangGraph calls it on
(one at a time): Django's connections belong to the thread that opened them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections
from langgraph.checkpoint.base import Checkpoint, CheckpointTuple

from durability.langgraph import codec
from durability.store import langgraph as lg_store
from durability.store import unmigrated
from durability.store.reconnect import drop

if TYPE_CHECKING:
    from langchain_core.runnables import RunnableConfig

T = TypeVar("T")


class Shared:
    """A database connection of the saver's own, used from any thread, one at a time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._db: Any = None
        self.drops = 0  # connections found lost and dropped so far

    def use(self, fn: Callable[[Any], T], *, retry: bool = False) -> T:
        """``fn(connection)``; the caller holds the lock. A connection found broken after
        an error is dropped (``reconnect.drop``), so the next call connects again; with
        ``retry`` (for what is safe to do twice) that next call is made at once."""
        # Not ``reconnect.retrying``: these calls are on the path of a graph's superstep,
        # which LangGraph's caller waits for. One immediate try on a new connection gets
        # past a dropped session; a database that is away reaches LangGraph at once as an
        # error, rather than holding the graph for DURABILITY_DB_WAIT_SECONDS.
        for again in (retry, False):
            fresh = self._db is None
            if fresh:
                self._db = connections.create_connection(DEFAULT_DB_ALIAS)
                self._db.inc_thread_sharing()
            try:
                if fresh:
                    lg_store.for_connection(self._db).own_session()
                return fn(self._db)
            except DatabaseError as exc:
                if (said := explained(exc)) is not None:
                    raise said from exc
                if self._db.connection is not None and self._db.is_usable():
                    raise
                drop(self._db)
                self._db = None
                self.drops += 1
                if not again:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def explained(exc: DatabaseError) -> DatabaseError | None:
    """``exc`` said again with what to do where the product's tables are missing (the
    database was never migrated: PostgreSQL's "relation ... does not exist", SQLite's "no
    such table"); None for any other error."""
    said = unmigrated(exc)
    return None if said is None else type(exc)(f"{said} (see docs/langgraph.md)")


def connected() -> bool:
    """Whether this thread's database connection is open and answers."""
    return connection.connection is not None and connection.is_usable()


def lg_config(thread_id: str, ns: str, lg_id: str) -> RunnableConfig:
    """LangGraph's config naming one checkpoint of a thread's namespace."""
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": lg_id}}


def checkpoint_tuple(
    serde: Any, thread_id: str, ns: str, lg_id: str, lg_parent: str, doc: Any, writes: list
) -> CheckpointTuple:
    """A stored checkpoint's document as LangGraph's ``CheckpointTuple``, in new objects."""
    return CheckpointTuple(
        config=lg_config(thread_id, ns, lg_id),
        checkpoint=cast(
            Checkpoint,
            {
                **codec.decode(doc["checkpoint"], serde),
                "channel_values": codec.decode(doc["values"], serde),
            },
        ),
        metadata=codec.decode(doc["metadata"], serde),
        parent_config=lg_config(thread_id, ns, lg_parent) if lg_parent else None,
        pending_writes=writes,
    )
