"""``DurableSaver``: LangGraph's ``BaseCheckpointSaver`` on this product's store.

Each namespace of a thread is a run of the graph (a subgraph's namespace a child run), each
LangGraph checkpoint one of the run's checkpoints: a patch on its parent, hash-chained,
verifiable with ``durability verify``.

On PostgreSQL, ``put``, ``put_writes`` and ``get_tuple`` run on the thread LangGraph calls
from, one statement each, on connections the saver owns (``pool``): up to ``connections``
calls at once, those on one thread's namespace one at a time; a new conversation's thread
is made there too, when ``get_tuple`` has just found it missing. The rest (a subgraph's new
run, ``list``, deleting, all of SQLite) runs on the saver's own thread and connection.
``close()``, garbage collection and exit close them. Async methods run the sync ones off
the event loop. A read finding its connection lost connects again and retries once.

A saver remembers, per thread, the last checkpoint it stored or read (the next one is a
patch on it) and the messages it encoded, for the threads it used last (at most
``cached_threads`` of them and ``cached_bytes`` of their states), and the rows of more
(``memory``): a process serving many conversations keeps its memory bounded, and a thread
it forgot is read again from the database when it comes back. What the saver costs per
superstep against LangGraph's PostgresSaver, and why, is in docs/performance.md.
"""

from __future__ import annotations

import asyncio
import builtins
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import copy_context
from typing import Any, TypeVar, cast

from django.db import DatabaseError, IntegrityError, connection
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
    SerializerProtocol,
    get_checkpoint_id,
    get_checkpoint_metadata,
)

from durability import canonical, checkpoints
from durability.langgraph import (
    codec,
    copying,
    delta,
    latest,
    lifetime,
    memory,
    options,
    pool,
    pruning,
    reader,
    shared,
    status,
    store,
)
from durability.langgraph.models import SavedCheckpoint, Thread
from durability.langgraph.shared import connected, lg_config
from durability.models import Run
from durability.store import langgraph as lg_store
from durability.store.reconnect import drop

T = TypeVar("T")


