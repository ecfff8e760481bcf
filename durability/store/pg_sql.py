"""PostgreSQL's hand-written statements (the store's ``postgres`` module runs them).

The step commit is one statement: data-modifying CTEs chained on the fenced UPDATE of the
run, so the fencing check and every write are one atomic statement (measured at ~1.1x a
plain INSERT + COMMIT, against ~2.9x for the same writes as four ORM statements).
"""

from __future__ import annotations

COMMIT = """
WITH {cfg}r AS (
    UPDATE durability_run
       SET head_seq = head_seq + 1,
           step = %(next_step)s::text,
           retries = 0,
           status = %(status)s::text,
           heartbeat_at = now(),
           {lease}
           updated_at = now()
     WHERE id = %(run)s::uuid AND lease_token = %(token)s::bigint
       AND head_seq = %(head_seq)s::integer{cfg_ref}
       AND EXISTS (SELECT FROM durability_checkpoint p
                    WHERE p.run_id = %(run)s::uuid AND p.seq = %(head_seq)s::integer
                      AND p.id = %(parent)s::bigint)
 RETURNING id, head_seq
), c AS (
    INSERT INTO durability_checkpoint
        (run_id, seq, parent_id, reason, step, next_step, state_hash, chain_hash,
         schema_version, agent_version, size, delta_size, delta_run, commit_id,
         config_hash, packages, replay_base_id, replay_counters, created_by, created_at)
    SELECT r.id, r.head_seq, %(parent)s::bigint, 'step', %(step)s::text, %(next_step)s::text,
           %(state_hash)s::text, %(chain_hash)s::text, %(schema_version)s::integer,
           %(agent_version)s::text, %(size)s::integer, %(delta_size)s::integer,
           %(delta_run)s::bigint, %(commit_id)s::uuid, %(config_hash)s::text,
           %(packages)s::text, %(replay_base)s::bigint, %(replay_counters)s::text, '', now()
      FROM r
 RETURNING id
), m AS (
    INSERT INTO durability_mutation (checkpoint_id, run_id, seq, ops, count)
    SELECT c.id, r.id, r.head_seq, %(ops)s::text, %(count)s::integer FROM c, r
){snapshot}, e AS (
    INSERT INTO durability_event
        (run_id, kind, seq, step, actor, reason, worker, data, commit_us, created_at)
    SELECT r.id, v.kind, r.head_seq, %(step)s::text, '', '', %(worker)s::text, v.data,
           %(prev_us)s::integer, now()
      FROM r CROSS JOIN (VALUES {events}) AS v(kind, data)
)
SELECT id FROM c
"""
# Going on, the execution's next step is its first attempt: a crash from here on counts as
# one when the run is claimed again (the poison-step counter).
_LEASE_KEEP = "lease_expires_at = now() + %(lease)s::float8 * interval '1 second', attempts = 1,"
_LEASE_END = (
    "lease_expires_at = NULL, lease_owner = '', finished_at = now(), attempts = 0,"
    " outcome = %(outcome)s::text,"
)
_SNAPSHOT = """, s AS (
    INSERT INTO durability_snapshot (checkpoint_id, run_id, seq, state, digest)
    SELECT c.id, r.id, r.head_seq, %(snapshot)s::text, %(digest)s::text FROM c, r
)"""
_EVENTS_CONTINUE = "('checkpoint', %(data)s::text)"
_EVENTS_FINISH = "('checkpoint', %(data)s::text), ('succeeded', %(end)s::text)"
# Relaxed and replicated levels set synchronous_commit for this statement's own (implicit)
# transaction only; the fenced UPDATE refers to the setting so that it is evaluated first.
_CFG = "cfg AS (SELECT set_config('synchronous_commit', %(sync)s::text, true) AS v), "
_CFG_REF = "\n       AND (SELECT v FROM cfg) IS NOT NULL"
# (finished, with a snapshot, level sets synchronous_commit) -> statement
COMMITS = {
    (finished, snapshot, configured): COMMIT.format(
        cfg=_CFG if configured else "",
        cfg_ref=_CFG_REF if configured else "",
        lease=_LEASE_END if finished else _LEASE_KEEP,
        events=_EVENTS_FINISH if finished else _EVENTS_CONTINUE,
        snapshot=_SNAPSHOT if snapshot else "",
    )
    for finished in (False, True)
    for snapshot in (False, True)
    for configured in (False, True)
}
SYNCHRONOUS_COMMIT = {"relaxed": "off", "replicated": "remote_apply"}

JOURNAL_INSERT = """
INSERT INTO durability_journalentry
    (run_id, base_id, key, occurrence, kind, step, function, args_hash, result, duration_ms,
     meta, reused_from, created_at)
VALUES (%(run)s::uuid, %(base)s::bigint, %(key)s::text, %(occurrence)s::integer,
        %(kind)s::text, %(step)s::text, %(function)s::text, %(args_hash)s::text,
        %(result)s::text, %(duration_ms)s::float8, %(meta)s::text,
        %(reused_from)s::bigint, now())
ON CONFLICT ON CONSTRAINT journal_identity DO NOTHING
RETURNING id, created_at
"""

# A heartbeat waits for no standby (a row lock held by a heartbeat stuck on a lost standby
# would block the run's own commits).
RENEW = """
WITH cfg AS (SELECT set_config('synchronous_commit', 'local', true) AS v)
UPDATE durability_run
   SET lease_expires_at = now() + %s * interval '1 second', heartbeat_at = now()
 WHERE id = %s AND lease_token = %s AND (SELECT v FROM cfg) IS NOT NULL
"""

