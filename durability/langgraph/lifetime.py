"""When a saver's threads and connections are closed: by ``close()``, at once; at exit,
every saver still open; and when the garbage collector frees a saver that was never
closed, by a thread of this module's (the reaper), never where the collection happened.

A collection starts wherever an allocation happens to cross the collector's threshold, in
any thread, with whatever locks that thread holds: inside ``ThreadPoolExecutor.submit``,
for one, which holds the lock every executor's ``submit`` takes, so that closing the saver
there (which hands its Django connection's close to the saver's own thread) would wait for
ever. The finalizer only puts the saver's threads and connections on a queue whose ``put``
may be called from anywhere (``queue.SimpleQueue``)."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import queue
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.db import connection

from durability import checkpoints
from durability.langgraph.pool import Pool

log = logging.getLogger(__name__)

_collected: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
_open: weakref.WeakSet[Any] = weakref.WeakSet()  # savers not closed yet, for the exit
_lock = threading.Lock()
_reaper_pid = 0  # the process whose reaper runs (a forked child starts its own)
_at_exit_registered = False


def shut(worker: ThreadPoolExecutor, snapshots: checkpoints.SnapshotWriter, owned: Pool) -> None:
    """Close a saver's snapshot thread, database connections and thread, waiting for the
    snapshots still being written."""
    snapshots.close()
    owned.close()
    # At exit the executors may already be shut down: then there is nothing to close.
    with contextlib.suppress(RuntimeError):
        worker.submit(lambda: connection.close()).result()
    worker.shutdown()


def watch(saver: Any) -> weakref.finalize:
    """The finalizer that hands ``saver``'s resources (``saver._worker``, ``_snapshots``,
    ``_pool``) to the reaper when it is collected; ``close`` runs it at once.
    Called from the saver's constructor: an ordinary place to start the reaper."""
    global _at_exit_registered
    with _lock:
        _start_reaper()
        if not _at_exit_registered:
            atexit.register(_at_exit)
            _at_exit_registered = True
        _open.add(saver)
    closer = weakref.finalize(saver, _collected.put, (saver._worker, saver._snapshots, saver._pool))
    closer.atexit = False  # ``_at_exit`` closes the savers still open, in order
    return closer


def close(closer: weakref.finalize) -> None:
    """Close now what ``closer`` (``watch``) would hand to the reaper; nothing if closed.
    Called on a thread that runs an event loop (an async app's shutdown), where Django
    refuses to close a connection, the closing is done on a thread of its own."""
    found = closer.detach()
    if found is None:
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        shut(*found[2][0])
        return
    closing = threading.Thread(target=shut, args=found[2][0], name="durable-saver-close")
    closing.start()
    closing.join()


def wait_collected(timeout: float = 30.0) -> bool:
    """Wait until the savers collected so far are closed (the reaper takes them in order);
    False if that took longer than ``timeout`` seconds."""
    with _lock:
        _start_reaper()
    done = threading.Event()
    _collected.put((done,))
    return done.wait(timeout)


def _start_reaper() -> None:
    """The reaper of this process, started once (a forked child starts its own)."""
    global _reaper_pid
    if _reaper_pid != os.getpid():
        _reaper_pid = os.getpid()
        threading.Thread(target=_reap, name="durable-saver-reaper", daemon=True).start()


def _reap() -> None:
    while True:
        _take(_collected.get())


def _at_exit() -> None:
    for saver in list(_open):
        saver.close()
    with contextlib.suppress(queue.Empty):
        while True:
            _take(_collected.get_nowait())


def _take(item: tuple[Any, ...]) -> None:
    """A collected saver's resources, shut; or ``wait_collected``'s mark, answered."""
    if isinstance(item[0], threading.Event):
        item[0].set()
        return
    try:
        shut(*item)
    except Exception:  # noqa: BLE001 - one saver's end must not end the reaper
        log.warning("a LangGraph saver was not closed cleanly", exc_info=True)
