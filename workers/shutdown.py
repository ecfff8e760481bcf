"""Graceful SIGTERM for workers that execute long runs.

A run's task loops over steps, so Celery's warm shutdown ("finish the current task") could
wait for a whole run. Instead the worker finishes the current step, hands the run back to
the queue and returns. A step still running after the grace period is abandoned (``Abandon``
is raised in it), and the run is handed back all the same; another worker resumes it from
its last checkpoint.

Two paths lead here: SIGTERM to the main process (Celery's warm shutdown; the flag is
shared with the pool's children through memory inherited across fork, and each child's
grace period starts when it sees it) and SIGTERM to a child directly (systemd and
process-group kills). A child stopped directly exits once it has
handed its run back, and the pool replaces it. With a pool that runs tasks in the main
process itself (``--pool solo``), Celery's own SIGTERM handler stays: its warm shutdown sets
the flag, and the grace period starts then.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

from durability.conf import conf
from durability.errors import Abandon

_shared = None  # a multiprocessing.Value made by the main process before the pool forks
_main_pid: int | None = None  # the worker's main process
_local = threading.Event()
_begin_lock = threading.Lock()
_in_step = threading.Event()
_installed = False
_grace_installed = False


def prepare() -> None:
    """In the main worker process, before the pool starts."""
    global _shared, _main_pid
    _shared = multiprocessing.Value("b", 0, lock=False)
    _main_pid = os.getpid()


def announce() -> None:
    """In the main worker process, when Celery begins a warm shutdown."""
    _local.set()
    if _shared is not None:
        _shared.value = 1
    if _grace_installed:
        _start_grace_timer()  # tasks run in this process (solo pool): the grace starts now


def requested() -> bool:
    return _local.is_set() or (_shared is not None and bool(_shared.value))


def install_child_handler() -> None:
    """In a pool child, before its first task: billiard resets SIGTERM to "exit now" after
    the process initialiser, so this is installed at task start instead. In the worker's
    main process (a solo pool) SIGTERM stays Celery's, or the worker would never stop: only
    the grace period's end is handled here."""
    global _installed, _grace_installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGUSR2, _on_grace_over)
    _installed = True
    if os.getpid() == _main_pid:
        _grace_installed = True
        return
    signal.signal(signal.SIGTERM, _on_term)
    # The worker's own warm shutdown reaches this child only through the shared flag (the
    # main process waits for the task): its grace period starts when the flag is seen.
    threading.Thread(target=_watch_shared_flag, name="shutdown-watch", daemon=True).start()


# How often a pool child looks at the worker's shutdown flag: the grace period may start
# this much late.
WATCH_SECONDS = 0.5


def _watch_shared_flag() -> None:
    while not _local.is_set():
        if _shared is not None and _shared.value:
            _begin_grace()
            return
        time.sleep(WATCH_SECONDS)


def _on_term(signum, frame) -> None:
    _begin_grace()


def _begin_grace() -> None:
    """This child was told to stop (its own SIGTERM, or the worker's flag): the grace period
    starts, once however many of them say so."""
    with _begin_lock:
        if _local.is_set():
            return
        _local.set()
    _start_grace_timer()


def _start_grace_timer() -> None:
    grace = conf.SHUTDOWN_GRACE_SECONDS
    timer = threading.Timer(grace, os.kill, args=(os.getpid(), signal.SIGUSR2))
    timer.daemon = True
    timer.start()


def _on_grace_over(signum, frame) -> None:
    if _in_step.is_set():
        raise Abandon("the step did not finish within the shutdown grace period")


class executing:  # noqa: N801 - used as a context manager
    """Marks the span during which ``Abandon`` may be raised into the task."""

    def __enter__(self) -> None:
        _in_step.set()

    def __exit__(self, *exc: object) -> None:
        _in_step.clear()
        if _local.is_set() and threading.current_thread() is threading.main_thread():
            _exit_after_handing_back()


def _exit_after_handing_back() -> None:
    """A pool child told to stop on its own (SIGTERM to the child, not to the worker) has
    handed its run back: now it stops, as it was asked to. Living on with the flag set, it
    would take every run it is given and hand it straight back, in a loop. Its task's message
    is redelivered (the worker was lost before acknowledging it): a duplicate ring for a run
    already rung, which is harmless. The pool starts a new child in its place."""
    if _shared is not None and bool(_shared.value):
        return  # the whole worker is stopping: Celery's warm shutdown ends this child
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