# Advisory locks granted in this database, as (classid, objid, objsubid, pid): objsubid 1 for
# a single bigint key (a run's), 2 for a pair of integers (a worker's presence).
HELD_ADVISORY_LOCKS = (
    "SELECT classid::bigint, objid::bigint, objsubid, pid FROM pg_locks"
    " WHERE locktype = 'advisory' AND granted"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)

# Sessions holding the liveness lock of one of the given (run, token) pairs, proven stalled
# in this very statement: the run is still at that token (nobody claimed it since the sweep
# decided), it is queued or its lease ran out, and the holder's session has done nothing for
# a heartbeat interval plus a margin (a live holder beats every interval, and takes its lock
# moments before claiming: one that took the run an instant ago is never touched).
END_STALLED = f"""
SELECT count(*) FILTER (WHERE pg_terminate_backend(held.pid))
  FROM ({HELD_ADVISORY_LOCKS}) held
  JOIN unnest(%s::uuid[], %s::bigint[], %s::bigint[], %s::bigint[]) AS w(run_id, hi, lo, token)
    ON held.classid = w.hi AND held.objid = w.lo
  JOIN durability_run r ON r.id = w.run_id AND r.lease_token = w.token
  JOIN pg_stat_activity a ON a.pid = held.pid
 WHERE held.objsubid = 1 AND held.pid <> pg_backend_pid()
   AND (r.status = 'queued' OR (r.status = 'running' AND r.lease_expires_at < now()))
   AND a.state_change < now() - %s * interval '1 second'
"""

# A missing liveness lock may be a session the database lost, not a death: so it is while
# the server has been up for less than a heartbeat interval plus a margin (a live holder
# reconnects and takes its lock back within that) and the holder gave a sign of life within
# its lease. Over ``durability_run``; parameters: the settle time, the lease.
LOSS_EXPLAINED = (
    "(now() - pg_postmaster_start_time() <= %s * interval '1 second'"
    " AND COALESCE(durability_run.heartbeat_at, durability_run.claimed_at)"
    " >= now() - %s * interval '1 second')"
)

# A worker's presence lock; session locks stack, so it is taken only if this session does
# not hold it yet.
HOLD_WORKER_LOCK = (
    "SELECT pg_try_advisory_lock(%s, %s) WHERE NOT EXISTS (SELECT 1 FROM pg_locks"
    " WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND objsubid = 2"
    " AND classid = %s::bigint::oid AND objid = %s::bigint::oid)"
)

COMMIT_FIGURES = (
    "SELECT count(*) FILTER (WHERE kind = 'checkpoint'),"
    " percentile_cont(%s::float8[]) WITHIN GROUP (ORDER BY commit_us)"
    " FROM durability_event WHERE created_at >= %s AND kind IN (%s, %s)"
    " AND (commit_us IS NOT NULL OR kind = 'checkpoint')"
)

# A run's state at its head (or at checkpoint ``seq``) in one round trip: the checkpoint with
# what verifying it needs and its nearest snapshot by number (one index probe), then the
# patches numbered after that snapshot up to it (one index range, in no promised order:
# ``Store.head_chain`` sorts them). Those are its path unless a branch lies between (a
# LangGraph fork in a thread; a rollback stored by an older version as a patch only, where a
# rollback is now stored whole): the caller hashes them, and walks the parents (``CHAIN_SQL``)
# when they do not lead to its state hash.
# Its parent's chain hash (the one its own is linked to; stored on it once compaction removed
# the parent) is a scalar subquery. Prepared once per session. Columns: the checkpoint's
# (``base.HEAD_COLUMNS``), then the snapshot's checkpoint id, state, digest and state hash, on
# the checkpoint's row; a patch's checkpoint id, a NULL run, its number and its operations on
# each other row.
HEAD_PATH = """
WITH head AS (
    SELECT c.id, c.run_id, c.seq, c.step, c.next_step, c.schema_version, c.agent_version,
           c.state_hash, c.chain_hash,
           COALESCE(NULLIF(c.parent_chain, ''),
                    (SELECT p.chain_hash FROM durability_checkpoint p WHERE p.id = c.parent_id),
                    '') AS parent_chain,
           s.checkpoint_id AS base_id, s.seq AS base_seq, s.state, s.digest
      FROM durability_checkpoint c
      LEFT JOIN LATERAL (
          SELECT n.checkpoint_id, n.seq, n.state, n.digest FROM durability_snapshot n
           WHERE n.run_id = c.run_id AND n.seq <= c.seq
           ORDER BY n.seq DESC LIMIT 1) s ON true
     WHERE c.run_id = %(run)s::uuid
       AND c.seq = COALESCE(%(seq)s::integer,
                            (SELECT r.head_seq FROM durability_run r WHERE r.id = %(run)s::uuid))
)
SELECT h.id, h.run_id, h.seq, h.step, h.next_step, h.schema_version, h.agent_version,
       h.state_hash, h.chain_hash, h.parent_chain, h.base_id, h.state, h.digest,
       (SELECT b.state_hash FROM durability_checkpoint b WHERE b.id = h.base_id)
  FROM head h
UNION ALL
SELECT m.checkpoint_id, NULL, m.seq, m.ops, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL
  FROM head h JOIN durability_mutation m
    ON m.run_id = h.run_id AND m.seq > h.base_seq AND m.seq <= h.seq
"""
