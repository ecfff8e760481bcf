"""What a saver remembers of the threads it served, bounded, and safe to change from the
threads its calls come on at once.

Per thread (its namespace's row): the last checkpoint stored or read (the next one is a
patch on it), the run's last known checkpoint number, and the encoder that remembers the
messages it encoded; those of the threads used last, at most ``cached_threads`` of them
and at most ``cached_bytes`` of state (as stored: canonical JSON) between them. The rows
themselves are remembered for ``IDENTITIES`` times as many threads. A thread forgotten is
read again from the database when it comes back.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from durability.langgraph import codec, status
from durability.langgraph.latest import Stored
from durability.langgraph.models import Thread

# Threads whose rows a saver knows, per thread whose state it may keep (``cached_threads``):
# a row (the thread's and its run's) is about 5 KB, and finding one again goes through the
# saver's own thread, one at a time (200 conversations at once, 100 states kept and their
# rows forgotten with them: 2.7 s). A thread whose state the byte bound dropped keeps its row.
IDENTITIES = 4


def weight(stored: Stored) -> int:
    """What a kept checkpoint counts against ``cached_bytes``: its state's canonical
    length, and its bytes too when it holds them (a checkpoint with a snapshot). The
    process holds about two to three times that: the state's objects, and the messages
    its encoder keeps (measured: 518 KB for a 216 KB state, 29 KB for a 3.6 KB one)."""
    return stored.size + (len(stored.data) if stored.data is not None else 0)


class Memory:
    """The maps, each change under ``lock`` (held by the caller too where it reads and
    then changes; never through a statement)."""

    def __init__(self, cached_threads: int, cached_bytes: int, reporter: status.Reporter) -> None:
        self.cached_threads = cached_threads
        self.cached_bytes = cached_bytes
        self.lock = threading.RLock()
        self._reporter = reporter
        # The threads used last, least recent first (``remember``).
        self._threads: OrderedDict[tuple[str, str], Thread] = OrderedDict()
        # By thread row: least recent first (``keep``).
        self._last: OrderedDict[int, Stored] = OrderedDict()
        # Each kept checkpoint's ``weight`` as it was kept (its bytes may be made later,
        # ``store.exact_patch``), and their sum.
        self._weights: dict[int, int] = {}
        self._bytes = 0
        self._head_seq: dict[int, int] = {}
        self._encoders: dict[int, codec.Encoder] = {}
        # Namespaces ``get_tuple`` found no checkpoint in (``note_absent``).
        self._absent: set[tuple[str, str]] = set()

    def thread(self, thread_id: str, ns: str) -> Thread | None:
        return self._threads.get((thread_id, ns))

    def last(self, pk: int) -> Stored | None:
        """The thread row's last checkpoint stored or read, if kept."""
        return self._last.get(pk)

    def head_seq(self, pk: int) -> int:
        """The last checkpoint number the thread row's run is known to have."""
        return self._head_seq.get(pk, 0)

    def encoder(self, pk: int, serde: Any) -> codec.Encoder:
        with self.lock:
            found = self._encoders.get(pk)
            if found is None:  # made only when missing: this is every checkpoint's path
                found = self._encoders[pk] = codec.Encoder(serde)
            return found

    def used(self, thread_id: str, ns: str) -> None:
        """The namespace's thread as the most recently used, if it is still known."""
        with self.lock:
            if (thread_id, ns) in self._threads:
                self._threads.move_to_end((thread_id, ns))

    def is_known(self, thread: Thread) -> bool:
        """Whether ``thread`` is still the row remembered for its namespace: not forgotten
        (deleted) while a call on it ran."""
        known = self._threads.get((thread.thread_id, thread.checkpoint_ns))
        return known is not None and known.pk == thread.pk

    def remember(self, thread: Thread, head_seq: int | None = None) -> None:
        """``thread`` as the most recently used (and its run's number, if given); those
        beyond ``IDENTITIES`` times ``cached_threads`` forgotten, least recent first, with
        anything a call still busy with one kept after it was."""
        with self.lock:
            self._threads[(thread.thread_id, thread.checkpoint_ns)] = thread
            if head_seq is not None:
                self._head_seq[thread.pk] = head_seq
            bound = self.cached_threads * IDENTITIES
            if len(self._threads) <= bound:
                return
            while len(self._threads) > bound:
                self._threads.popitem(last=False)
            live = {t.pk for t in self._threads.values()}
            gone = {pk for pk in (*self._last, *self._head_seq, *self._encoders) if pk not in live}
            for pk in gone:
                self._drop(pk)
            self._reporter.forget(gone)

    def keep(self, pk: int, stored: Stored, head_seq: int | None = None) -> None:
        """``stored`` as thread row ``pk``'s last checkpoint, the most recent (and its run's
        number, if given); the states of the least recent dropped while they are more than
        ``cached_threads`` or add up to more than ``cached_bytes`` (their threads are still
        known: the next call on one reads its state, not its row). The one just kept stays
        whatever its size: its thread's next checkpoint is a patch on it."""
        with self.lock:
            self._bytes += weight(stored) - self._weights.get(pk, 0)
            self._weights[pk] = weight(stored)
            self._last[pk] = stored
            self._last.move_to_end(pk)
            if head_seq is not None:
                self._head_seq[pk] = head_seq
            while len(self._last) > 1 and (
                len(self._last) > self.cached_threads or self._bytes > self.cached_bytes
            ):
                self._drop_state(next(iter(self._last)))

    def saw_head(self, pk: int, head_seq: int) -> None:
        """The run of thread row ``pk`` has at least ``head_seq`` checkpoints."""
        with self.lock:
            self._head_seq[pk] = max(head_seq, self._head_seq.get(pk, 0))

    def unsure(self, pk: int) -> None:
        """Whether the thread row's last checkpoint was stored is unknown: its head is read
        again, and its messages encoded again, next time."""
        with self.lock:
            self._drop_state(pk)

    def forget(self, thread: Thread) -> None:
        with self.lock:
            self._threads.pop((thread.thread_id, thread.checkpoint_ns), None)
            self._drop(thread.pk)
        self._reporter.forget({thread.pk})

    def note_absent(self, thread_id: str, ns: str) -> None:
        """The namespace has no checkpoint: its next ``put`` makes the thread without
        looking it up first (``store.thread_of``). A hint, bounded as the caches are."""
        with self.lock:
            if len(self._absent) >= self.cached_threads:
                self._absent.clear()
            self._absent.add((thread_id, ns))

    def take_absent(self, thread_id: str, ns: str) -> bool:
        """Whether the namespace was noted absent; the note is gone after."""
        with self.lock:
            absent = (thread_id, ns) in self._absent
            self._absent.discard((thread_id, ns))
            return absent

    def _drop_state(self, pk: int) -> None:
        """Forget the thread row's last checkpoint and encoder (under ``lock``)."""
        self._last.pop(pk, None)
        self._bytes -= self._weights.pop(pk, 0)
        self._encoders.pop(pk, None)

    def _drop(self, pk: int) -> None:
        """Forget all but the row of thread row ``pk`` (under ``lock``)."""
        self._drop_state(pk)
        self._head_seq.pop(pk, None)
