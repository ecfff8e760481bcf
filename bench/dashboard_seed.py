"""Seeding the dashboard benchmark's database (bench.dashboard): runs with Zipf-distributed
checkpoint counts, real state and chain hashes, snapshots as the engine takes them, written
with COPY; and the run of two ~1 MB states whose diff page is timed."""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import time
import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

from bench.db import connect

WORDS = (
    "lease",
    "fence",
    "token",
    "write",
    "ahead",
    "log",
    "retry",
    "jitter",
    "backoff",
    "agent",
    "state",
    "commit",
    "checkpoint",
    "rollback",
    "fork",
    "approval",
    "refund",
    "order",
    "customer",
    "invoice",
    "search",
    "summary",
    "draft",
    "publish",
    "timeout",
    "replica",
    "standby",
    "snapshot",
    "patch",
    "journal",
    "effect",
    "idempotent",
    "worker",
    "sweeper",
)
STATUSES = [
    ("succeeded", 0.70),
    ("failed", 0.08),
    ("waiting", 0.10),
    ("running", 0.05),
    ("queued", 0.04),
    ("cancelled", 0.03),
]


def zipf_counts(runs: int, total: int, cap: int, s: float = 1.1) -> list[int]:
    """Checkpoints per run: ``c / rank**s`` (at least 1, at most ``cap``), with ``c`` found
    by bisection so that they add up to about ``total``."""

    def counts(c: float) -> list[int]:
        return [max(1, min(cap, int(c / (rank**s)))) for rank in range(1, runs + 1)]

    low, high = 1.0, float(total) * 10
    for _ in range(60):
        middle = (low + high) / 2
        if sum(counts(middle)) < total:
            low = middle
        else:
            high = middle
    return counts(high)


class Copier:
    """Buffers rows per table and writes them with COPY; columns and defaults come from the
    models, so the seed keeps up with fields the engine adds."""

    def __init__(self, conn: Any) -> None:
        from durability.models import (
            Approval,
            Checkpoint,
            Effect,
            Event,
            JournalEntry,
            Mutation,
            Run,
            Snapshot,
        )

        self.conn = conn
        self.models = {
            "run": Run,
            "checkpoint": Checkpoint,
            "mutation": Mutation,
            "snapshot": Snapshot,
            "event": Event,
            "journal": JournalEntry,
            "approval": Approval,
            "effect": Effect,
        }
        self.buffers: dict[str, list[dict]] = defaultdict(list)
        self.counts: dict[str, int] = defaultdict(int)
        self.layout = {}
        for key, model in self.models.items():
            fields = list(model._meta.concrete_fields)
            defaults = {}
            for f in fields:
                default = f.get_default()
                defaults[f.attname] = default
            self.layout[key] = (model._meta.db_table, fields, defaults)

    def add(self, key: str, row: dict) -> None:
        self.buffers[key].append(row)

    def flush(self) -> None:
        order = ("run", "checkpoint", "mutation", "snapshot", "event", "journal", "approval")
        for key in (*order, "effect"):
            rows = self.buffers.pop(key, [])
            if not rows:
                continue
            table_name, fields, defaults = self.layout[key]
            # An auto id left out is numbered by the database.
            used = [f for f in fields if not (f.primary_key and f.attname not in rows[0])]
            columns = ", ".join(f'"{f.column}"' for f in used)
            with (
                self.conn.cursor() as cur,
                cur.copy(f'COPY "{table_name}" ({columns}) FROM STDIN') as copy,
            ):
                for row in rows:
                    copy.write_row([row.get(f.attname, defaults[f.attname]) for f in used])
            self.counts[key] += len(rows)
        self.conn.commit()


