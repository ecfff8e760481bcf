"""PostgreSQL's hand-written statements of the LangGraph saver (``langgraph.PostgresLangGraph``
runs them): each one round trip.

A checkpoint is one statement, data-modifying CTEs chained on the UPDATE of the run that
allocates its number, which also changes the run's status when the checkpoint does (a
turn's start and end, ``commit_reporting``); a task's pending writes one ``INSERT ... ON
CONFLICT`` over a JSON array of ``[index, channel, value]`` (one text parameter: binding
three arrays cost the saver's thread about 40% more CPU per call, measured; the ``json``
type keeps each value's text as it was sent, so the canonical bytes are stored unchanged); a
checkpoint with everything its state is rebuilt from (and its pending writes) one recursive
query. Each is prepared once per session of the saver's own connections, with a generic
plan (``PostgresLangGraph.own_session``).

Once per thread or per change of its status, on the saver's own thread: a new thread's rows
(``new_thread``: the rows Django would save, one ``INSERT`` per CTE, each row one JSON
parameter) and a status report with its event that follows a task's writes rather than a
checkpoint (``report``: lifecycle's change of the run, rendered); prepared too, on that
thread's connection.
"""

from __future__ import annotations

from typing import Any

import orjson
from django.db.models import Field, Model

from durability import lifecycle
from durability.langgraph.models import PendingWrite, SavedCheckpoint, Thread
from durability.models import Checkpoint, Event, Mutation, Run, Snapshot

# What the saver's runs and checkpoints are stored as.
AGENT_VERSION = "langgraph"
SCHEMA_VERSION = 1

_COMMIT = """
WITH cfg AS (SELECT {lowered} AS v), {guard}r AS (
    UPDATE {run} SET head_seq = head_seq + 1, updated_at = now(){sets}{also}
     WHERE id = %(run)s::uuid AND head_seq = %(head_seq)s::integer
       AND (SELECT v FROM cfg) IS NOT NULL{recheck}
 RETURNING id, head_seq{go}
), c AS (
    INSERT INTO {checkpoint}
        (run_id, seq, parent_id, reason, step, next_step, state_hash, chain_hash,
         schema_version, agent_version, size, delta_size, delta_run, commit_id,
         config_hash, packages, replay_counters, created_by, created_at)
    SELECT r.id, r.head_seq, %(parent)s::bigint, 'step', %(step)s::text, '',
           %(state_hash)s::text, %(chain_hash)s::text, {schema}, '{version}',
           %(size)s::integer, %(delta_size)s::integer, %(delta_run)s::bigint,
           %(commit_id)s::uuid, '', '', '', '', now()
      FROM r
 RETURNING id
), m AS (
    INSERT INTO {mutation} (checkpoint_id, run_id, seq, ops, count)
    SELECT c.id, r.id, r.head_seq, %(ops)s::text, %(count)s::integer FROM c, r
), l AS (
    INSERT INTO {saved} (checkpoint_id, thread_id, lg_id, lg_parent_id, metadata)
    SELECT c.id, %(thread)s::bigint, %(lg_id)s::text, %(lg_parent)s::text,
           %(metadata)s::jsonb FROM c
){snapshot}, e AS (
    INSERT INTO {event} (run_id, kind, seq, step, actor, reason, worker, data, created_at)
    SELECT r.id, 'checkpoint', r.head_seq, %(step)s::text, '', '', '', %(data)s::text, now()
      FROM r{numbered}
){reported}
SELECT id FROM c
"""
_SNAPSHOT = """, s AS (
    INSERT INTO {snapshot} (checkpoint_id, run_id, seq, state, digest)
    SELECT c.id, r.id, r.head_seq, %(snapshot)s::text, %(digest)s::text FROM c, r
)"""
# A status report in the checkpoint's statement: whether it applies, read as the statement
# found the run; the same UPDATE that numbers the checkpoint changes the status too (one new
# version of the row, not two), and inserts its event only if it did. If another
# transaction changed the run meanwhile so that the answer differs (an operator's cancel
# committed while this statement waited for the row), the UPDATE finds no row, as when
# another writer took the number: the saver reads the head again and sends the statement
# again, which then reads the run as it is. Cheaper than locking the row to read it.
_GUARD = """g AS (
    SELECT {condition} AS go FROM {run} WHERE id = %(run)s::uuid
), """