class DurableSaver(BaseCheckpointSaver[int]):
    """A LangGraph checkpointer on this product's store::

        graph = builder.compile(checkpointer=DurableSaver())

    ``graph`` names the runs its threads show up as (one saver per graph name).
    ``durability``: ``"strict"`` flushes each checkpoint to disk before ``put`` returns;
    ``"relaxed"`` does not wait for the flush (a database crash may lose the last fraction
    of a second of checkpoints, never corrupting them), as the product's levels do.
    ``cached_threads``: at most how many threads' last checkpoints are kept in memory;
    ``cached_bytes``: at most how many bytes of state (as stored, JSON) they hold between
    them, the least recently used dropped first (see the module's docstring).
    ``connections``: how many database connections its calls on PostgreSQL use at most,
    opened as calls need them (calls on as many threads run at once; more wait for a
    connection)."""

    def __init__(
        self,
        *,
        graph: str = "agent",
        durability: str = "strict",
        serde: SerializerProtocol | None = None,
        cached_threads: int = 1000,
        cached_bytes: int = 32 * 2**20,
        connections: int = 4,
    ) -> None:
        super().__init__(serde=serde)
        options.check(graph, durability, cached_threads, cached_bytes, connections)
        self.graph = graph
        self.durability = durability
        self.cached_threads = cached_threads
        self.cached_bytes = cached_bytes
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="durable-saver")
        self._worker_thread: threading.Thread | None = None
        self._snapshots = checkpoints.SnapshotWriter()
        self._status = status.Reporter()
        self._memory = memory.Memory(cached_threads, cached_bytes, self._status)
        # PostgreSQL: the connections of the calls made at every superstep (see the
        # module's docstring).
        self._fast = lg_store.for_connection(connection).one_statement
        self._pool = pool.Pool(connections)
        self._closer = lifetime.watch(self)
        self._origin: DurableSaver | None = None  # ``with_allowlist``

    # --- writing -------------------------------------------------------------------------

    def _put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        thread_id, ns = options.key(config)
        parent_id = config["configurable"].get("checkpoint_id") or ""
        thread = self._known(thread_id, ns)
        fields = dict(checkpoint)
        values = fields.pop("channel_values")
        md = get_checkpoint_metadata(config, metadata)
        mem = self._memory
        with self._pool.thread(thread_id, ns):
            encoder, seq = mem.encoder(thread.pk, self.serde), mem.head_seq(thread.pk) + 1
            doc = {
                "checkpoint": codec.Encoder(self.serde).encode(fields),
                "values": encoder.encode(values),
                "metadata": codec.Encoder(self.serde).encode(md),
            }
            # A change of the run's status this checkpoint makes (``status``: a turn's
            # start and end), written in its transaction.
            report = self._status.put(thread, checkpoint["id"], values, seq)
            riding = report.riding() if report is not None else None
            try:
                saved = self._on_db(
                    self._commit, thread, parent_id, checkpoint["id"], doc, md, riding
                )
            except latest.ThreadDeleted:
                mem.forget(thread)
                raise latest.ThreadDeleted(
                    f"thread {thread_id!r} (namespace {ns!r}) was deleted, by another"
                    " process, while this graph was writing it: nothing was stored. Invoke"
                    " the graph on it again to start it over."
                ) from None
            except BaseException:
                # Whether it was stored is unknown: read the thread's head again next time,
                # and say the run's status again.
                mem.unsure(thread.pk)
                self._status.not_stored(thread)
                raise
            with mem.lock:
                if mem.is_known(thread):  # not forgotten (deleted) meanwhile
                    mem.keep(thread.pk, saved, saved.seq)
        return lg_config(thread_id, ns, checkpoint["id"])

    def _commit(
        self,
        db: Any,
        thread: Thread,
        parent_id: str,
        lg_id: str,
        doc: Any,
        md: Any,
        report: lg_store.Report | None,
    ) -> latest.Stored:
        new = store.NewCheckpoint(
            thread=thread,
            parent=self._parent(db, thread, parent_id),
            seq=self._memory.head_seq(thread.pk) + 1,
            lg_id=lg_id,
            parent_lg_id=parent_id,
            doc=doc,
            metadata=doc["metadata"],
            step=f"{md.get('source', '')} {md.get('step', '')}".strip(),
        )
        relaxed = self.durability == "relaxed"
        return store.commit(new, self._snapshots, db, relaxed=relaxed, report=report)

    def _put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        if not writes:
            return
        thread_id, ns = options.key(config)
        checkpoint_id = config["configurable"]["checkpoint_id"]
        encoder = codec.Encoder(self.serde)
        rows = [
            (WRITES_IDX_MAP.get(channel, idx), channel, canonical.dumps(encoder.encode(value)))
            for idx, (channel, value) in enumerate(writes)
        ]
        replace = all(channel in WRITES_IDX_MAP for channel, _ in writes)
        thread = self._known(thread_id, ns)

        def write(db: Any) -> None:
            store.put_writes(
                thread.pk, checkpoint_id, task_id, task_path, rows, replace=replace, db=db
            )

        if self._fast:
            self._pool.run(write, retry=True)  # stored once whatever the tries
        else:
            write(connection)
        last, seq = self._memory.last(thread.pk), self._memory.head_seq(thread.pk)
        here = last is not None and last.lg_id == checkpoint_id  # read or put by this saver
        if r := self._status.writes(thread, checkpoint_id, writes, task_path, seq, task_id, here):
            self._call(r)

    def get_next_version(self, current: int | None, channel: None = None) -> int:
        """Integer versions: each checkpoint keeps its own channel values, so versions need
        no random part to tell two branches' values apart, and small numbers keep patches
        small."""
        if current is None:
            return 1
        if isinstance(current, str):  # a thread written by another saver
            return int(current.split(".")[0]) + 1
        return int(current) + 1

    # --- reading -------------------------------------------------------------------------

    def _get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        thread_id, ns = options.key(config)
        wanted = get_checkpoint_id(config) or ""
        if not self._fast:
            return self._call(self._get_tuple_orm, thread_id, ns, wanted)
        mem = self._memory
        with self._pool.thread(thread_id, ns):
            known = mem.thread(thread_id, ns)
            have = mem.last(known.pk) if known is not None else None
            try:
                found = self._pool.run(
                    lambda db: latest.read(db, thread_id, ns, wanted, have), retry=True
                )
            except BaseException:
                if known is not None:  # read the thread's head again next time
                    mem.unsure(known.pk)
                raise
            if found is None and not wanted:
                if known is None:
                    mem.note_absent(thread_id, ns)
                else:  # deleted meanwhile, by another process: made again at its next put
                    mem.forget(known)
            if found is None or found.stored is None:
                return None
            mem.take_absent(thread_id, ns)
            if known is None:
                known = Thread(
                    id=found.thread, thread_id=thread_id, checkpoint_ns=ns, run_id=found.run_id
                )
                mem.remember(known)
            mem.keep(found.thread, found.stored, found.head_seq)
            stored, writes = found.stored, reader.decoded_writes(found.writes, self.serde)
            read = shared.checkpoint_tuple(
                self.serde, thread_id, ns, stored.lg_id, found.lg_parent, stored.doc, writes
            )
            return self._status.read(known, read)

    def _get_tuple_orm(self, thread_id: str, ns: str, wanted: str) -> CheckpointTuple | None:
        thread = self._thread(thread_id, ns, create=False)
        if thread is None:
            return None
        rows = SavedCheckpoint.objects.filter(thread=thread)
        rows = rows.filter(lg_id=wanted) if wanted else rows.order_by("-lg_id")
        row = rows.values_list("checkpoint_id", "lg_id", "lg_parent_id").first()
        if row is None:
            if not wanted:  # perhaps deleted meanwhile, by another process: read it again
                self._memory.forget(thread)
            return None
        cp_id, lg_id, lg_parent = row
        last = self._memory.last(thread.pk)
        if last is None or last.id != cp_id:
            last = store.stored(thread, lg_id)
            if last is None:  # deleted meanwhile
                return None
            self._memory.keep(thread.pk, last)
        writes = reader.pending_writes(thread, [lg_id], self.serde).get(lg_id, [])
        read = shared.checkpoint_tuple(
            self.serde, thread_id, ns, lg_id, lg_parent, last.doc, writes
        )
        return self._status.read(thread, read)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        # Once, at once, on a new connection (``_on_worker`` dropped the lost one): the
        # saver's policy for a lost connection (see ``Shared.use``).
        try:
            found = self._call(self._listed, config, filter, before, limit)
        except DatabaseError:
            if self._call(connected):  # not a lost connection: nothing to try again
                raise
            found = self._call(self._listed, config, filter, before, limit)
        yield from found

    def _listed(
        self,
        config: RunnableConfig | None,
        filter: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> builtins.list[CheckpointTuple]:
        return reader.listed(config, filter, before, limit, self.serde)

    # --- deleting ------------------------------------------------------------------------

    def _delete_thread(self, thread_id: str) -> None:
        for thread in pruning.delete_thread(thread_id):
            self._memory.forget(thread)

    def _prune(self, thread_ids: Sequence[str], strategy: str) -> None:
        for thread in pruning.prune(thread_ids, strategy):
            self._memory.forget(thread)

    def _delete_for_runs(self, run_ids: Sequence[str]) -> None:
        for thread in pruning.delete_for_runs(run_ids, self.serde):
            self._memory.forget(thread)

    def _copy_thread(self, source: str, target: str) -> None:
        for thread in copying.copy_thread(source, target, graph=self.graph):
            # What was remembered of the target (read missing, deleted elsewhere): read again.
            self._memory.forget(thread)
            self._memory.take_absent(thread.thread_id, thread.checkpoint_ns)

    # --- LangGraph's delta channels --------------------------------------------------------

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        """What a ``DeltaChannel`` is rebuilt from (``delta.history``)."""
        return self._call(self._delta_history, config, channels) if channels else {}

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        return await self._acall(self._delta_history, config, channels) if channels else {}

    def _delta_history(
        self, config: RunnableConfig, channels: Sequence[str]
    ) -> dict[str, DeltaChannelHistory]:
        thread = self._thread(*options.key(config), create=False)
        if thread is None:
            return {ch: {"writes": []} for ch in channels}
        return delta.history(thread, get_checkpoint_id(config) or "", channels, self.serde)

    # --- the interface ---------------------------------------------------------------------

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        self._check_open()
        if self._fast:
            return self._put(config, checkpoint, metadata, new_versions)
        return self._call(self._put, config, checkpoint, metadata, new_versions)

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        self._check_open()
        if self._fast:
            self._put_writes(config, writes, task_id, task_path)
        else:
            self._call(self._put_writes, config, writes, task_id, task_path)

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        self._check_open()
        return self._get_tuple(config)

    def delete_thread(self, thread_id: str) -> None:
        """Delete the thread's runs (every namespace) with all their checkpoints."""
        self._call(self._delete_thread, thread_id)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``"delete"``: as ``delete_thread``. ``"keep_latest"``: LangGraph sees only the
        latest checkpoint of each namespace (its parent link cut, the others' pending
        writes deleted); the runs keep their whole history, as every run in this store
        does, until retention (``durability prune``) compacts it."""
        self._call(self._prune, thread_ids, strategy)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Take the checkpoints (and their writes) of LangGraph's runs ``run_ids`` out of
        LangGraph's view; the store keeps their history, as ``prune`` does (``pruning``)."""
        self._call(self._delete_for_runs, run_ids)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy a thread's whole history into a new thread (``copying``)."""
        self._call(self._copy_thread, source_thread_id, target_thread_id)

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await asyncio.to_thread(self.get_tuple, config)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        for item in await self._acall(self._listed, config, filter, before, limit):
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return await asyncio.to_thread(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        await asyncio.to_thread(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await self._acall(self._delete_thread, thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await self._acall(self._prune, thread_ids, strategy)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await self._acall(self._delete_for_runs, run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await self._acall(self._copy_thread, source_thread_id, target_thread_id)

    # --- helpers -------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the snapshots still being written, then close the saver's database
        connections and thread. Done at exit for a saver still open, and (on a thread of
        its own) for one that is garbage-collected (``lifetime``)."""
        lifetime.close(self._closer)

    def _check_open(self) -> None:
        """Every call refuses alike once the saver is closed: its connections and thread
        are gone (a call already running when it closed finishes)."""
        if not self._closer.alive:
            raise RuntimeError("this DurableSaver is closed: make a new one to go on")

    async def aclose(self) -> None:
        """``close``, off the event loop."""
        await asyncio.to_thread(self.close)

    def with_allowlist(self, extra_allowlist: Any) -> DurableSaver:
        """LangGraph's strict msgpack mode (``LANGGRAPH_STRICT_MSGPACK``) compiles and
        invokes a graph with a shallow copy of its saver whose serializer loads only the
        graph's types. The copy shares this saver's connections, threads and memory, and
        holds this saver, whose collection closes them, as long as it lives."""
        clone = cast(DurableSaver, super().with_allowlist(extra_allowlist))
        if clone is not self:
            clone._origin = self._origin or self
        return clone

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the saver's thread (directly if there), in the caller's context."""
        self._check_open()
        if threading.current_thread() is self._worker_thread:
            return fn(*args)
        return self._worker.submit(copy_context().run, self._on_worker, fn, *args).result()

    async def _acall(self, fn: Callable[..., T], *args: Any) -> T:
        self._check_open()
        return await asyncio.wrap_future(
            self._worker.submit(copy_context().run, self._on_worker, fn, *args)
        )

    def _on_worker(self, fn: Callable[..., T], *args: Any) -> T:
        # Never with a thread's lock (``_pool.thread``) held, which calls waiting for this
        # thread may hold: it takes none on PostgreSQL, and is the only caller elsewhere.
        self._worker_thread = threading.current_thread()
        try:
            return fn(*args)
        except DatabaseError as exc:
            if (said := shared.explained(exc)) is not None:
                raise said from exc
            if not connected():
                drop(connection)  # lost: the next call connects again
            raise

    def _on_db(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(connection, *args)``: a connection of the saver's pool on PostgreSQL, else
        the saver's thread's."""
        if self._fast:
            return self._pool.run(lambda db: fn(db, *args))
        return fn(connection, *args)

    def run_of(self, thread_id: str, checkpoint_ns: str = "") -> Run | None:
        """The run that holds a thread's namespace, if it was stored."""
        thread = (
            Thread.objects.select_related("run")
            .filter(thread_id=str(thread_id), checkpoint_ns=checkpoint_ns)
            .first()
        )
        return thread.run if thread else None

    def _thread(self, thread_id: str, ns: str, *, create: bool) -> Thread | None:
        mem = self._memory
        thread = mem.thread(thread_id, ns)
        if thread is None:
            thread, start = store.thread_of(
                thread_id,
                ns,
                graph=self.graph,
                create=create,
                absent=mem.take_absent(thread_id, ns),
                durability=self.durability,
            )
            if thread is None:
                return None
            self._adopt(thread, start)
        return thread

    def _adopt(self, thread: Thread, start: latest.Stored | None) -> None:
        """Remember a thread found or made (``start``: its first checkpoint, if made)."""
        self._memory.remember(thread, thread.run.head_seq)
        if start is not None:
            self._memory.keep(thread.pk, start)
        self._status.known(thread)

    def _known(self, thread_id: str, ns: str) -> Thread:
        """The namespace's thread, made if new. One call makes it; the thread's other calls
        meanwhile (``put_writes`` with the first ``put``) wait on its lock, then find it."""
        mem = self._memory
        thread = mem.thread(thread_id, ns)
        if thread is not None:
            mem.used(thread_id, ns)
            return thread
        with self._pool.thread(thread_id, ns):
            thread = mem.thread(thread_id, ns)
            if thread is None and self._fast and not ns and mem.take_absent(thread_id, ns):
                thread = self._make(thread_id)
            if thread is None:
                # On the saver's thread, which takes no thread's lock: waited for with one.
                thread = self._call(lambda: self._thread(thread_id, ns, create=True))
        assert thread is not None
        return thread

    def _make(self, thread_id: str) -> Thread | None:
        """A new conversation's thread, made on the caller's thread and one of the saver's
        connections, without looking it up first: this saver's ``get_tuple`` just found
        nothing there. (Not a subgraph's namespace: its run is a child of its parent's,
        which the saver's thread looks up.) None if another process made it meanwhile."""
        try:
            thread, start = self._pool.run(
                lambda db: store.new_thread(
                    thread_id, "", graph=self.graph, parent=None, db=db, durability=self.durability
                )
            )
        except IntegrityError:
            return None
        self._adopt(thread, start)
        return thread

    def _parent(self, db: Any, thread: Thread, parent_id: str) -> latest.Stored:
        """The checkpoint a new one is patched on: the last one written or read, else read
        (the run's empty first checkpoint for a thread's first)."""
        last = self._memory.last(thread.pk)
        if last is not None and last.lg_id == parent_id:
            return last
        if not self._fast:
            found = store.stored(thread, parent_id) if parent_id else None
            return found if found is not None else store.start_of(thread)
        if parent_id:
            read = latest.read(db, thread.thread_id, thread.checkpoint_ns, parent_id, None)
            if read is not None and read.stored is not None:
                self._memory.saw_head(thread.pk, read.head_seq)
                return read.stored
        return latest.start(db, thread.run_id)
