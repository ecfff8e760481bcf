"""A worker announces the agent versions it can run, and listens on a queue of its own, so
that a run goes only to a worker able to continue it (durability.presence)."""

from __future__ import annotations

import logging
import threading

from django.conf import settings
from django.db import connection

from durability.conf import conf

log = logging.getLogger(__name__)

_stop = threading.Event()
_name: list[str] = []


def direct_queue(node: str) -> str:
    return f"{settings.CELERY_TASK_DEFAULT_QUEUE}.w.{node}"


def start(node: str) -> None:
    """In the main worker process once it is ready: announce now, then keep announcing.

    Every announcement is made on the presence thread's own connection, which holds the
    worker's liveness lock for as long as the process lives (durability.presence)."""
    from durability import presence

    _name[:] = [node]
    _stop.clear()
    interval = conf.PRESENCE_SECONDS
    first = threading.Event()

    def renew() -> None:
        try:
            while True:
                try:
                    presence.announce(node, hold=True)
                except Exception:  # the database is away: the next round tries again
                    log.warning("could not renew the presence of %s", node, exc_info=True)
                    connection.close()  # frees the lock too; the next round takes it again
                first.set()
                if _stop.wait(interval):
                    return
        finally:
            connection.close()

    threading.Thread(target=renew, name="presence", daemon=True).start()
    # Ready means announced: a run started right after must be able to find this worker.
    first.wait(timeout=10)


def stop(timeout: float = 5.0) -> None:
    """Shutting down: stop announcing and withdraw, so no run is routed here any more.

    Called from Celery's SIGTERM handler, which may interrupt this very thread in the middle
    of a query (a solo pool runs tasks in the main thread): a query on the thread's own
    connection would wait forever for the one it interrupted. So the withdrawal is made on a
    thread, and connection, of its own."""
    from durability import presence

    _stop.set()
    if not _name:
        return
    node = _name[0]

    def withdraw() -> None:
        try:
            presence.withdraw(node)
        except Exception:
            log.warning("could not withdraw the presence of %s", node, exc_info=True)
        finally:
            connection.close()

    thread = threading.Thread(target=withdraw, name="presence-withdraw", daemon=True)
    thread.start()
    thread.join(timeout)