def _commit_sql(
    with_snapshot: bool, relaxed: bool, report: tuple[str, list[tuple[str, str]], str] | None = None
) -> str:
    """The checkpoint's statement; ``report``: the condition under which the run's status
    changes, the assignments it makes then, and its event's INSERT (``commit_reporting``)."""
    snap = _SNAPSHOT.format(snapshot=Snapshot._meta.db_table) if with_snapshot else ""
    # relaxed: this statement's transaction does not wait for the WAL flush (the
    # product's relaxed level; see docs/architecture.md).
    lowered = "set_config('synchronous_commit', 'off', true)" if relaxed else "''"
    guard = sets = also = recheck = go = numbered = reported = ""
    if report is not None:
        condition, assignments, event = report
        guard = _GUARD.format(condition=condition, run=Run._meta.db_table)
        also = "\n      FROM g"
        recheck = f"\n       AND ({condition}) = g.go"
        sets = "".join(
            f",\n           {column} = CASE WHEN g.go THEN {value} ELSE {column} END"
            for column, value in assignments
        )
        go = ", g.go"
        # Taken from ``e``'s row, so inserted after it: the timeline (in the order of the
        # events' ids) shows the checkpoint, then what it changed, as the ORM writes them.
        numbered = " RETURNING id"
        reported = f", u AS (\n    {event} WHERE r.go\n)"
    return _COMMIT.format(
        lowered=lowered,
        guard=guard,
        sets=sets,
        also=also,
        recheck=recheck,
        go=go,
        numbered=numbered,
        reported=reported,
        run=Run._meta.db_table,
        checkpoint=Checkpoint._meta.db_table,
        mutation=Mutation._meta.db_table,
        saved=SavedCheckpoint._meta.db_table,
        event=Event._meta.db_table,
        snapshot=snap,
        schema=SCHEMA_VERSION,
        version=AGENT_VERSION,
    )


# By (with an inline snapshot, relaxed).
COMMIT = {
    (snapshot, relaxed): _commit_sql(snapshot, relaxed)
    for snapshot in (False, True)
    for relaxed in (False, True)
}

HEAD_SEQ = f"SELECT head_seq FROM {Run._meta.db_table} WHERE id = %s"

_WRITES = """
WITH cfg AS (SELECT set_config('synchronous_commit', 'off', true) AS v)
INSERT INTO {table} (thread_id, checkpoint_id, task_id, idx, channel, task_path, value)
SELECT %(thread)s::bigint, %(checkpoint)s::text, %(task)s::text, (w->>0)::integer, w->>1,
       %(path)s::text, (w->2)::text
  FROM cfg, json_array_elements(%(rows)s::json) AS w
 WHERE cfg.v IS NOT NULL
ON CONFLICT (thread_id, checkpoint_id, task_id, idx) DO {conflict}
RETURNING idx
"""
# By whether a write already stored is replaced.
WRITES = {
    replace: _WRITES.format(
        table=PendingWrite._meta.db_table,
        conflict="UPDATE SET channel = EXCLUDED.channel, value = EXCLUDED.value,"
        " task_path = EXCLUDED.task_path"
        if replace
        else "NOTHING",
    )
    for replace in (False, True)
}