def words(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


def seed(args: argparse.Namespace) -> dict[str, Any]:
    """Write the runs; returns what the requests need (ids, the largest runs, the diff run)."""
    from django.db import connection

    rnd = random.Random(args.seed)
    counts = zipf_counts(args.runs, args.checkpoints, cap=max(args.big_checkpoints * 2, 50))
    big = set(sorted(range(args.runs), key=lambda i: -counts[i])[: args.big])
    for i in big:
        counts[i] = max(counts[i], args.big_checkpoints)
    order = list(range(args.runs))
    rnd.shuffle(order)
    now = datetime.now(UTC)
    conn = connect(os.environ["DATABASE_URL"])
    copier = Copier(conn)
    checkpoint_id = 0
    run_ids: list[str] = []
    largest: list[tuple[int, str]] = []
    started = time.monotonic()
    for n, index in enumerate(order):
        is_big = index in big
        seeding = _Seeding(copier, rnd, now, counts[index], is_big, checkpoint_id)
        seeding.run()
        checkpoint_id = seeding.checkpoint_id
        run_ids.append(str(seeding.run_id))
        if is_big:
            largest.append((seeding.steps, str(seeding.run_id)))
        if (n + 1) % 2000 == 0 or is_big:
            copier.flush()
        if (n + 1) % 20000 == 0:
            print(
                f"  seeded {n + 1:,} runs, {checkpoint_id:,} checkpoints"
                f" ({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    diff_run = seed_diff_run(copier, rnd, checkpoint_id + 1, now)
    copier.flush()
    with conn.cursor() as cur:
        for table_name, column in (("durability_checkpoint", "id"),):
            cur.execute(
                f"SELECT setval(pg_get_serial_sequence('{table_name}', '{column}'),"
                f" (SELECT max({column}) FROM {table_name}))"
            )
    conn.commit()
    conn.close()
    connection.close()
    print(f"  seeded {dict(copier.counts)} in {time.monotonic() - started:.0f} s", flush=True)
    largest.sort(reverse=True)
    return {"runs": run_ids, "largest": [r for _, r in largest], "diff_run": diff_run}


class _Seeding:
    """One seeded run: its start checkpoint, one checkpoint per step (snapshots as the engine
    would take them), its events, journal entries, run row and approval."""

    def __init__(
        self,
        copier: Copier,
        rnd: random.Random,
        now: datetime,
        steps: int,
        is_big: bool,
        checkpoint_id: int,
    ) -> None:
        self.copier, self.rnd, self.now = copier, rnd, now
        self.steps, self.is_big, self.checkpoint_id = steps, is_big, checkpoint_id
        self.run_id = uuid.UUID(int=rnd.getrandbits(128))
        names = [s for s, _ in STATUSES]
        weights = [w for _, w in STATUSES]
        self.status = rnd.choices(names, weights)[0] if not is_big else "succeeded"
        self.agent = rnd.choice(("research", "support"))
        self.question = words(rnd, 8)
        self.created = now - timedelta(seconds=rnd.uniform(0, 30 * 86400))
        self.at = self.created

    def run(self) -> None:
        self._start()
        self.delta_run = 0
        for seq in range(1, self.steps):
            self._step(seq)
        self._finish()

    def _start(self) -> None:
        from durability import canonical, checkpoints

        self.state: dict[str, Any] = {
            "question": self.question,
            "messages": [{"role": "user", "content": self.question}],
            "count": 0,
        }
        state_bytes = canonical.dumps(self.state)
        self.state_hash = canonical.sha256_hex(state_bytes)
        self.chain = checkpoints.link(
            "",
            self.state_hash,
            run_id=self.run_id,
            seq=0,
            step="",
            next_step="plan",
            schema_version=1,
            agent_version="1",
        )
        self.checkpoint_id += 1
        self.parent_id = self.checkpoint_id
        self._checkpoint(0, None, "start", "", "plan", len(state_bytes), 2, 0, "bench")
        self.copier.add("mutation", {"checkpoint_id": self.checkpoint_id, "ops": "[]", "count": 0})
        self._snapshot(state_bytes)
        data = f'{{"agent":"{self.agent}","version":"1"}}'
        self._event("created", 0, actor="bench", data=data)
        self._event("claimed", 0, worker="w-1", data='{"attempt":1}')

    def _step(self, seq: int) -> None:
        from durability import canonical, checkpoints

        rnd, steps = self.rnd, self.steps
        self.at = self.at + timedelta(milliseconds=rnd.uniform(50, 3000))
        size = 1024 if self.is_big else rnd.randint(40, 200)
        message = {"role": rnd.choice(("assistant", "tool")), "content": words(rnd, size // 6)}
        position = len(self.state["messages"])
        self.state["messages"].append(message)
        self.state["count"] = seq
        ops = [
            {"op": "add", "path": f"/messages/{position}", "value": message},
            {"op": "replace", "path": "/count", "value": seq},
        ]
        ops_bytes = canonical.dumps(ops)
        state_bytes = canonical.dumps(self.state)
        self.state_hash = canonical.patched(self.state_hash, ops_bytes)
        step = "search" if seq < steps - 1 else "summarise"
        last = "" if self.status == "succeeded" else "review"
        next_step = "search" if seq < steps - 1 else last
        self.chain = checkpoints.link(
            self.chain,
            self.state_hash,
            run_id=self.run_id,
            seq=seq,
            step=step,
            next_step=next_step,
            schema_version=1,
            agent_version="1",
        )
        self.checkpoint_id += 1
        self.delta_run += len(ops_bytes)
        snapshot = checkpoints.needs_snapshot(self.delta_run, len(state_bytes))
        self._checkpoint(
            seq,
            self.parent_id,
            "step",
            step,
            next_step,
            len(state_bytes),
            len(ops_bytes),
            self.delta_run,
            "",
        )
        self.copier.add(
            "mutation",
            {"checkpoint_id": self.checkpoint_id, "ops": ops_bytes.decode(), "count": len(ops)},
        )
        if snapshot:
            self._snapshot(state_bytes)
            self.delta_run = 0
        facts = f'{{"bytes":{len(state_bytes)},"delta":{len(ops_bytes)},"ops":2}}'
        commit_us = int(rnd.lognormvariate(7.2, 0.5))
        self._event("checkpoint", seq, step=step, worker="w-1", commit_us=commit_us, data=facts)
        if self.is_big or steps >= 20:
            self._journal(step)
        self.parent_id = self.checkpoint_id

    def _checkpoint(
        self,
        seq: int,
        parent_id: int | None,
        reason: str,
        step: str,
        next_step: str,
        size: int,
        delta_size: int,
        delta_run: int,
        created_by: str,
    ) -> None:
        self.copier.add(
            "checkpoint",
            {
                "id": self.checkpoint_id,
                "run_id": self.run_id,
                "seq": seq,
                "parent_id": parent_id,
                "reason": reason,
                "step": step,
                "next_step": next_step,
                "state_hash": self.state_hash,
                "chain_hash": self.chain,
                "schema_version": 1,
                "agent_version": "1",
                "size": size,
                "delta_size": delta_size,
                "delta_run": delta_run,
                "created_by": created_by,
                "created_at": self.at,
            },
        )

    def _snapshot(self, state_bytes: bytes) -> None:
        from durability import checkpoints

        self.copier.add(
            "snapshot",
            {
                "checkpoint_id": self.checkpoint_id,
                "state": state_bytes.decode(),
                "digest": checkpoints.seal(self.state_hash, state_bytes),
            },
        )

    def _event(self, kind: str, seq: int, **fields: Any) -> None:
        row = {"run_id": self.run_id, "kind": kind, "seq": seq, **fields}
        self.copier.add("event", {**row, "created_at": self.at})

    def _journal(self, step: str) -> None:
        self.copier.add(
            "journal",
            {
                "run_id": self.run_id,
                "base_id": self.parent_id,
                "key": "llm",
                "occurrence": 0,
                "kind": "call",
                "step": step,
                "function": "examples.llm.complete",
                "args_hash": "x",
                "result": '{"text":"..."}',
                "duration_ms": self.rnd.uniform(100, 900),
                "meta": '{"input_tokens":812,"model":"bench","output_tokens":120}',
                "created_at": self.at,
            },
        )

    def _finish(self) -> None:
        from durability import canonical

        status, at, now = self.status, self.at, self.now
        head_seq = self.steps - 1
        finished = at if status in ("succeeded", "failed", "cancelled") else None
        self.copier.add(
            "run",
            {
                "id": self.run_id,
                "agent": self.agent,
                "agent_version": "1",
                "status": status,
                "wait_reason": "approval" if status == "waiting" else "",
                "wait_detail": "publish" if status == "waiting" else "",
                "step": "" if status == "succeeded" else "review",
                "input": canonical.dumps({"question": self.question}).decode(),
                "head_seq": head_seq,
                "lease_owner": "w-1" if status == "running" else "",
                "lease_expires_at": now + timedelta(seconds=30) if status == "running" else None,
                "error": "RetriesExhausted: search failed 7 times" if status == "failed" else "",
                "error_code": "DUR502" if status == "failed" else "",
                "created_by": "bench",
                "created_at": self.created,
                "updated_at": at,
                "started_at": self.created,
                "finished_at": finished,
            },
        )
        if status == "waiting":
            self._approval()
        if status in ("succeeded", "failed"):
            self._event(status, head_seq, worker="w-1")

    def _approval(self) -> None:
        from durability import canonical

        draft = words(self.rnd, 40)
        payload = canonical.dumps({"draft": draft, "question": self.question}).decode()
        self.copier.add(
            "approval",
            {
                "run_id": self.run_id,
                "base_id": self.parent_id,
                "name": "publish",
                "occurrence": 0,
                "step": "review",
                "payload": payload,
                "payload_hash": hashlib.sha256(payload.encode()).hexdigest(),
                "requested_at": self.at,
            },
        )


def diff_states(rnd: random.Random) -> tuple[dict, dict]:
    """Two ~1 MB states differing in 1,000 paths: 100 messages inserted at the front, 100
    appended, 800 edited in between."""
    messages = [
        {"role": rnd.choice(("user", "assistant", "tool")), "content": words(rnd, 150)}
        for _ in range(1000)
    ]
    old = {"question": "diff", "messages": messages, "count": 1000}
    new_messages = [dict(m) for m in messages]
    for i in range(100, 900):
        new_messages[i]["content"] = new_messages[i]["content"] + " (edited)"
    front = [{"role": "user", "content": words(rnd, 150)} for _ in range(100)]
    tail = [{"role": "assistant", "content": words(rnd, 150)} for _ in range(100)]
    new = {"question": "diff", "messages": front + new_messages + tail, "count": 1000}
    return old, new


def seed_diff_run(copier: Copier, rnd: random.Random, first_id: int, now: datetime) -> str:
    from durability import canonical, checkpoints, diff

    run_id = uuid.UUID(int=rnd.getrandbits(128))
    old, new = diff_states(rnd)
    chain = ""
    ops_of = {0: canonical.EMPTY_PATCH, 1: canonical.dumps(diff.diff(old, new))}
    for seq, state in enumerate((old, new)):
        state_bytes = canonical.dumps(state)
        ops_bytes = ops_of[seq]
        if seq == 0:
            state_hash = canonical.sha256_hex(state_bytes)
        else:
            state_hash = canonical.patched(state_hash, ops_bytes)
        chain = checkpoints.link(
            chain,
            state_hash,
            run_id=run_id,
            seq=seq,
            step="edit" if seq else "",
            next_step="" if seq else "edit",
            schema_version=1,
            agent_version="1",
        )
        row = (first_id, seq, run_id, state_hash, chain, state_bytes, ops_bytes, now)
        _diff_checkpoint(copier, *row)
    copier.add(
        "run",
        {
            "id": run_id,
            "agent": "research",
            "agent_version": "1",
            "status": "succeeded",
            "input": '{"question":"diff"}',
            "head_seq": 1,
            "created_by": "bench",
            "created_at": now,
            "updated_at": now,
            "finished_at": now,
        },
    )
    return str(run_id)


def _diff_checkpoint(
    copier: Copier,
    first_id: int,
    seq: int,
    run_id: uuid.UUID,
    state_hash: str,
    chain: str,
    state_bytes: bytes,
    ops_bytes: bytes,
    now: datetime,
) -> None:
    from durability import canonical, checkpoints

    copier.add(
        "checkpoint",
        {
            "id": first_id + seq,
            "run_id": run_id,
            "seq": seq,
            "parent_id": first_id if seq else None,
            "reason": "step" if seq else "start",
            "step": "edit" if seq else "",
            "next_step": "" if seq else "edit",
            "state_hash": state_hash,
            "chain_hash": chain,
            "schema_version": 1,
            "agent_version": "1",
            "size": len(state_bytes),
            "delta_size": len(ops_bytes),
            "delta_run": 0,
            "created_by": "bench",
            "created_at": now,
        },
    )
    copier.add(
        "mutation",
        {
            "checkpoint_id": first_id + seq,
            "ops": ops_bytes.decode(),
            "count": len(canonical.loads(ops_bytes)),
        },
    )
    # Both stored whole: the page pays two full rebuilds, its worst case.
    copier.add(
        "snapshot",
        {
            "checkpoint_id": first_id + seq,
            "state": state_bytes.decode(),
            "digest": checkpoints.seal(state_hash, state_bytes),
        },
    )


def check_seeded(facts: dict[str, Any]) -> None:
    """The pages verify every state they show: a seeded history that did not verify would
    have them render an error instead, and flatter every figure. Refuse to measure that."""
    from durability import checkpoints
    from durability.integrity import verify_run
    from durability.models import Checkpoint

    for run_id in (facts["diff_run"], *facts["largest"][:1], *facts["runs"][:3]):
        report = verify_run(run_id)
        if not report.ok:
            raise SystemExit(f"seeded data does not verify: {report}")
    for run_id in facts["largest"]:
        head = Checkpoint.objects.filter(run_id=run_id).order_by("-seq").first()
        checkpoints.verified_state(head)


def analyze() -> None:
    # VACUUM as well: autovacuum would have run on rows COPYed in bulk by the time anyone
    # browses them (it is on by default), and without it no page is marked all-visible, so
    # index-only scans (the status counts) read the heap too. Some servers, this one among
    # them, run with autovacuum off: the benchmark does not depend on that setting.
    with connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE)")