_READ = """
WITH RECURSIVE t AS (
    SELECT h.id, h.run_id, r.head_seq FROM {thread} h JOIN {run} r ON r.id = h.run_id
     WHERE h.thread_id = %(thread)s AND h.checkpoint_ns = %(ns)s
), l AS (
    -- Within the thread's own entries of the index (thread, LangGraph id), whatever the
    -- plan: a join could walk the index across other threads' checkpoints.
    SELECT s.checkpoint_id, s.lg_id, s.lg_parent_id FROM t CROSS JOIN LATERAL (
           SELECT s.checkpoint_id, s.lg_id, s.lg_parent_id FROM {saved} s
            WHERE s.thread_id = t.id {which} LIMIT 1) s
), chain(id, parent_id, depth, state_hash, stop) AS (
    SELECT c.id, c.parent_id, 0, c.state_hash,
           c.id = %(have)s
           OR (SELECT true FROM {snapshot} s WHERE s.checkpoint_id = c.id) IS NOT NULL
      FROM {checkpoint} c JOIN l ON c.id = l.checkpoint_id
    UNION ALL
    -- One parent per row, by its key: never a scan of the table, whatever the planner
    -- believes of its size (a join here became one scan per step on a young database).
    SELECT p.id, p.parent_id, chain.depth + 1, p.state_hash,
           p.id = %(have)s
           OR (SELECT true FROM {snapshot} s WHERE s.checkpoint_id = p.id) IS NOT NULL
      FROM chain CROSS JOIN LATERAL (
           SELECT p.id, p.parent_id, p.state_hash FROM {checkpoint} p
            WHERE p.id = chain.parent_id LIMIT 1) p
     WHERE NOT chain.stop
), path AS (
    SELECT chain.id, chain.depth, chain.state_hash,
           CASE WHEN chain.id = %(have)s THEN NULL
                WHEN chain.stop
                THEN (SELECT s.state FROM {snapshot} s WHERE s.checkpoint_id = chain.id)
                ELSE (SELECT m.ops FROM {mutation} m WHERE m.checkpoint_id = chain.id) END AS text,
           CASE WHEN chain.stop AND chain.id <> %(have)s
                THEN (SELECT s.digest FROM {snapshot} s WHERE s.checkpoint_id = chain.id)
           END AS digest
      FROM chain
), head AS (
    SELECT t.id, t.run_id, t.head_seq, l.lg_id, l.lg_parent_id,
           c.seq, c.state_hash, c.chain_hash, c.step, c.next_step, c.schema_version,
           c.agent_version, c.delta_run, c.size,
           coalesce(nullif(c.parent_chain, ''), p.chain_hash, ''),
           (SELECT array_agg(ARRAY[w.task_id, w.idx::text, w.channel, w.task_path, w.value])
              FROM {writes} w WHERE w.thread_id = t.id AND w.checkpoint_id = l.lg_id)
      FROM t JOIN l ON true
      JOIN {checkpoint} c ON c.id = l.checkpoint_id
      LEFT JOIN {checkpoint} p ON p.id = c.parent_id
)
SELECT path.id, path.state_hash, path.text, path.digest, head.*
  FROM path LEFT JOIN head ON path.depth = 0
 ORDER BY path.depth DESC
"""
# By whether one checkpoint is named (else the latest): two statements, so that each one's
# plan, made once per session (``PostgresLangGraph.own_session``), fits every call of it.
READ = {
    by_id: _READ.format(
        which="AND s.lg_id = %(lg)s" if by_id else "ORDER BY s.lg_id DESC",
        thread=Thread._meta.db_table,
        run=Run._meta.db_table,
        saved=SavedCheckpoint._meta.db_table,
        checkpoint=Checkpoint._meta.db_table,
        snapshot=Snapshot._meta.db_table,
        mutation=Mutation._meta.db_table,
        writes=PendingWrite._meta.db_table,
    )
    for by_id in (False, True)
}

# Portable (SQLite runs it too): a checkpoint and its LangGraph ancestors, nearest first,
# through each one's parent id, down to a depth.
ANCESTORS = f"""
WITH RECURSIVE chain (checkpoint_id, lg_id, lg_parent_id, depth) AS (
    SELECT checkpoint_id, lg_id, lg_parent_id, 0 FROM {SavedCheckpoint._meta.db_table}
     WHERE thread_id = %s AND lg_id = %s
    UNION ALL
    SELECT s.checkpoint_id, s.lg_id, s.lg_parent_id, chain.depth + 1
      FROM chain JOIN {SavedCheckpoint._meta.db_table} s
        ON s.thread_id = %s AND s.lg_id = chain.lg_parent_id
     WHERE chain.depth < %s
)
SELECT checkpoint_id, lg_id FROM chain ORDER BY depth
"""

START = f"""
SELECT id, state_hash, chain_hash, size FROM {Checkpoint._meta.db_table}
 WHERE run_id = %(run)s AND seq = 0
"""


# By model, CTE name, columns taken from another CTE and the rows joined: each ``_insert``
# statement, and the fields whose values it takes (built once).
_INSERTS: dict[tuple, tuple[str, tuple[Field, ...]]] = {}


def _insert(
    obj: Model, prefix: str, conn: Any, refs: dict[str, str], joined: str = ""
) -> tuple[str, dict]:
    """An ``INSERT ... SELECT`` of the unsaved model instance ``obj`` and its parameter: the
    values Django would save (``pre_save``, ``get_db_prep_save``) as one JSON object, which
    ``json_populate_record`` turns into the table's row, each value cast to its column's
    type by the database. One parameter rather than one per column: a new thread's
    statement bound 86, past what psycopg caches the conversion of, and converting and
    binding them cost about 0.25 ms of the client's CPU per thread. ``refs``: columns taken
    from another CTE instead (``"c.id"``); ``joined``: the CTEs they come from (``"c"``). A
    key the database numbers is left to it."""
    model = type(obj)
    key = (model, prefix, tuple(refs.items()), joined)
    if key not in _INSERTS:
        columns, values, fields = [], [], []
        for field in model._meta.concrete_fields:
            if field.primary_key and field.db_returning:
                continue
            columns.append(str(field.column))
            if field.attname in refs:
                values.append(refs[field.attname])
            else:
                values.append(f"{prefix}_v.{field.column}")
                fields.append(field)
        table = model._meta.db_table
        source = f"json_populate_record(NULL::{table}, %({prefix})s::json) AS {prefix}_v"
        sql = (
            f"INSERT INTO {table} ({', '.join(columns)}) SELECT {', '.join(values)}"
            f" FROM {source}{', ' + joined if joined else ''}"
        )
        _INSERTS[key] = (sql, tuple(fields))
    sql, taken = _INSERTS[key]
    row = {field.column: field.get_db_prep_save(field.pre_save(obj, True), conn) for field in taken}
    return sql, {prefix: orjson.dumps(row).decode()}


def new_thread(
    conn: Any, run: Run, start: Checkpoint, mutation: Mutation, snapshot: Snapshot, *rest: Any
) -> tuple[str, dict]:
    """One statement that inserts a new thread's run, its first checkpoint (with its
    mutation and snapshot rows) and the unsaved rows ``rest`` (its event, its thread row,
    whose ids the database numbers); it answers the checkpoint's id and the last row's.
    The thread's uniqueness fails the whole statement if another process made it first.

    It does not wait for the WAL flush: the thread's first checkpoint, which its ``put``
    stores next, does (unless the saver is relaxed), and the WAL is flushed in order, so
    that flush covers the thread too; until then nothing refers to the thread, and a
    database crash in between loses an empty thread, which the graph's next ``put`` makes
    again."""
    parts, params = ["cfg AS (SELECT set_config('synchronous_commit', 'off', true) AS v)"], {}
    for prefix, obj, refs, joined, tail in (
        ("r", run, {}, "cfg", ""),
        ("c", start, {}, "", " RETURNING id"),
        ("m", mutation, {"checkpoint_id": "c.id"}, "c", ""),
        ("s", snapshot, {"checkpoint_id": "c.id"}, "c", ""),
        *((f"x{i}", obj, {}, "", " RETURNING id") for i, obj in enumerate(rest)),
    ):
        sql, values = _insert(obj, prefix, conn, refs, joined)
        parts.append(f"{prefix} AS ({sql}{tail})")
        params.update(values)
    last = f"x{len(rest) - 1}"
    return f"WITH {', '.join(parts)} SELECT c.id, {last}.id FROM c, {last}", params


def report(conn: Any, run_id: Any, change: lifecycle.GraphChange, event: Event) -> tuple[str, dict]:
    """One statement for a graph's report: the conditional UPDATE of its run that
    ``lifecycle.apply_graph`` makes through the ORM, and ``event`` if it changed the run.
    It answers how many runs it changed (0 or 1)."""
    condition, params = _condition(change)
    assignments, values = _assignments(conn, change)
    params.update(values, run=run_id, target=lifecycle.TRANSITIONS[change.op].target)
    sets = ", ".join(
        ["status = %(target)s", *(f"{column} = {value}" for column, value in assignments)]
    )
    insert, values = _insert(event, "e", conn, {"run_id": "u.id"}, "u")
    params.update(values)
    sql = (
        f"WITH u AS (UPDATE {Run._meta.db_table} SET {sets}"
        f" WHERE id = %(run)s AND {condition} RETURNING id),"
        f" e AS ({insert}) SELECT count(*) FROM u"
    )
    return sql, params


# By the shape of a checkpoint's statement with a report (``commit_reporting``): its text.
_REPORTING: dict[tuple, str] = {}


def commit_reporting(
    conn: Any, snapshot: bool, relaxed: bool, change: lifecycle.GraphChange, event: Event
) -> tuple[str, dict]:
    """The checkpoint's statement (``COMMIT[(snapshot, relaxed)]``, its parameters the
    checkpoint's row) that also makes ``change`` to the run, as ``report`` does, numbering
    ``event`` as the checkpoint and inserting it only if the run changed: the two stored
    together or not at all, in one statement (a second one sent with it cost its
    round trip's client work and a second new version of the run's row). The statement's
    text and the parameters the report adds to the row's."""
    condition, params = _condition(change)
    assignments, values = _assignments(conn, change)
    params.update(values, target=lifecycle.TRANSITIONS[change.op].target)
    # Stamped by the database as the checkpoint's event is (``now()``, the same instant), and
    # numbered after it: a timeline in time order shows the checkpoint, then what it changed.
    refs = {"run_id": "r.id", "seq": "r.head_seq", "created_at": "now()"}
    insert, values = _insert(event, "u", conn, refs, "r, e")
    params.update(values)
    key = (snapshot, relaxed, condition, tuple(assignments), insert)
    sql = _REPORTING.get(key)
    if sql is None:
        status = [("status", "%(target)s")]
        # Every checkpoint sets the time of the run's last change already.
        sets = status + [(c, v) for c, v in assignments if c != "updated_at"]
        sql = _REPORTING[key] = _commit_sql(snapshot, relaxed, (condition, sets, insert))
    return sql, params


def _condition(change: lifecycle.GraphChange) -> tuple[str, dict]:
    """When a report applies to its run (SQL on the run's row, and its parameters): in a
    status its operation applies to, and not already as it says (``change.unless``)."""
    params: dict[str, Any] = {"sources": sorted(lifecycle.TRANSITIONS[change.op].sources)}
    condition = "status = ANY(%(sources)s)"
    if change.unless:
        same = []
        for name, value in change.unless.items():
            params[f"unless_{name}"] = value
            same.append(f"{_field(name).column} = %(unless_{name})s")
        condition += f" AND NOT ({' AND '.join(same)})"
    return condition, params


def _assignments(conn: Any, change: lifecycle.GraphChange) -> tuple[list[tuple[str, str]], dict]:
    """The columns a report sets besides the status, each with its SQL value, and the
    parameters those take."""
    assignments, params = [], {}
    for name, value in change.fields.items():
        field = _field(name)
        column = str(field.column)
        if value is lifecycle.At.NOW:
            assignments.append((column, "now()"))
        elif value is lifecycle.At.FIRST:
            assignments.append((column, f"coalesce({column}, now())"))
        else:
            params[f"set_{name}"] = field.get_db_prep_save(value, conn)
            assignments.append((column, f"%(set_{name})s"))
    return assignments, params


def _field(name: str) -> Field:
    field = Run._meta.get_field(name)
    assert isinstance(field, Field)  # a column, not a relation's other side
    return field
