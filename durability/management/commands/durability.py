"""``python manage.py durability <subcommand>``: operate runs without a browser.

Exit codes: 0 success; 1 the run failed or was cancelled (``start --wait``), or an
operation failed; 2 bad input (unknown run, agent or checkpoint, invalid JSON...); 3 a
checkpoint does not verify; 4 ``--wait`` stopped because the run waits for a person;
5 ``--wait`` timed out; 6 the database cannot be reached. Every error is one line with its
code, never a traceback.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import time
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import InterfaceError, OperationalError
from django.utils import timezone

from durability import approvals as edits
from durability import canonical, dispatch, operations, telemetry
from durability import rollbacks as rollbacks
from durability.agents import registry
from durability.errors import (
    DatabaseUnavailable,
    DurabilityError,
    IntegrityViolation,
    InvalidInput,
    StateNotJSON,
)
from durability.models import (
    FINISHED,
    Approval,
    Checkpoint,
    Effect,
    Event,
    JournalEntry,
    Run,
    RunStatus,
)

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTEGRITY, EXIT_WAITING, EXIT_TIMEOUT = 1, 2, 3, 4, 5
EXIT_DATABASE = 6


def _json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise StateNotJSON(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        # The parser recurses once per level: past Python's limit it would otherwise end
        # the command with a traceback.
        raise StateNotJSON(f"{what} is nested too deeply to be read as JSON") from None


def _with_actor(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--by`` and ``--reason`` after the subcommand too. SUPPRESS: when not given here,
    the value given before the subcommand (or the default) stays."""
    p.add_argument("--by", default=argparse.SUPPRESS, help="who is acting")
    p.add_argument("--reason", default=argparse.SUPPRESS, help="why (kept in the audit trail)")
    return p


def _with_version(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--expect-version",
        type=int,
        metavar="N",
        help=(
            "act only if the run is still at this version (see show); without it, the command"
            " acts on what it reads in the same locked transaction"
        ),
    )


def _effect_decisions(plan: Any, given: list[str]) -> dict[int, str]:
    """``--effect ID=CHOICE`` (ID: an effect id, or the key of effects done after the target)
    as the engine's decisions; the engine checks each choice."""
    decisions: dict[int, str] = {}
    for item in given:
        ref, sep, choice = item.partition("=")
        if not sep:
            raise InvalidInput(
                f"--effect {item!r}: give ID=CHOICE, e.g. --effect refund=compensate"
            )
        matched = [e.id for e in plan.done_not_undone if str(e.id) == ref or e.key == ref]
        if not matched:
            raise InvalidInput(
                f"--effect {item!r}: no effect {ref!r} was done after checkpoint #{plan.target.seq}"
            )
        decisions.update(dict.fromkeys(matched, choice.strip()))
    try:
        return rollbacks.check_decisions(plan.done_not_undone, decisions)
    except ValueError as exc:
        raise InvalidInput(str(exc), run_id=plan.run.id) from None


def _age(when: datetime | None) -> str:
    if when is None:
        return "-"
    seconds = max(0, int((timezone.now() - when).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"


class Command(BaseCommand):
    help = (
        "Operate durable agent runs: start, list, show, resume, rollback, fork, cancel,"
        " approve, resolve, verify."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--by", default="", help="who is acting (default: $DURABILITY_ACTOR or the OS user)"
        )
        parser.add_argument("--reason", default="", help="why (recorded in the audit trail)")
        sub = parser.add_subparsers(dest="action", required=True, metavar="SUBCOMMAND")

        p = sub.add_parser("start", help="start a run of an agent")
        p.add_argument("agent")
        p.add_argument(
            "--input",
            default="{}",
            help="the input, as JSON; @FILE reads it from a file, - from stdin",
        )
        p.add_argument(
            "--idempotency-key",
            default="",
            help="starting again with this key returns the same run instead of a new one",
        )
        p.add_argument(
            "--durability",
            choices=["strict", "relaxed", "replicated", "periodic"],
            help="override the agent's durability level for this run",
        )
        p.add_argument("--wait", action="store_true", help="wait until the run finishes or waits")
        p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (with --wait)")

        p = sub.add_parser("list", help="list runs, newest first")
        p.add_argument("--status", choices=[s.value for s in RunStatus])
        p.add_argument("--agent")
        p.add_argument("--limit", type=int, default=30)

        p = sub.add_parser(
            "show", help="show a run: header, checkpoints, approvals, effects, events"
        )
        p.add_argument("run")
        p.add_argument("--json", action="store_true", help="machine-readable, with the head state")

        p = sub.add_parser(
            "resume", help="queue a failed or cancelled run again; continue one on hold"
        )
        p.add_argument("run")
        _with_version(p)

        p = sub.add_parser("rollback", help="make checkpoint SEQ the head again (history is kept)")
        p.add_argument("run")
        p.add_argument("--to", type=int, required=True, metavar="SEQ")
        p.add_argument("--dry-run", action="store_true", help="only show what it would do")
        p.add_argument(
            "--continue",
            dest="and_continue",
            action="store_true",
            help="roll back and continue at once (default: the run is left on hold)",
        )
        p.add_argument(
            "--effect",
            action="append",
            default=[],
            metavar="ID=CHOICE",
            help=(
                "what to do with an effect done after SEQ (its id, or its key) when the run"
                " reaches it again: ask (default), reuse, again or compensate; repeatable"
            ),
        )
        _with_version(p)

        p = sub.add_parser("fork", help="start a new run from a checkpoint")
        p.add_argument("run")
        p.add_argument("--from", dest="from_seq", type=int, required=True, metavar="SEQ")
        p.add_argument("--state", metavar="FILE", help="edited state (JSON file; - for stdin)")
        p.add_argument(
            "--what-if",
            action="store_true",
            help="reuse the source run's matching recorded calls; record effects, do not run them",
        )
        p.add_argument("--live", action="store_true", help="with --what-if: run effects too")

        p = sub.add_parser("cancel", help="cancel a run")
        p.add_argument("run")
        _with_version(p)

        p = sub.add_parser("approve", help="decide a pending approval (approve unless --reject)")
        p.add_argument("run")
        p.add_argument("name")
        p.add_argument("--reject", action="store_true")
        p.add_argument("--comment", default="")
        p.add_argument(
            "--payload",
            help=(
                "approve with edits: the corrected payload as JSON (when the agent names its"
                " editable fields, only those; the others keep their asked values)"
            ),
        )
        _with_version(p)

        p = sub.add_parser("send", help="send a message to a run (ctx.wait_for takes it)")
        p.add_argument("run")
        p.add_argument("name")
        p.add_argument("--data", default="null", help="the message, as JSON")
        p.add_argument("--key", default="", help="idempotency key: a retried send arrives once")
        _with_version(p)

        p = sub.add_parser("resolve", help="say what happened to an effect in doubt")
        p.add_argument("run")
        p.add_argument("effect", type=int, help="the effect's id (see show)")
        p.add_argument("outcome", choices=["done", "failed", "retry"])
        p.add_argument("--result", default="null", help="the effect's result as JSON (done)")
        _with_version(p)

        p = sub.add_parser("verify", help="check the hash chain of one run, or of all runs")
        p.add_argument("run", nargs="?")

        p = sub.add_parser("prune", help="apply the agents' retention policies")
        p.add_argument("--dry-run", action="store_true", help="only print what it would remove")

        p = sub.add_parser("hold", help="put a run on legal hold (never pruned)")
        p.add_argument("run")
        p.add_argument("--release", action="store_true", help="lift the hold")

        sub.add_parser("agents", help="list the registered agents")
        sub.add_parser("sweep", help="run the sweeper once")
        for p in sub.choices.values():
            _with_actor(p)

    def handle(self, *args: Any, **opts: Any) -> None:
        self.by = opts["by"] or os.environ.get("DURABILITY_ACTOR") or f"cli:{getpass.getuser()}"
        self.reason = opts["reason"]
        action = opts["action"]
        try:
            # The run a command starts keeps this span as the parent of all its executions.
            with (
                dispatch.reporting_unrung(self._unrung),
                telemetry.tracer().start_as_current_span(
                    f"durability {action}", attributes={"durability.cli.actor": self.by}
                ),
            ):
                self._dispatch(action, opts)
        except (OperationalError, InterfaceError) as exc:
            error = DatabaseUnavailable(
                f"the database cannot be reached ({dispatch.why(exc)}); check DATABASE_URL"
                " and that the server runs, then try again"
            )
            raise CommandError(str(error), returncode=EXIT_DATABASE) from None

    def _unrung(self, run_id: str, exc: Exception) -> None:
        """The broker is only the doorbell: the operation is committed, the run waits in the
        database, and the sweeper rings for it; one line says so, not a traceback."""
        self.stderr.write(
            f"note: the broker did not take the doorbell for run {run_id}"
            f" ({dispatch.why(exc)}); the run is queued in the database and the doorbell"
            " will ring at the next sweep"
        )

    def _dispatch(self, action: str, opts: dict) -> None:
        try:
            getattr(self, f"do_{action}")(opts)
        except IntegrityViolation as exc:
            raise CommandError(str(exc), returncode=EXIT_INTEGRITY) from None
        except InvalidInput as exc:
            raise CommandError(str(exc), returncode=EXIT_BAD_INPUT) from None
        except DurabilityError as exc:
            raise CommandError(str(exc), returncode=EXIT_FAILED) from None
        except RecursionError:
            # A value nested deeper than the engine's recursive walks (redaction, checks).
            error = StateNotJSON("a JSON value given is nested too deeply")
            raise CommandError(str(error), returncode=EXIT_BAD_INPUT) from None

    def say(self, text: str = "") -> None:
        self.stdout.write(text)

    # --- subcommands ---------------------------------------------------------------------

    def do_start(self, opts: dict) -> None:
        source = opts["input"]
        if source == "-":
            text, what = self._stdin(), "--input - (stdin)"
        elif source.startswith("@"):
            text, what = self._read(source[1:]), f"--input {source}"
        else:
            text, what = source, "--input"
        payload = _json_arg(text, what)
        run = operations.start(
            opts["agent"],
            payload,
            by=self.by,
            reason=self.reason,
            idempotency_key=opts["idempotency_key"],
            durability=opts["durability"],
        )
        self.say(f"started {run.agent}@{run.agent_version} run {run.id}")
        if opts["wait"]:
            self._wait(run, opts["timeout"])

    def _wait(self, run: Run, timeout: float) -> None:
        give_up = time.monotonic() + timeout
        last = None
        while time.monotonic() < give_up:
            run.refresh_from_db()
            if (run.status, run.head_seq) != last:
                last = (run.status, run.head_seq)
                self.say(f"  {run.status:<9} #{run.head_seq} {run.step or ''}")
            if run.status in FINISHED:
                break
            if run.status == RunStatus.WAITING and run.wait_reason in ("approval", "in_doubt"):
                raise CommandError(
                    f"run {run.id} waits for a person: {run.wait_reason} {run.wait_detail}",
                    returncode=EXIT_WAITING,
                )
            time.sleep(0.2)
        else:
            raise CommandError(
                f"run {run.id} still {run.status} after {timeout:g} s", returncode=EXIT_TIMEOUT
            )
        if run.status != RunStatus.SUCCEEDED:
            code = f"[{run.error_code}] " if run.error_code else ""
            raise CommandError(
                f"run {run.id} {run.status}: {code}{run.error}", returncode=EXIT_FAILED
            )
        self.say(f"run {run.id} succeeded with {run.head_seq + 1} checkpoints")

    def do_list(self, opts: dict) -> None:
        runs = Run.objects.all()
        if opts["status"]:
            runs = runs.filter(status=opts["status"])
        if opts["agent"]:
            runs = runs.filter(agent=opts["agent"])
        rows = list(runs.order_by("-created_at")[: opts["limit"]])
        if not rows:
            self.say(
                "no runs yet; start one with: python manage.py durability start research"
                ' --input \'{"question": "What is a fencing token?"}\''
            )
            return
        self.say(
            f"{'run':<10}{'agent':<16}{'status':<11}{'step':<14}{'ckpts':>6}  {'age':<8}waiting on"
        )
        for run in rows:
            waiting = f"{run.wait_reason} {run.wait_detail}".strip() if run.wait_reason else ""
            if run.status == RunStatus.FAILED:
                waiting = run.error[:60]
            self.say(
                f"{run.short_id:<10}{(run.agent + '@' + run.agent_version)[:15]:<16}"
                f"{run.status:<11}{(run.step or '-')[:13]:<14}{run.head_seq + 1:>6}  "
                f"{_age(run.created_at):<8}{waiting}"
            )

    def do_show(self, opts: dict) -> None:
        run = operations.get_run(opts["run"])
        cps = list(Checkpoint.objects.filter(run=run).order_by("seq"))
        approvals = list(Approval.objects.filter(run=run).order_by("id"))
        effects = list(Effect.objects.filter(run=run).order_by("id"))
        events = list(Event.objects.filter(run=run).order_by("-id")[:20])
        if opts["json"]:
            data = {
                "id": str(run.id),
                "agent": run.agent,
                "agent_version": run.agent_version,
                "status": run.status,
                "version": run.lease_token,
                "durability": run.durability,
                "wait": {"reason": run.wait_reason, "detail": run.wait_detail},
                "step": run.step,
                "head": run.head_seq,
                "error": run.error,
                "input": canonical.loads(run.input),
                "state": operations.state_at(run),
                "checkpoints": [
                    {
                        "seq": c.seq,
                        "parent": c.parent_id,
                        "reason": c.reason,
                        "step": c.step,
                        "next_step": c.next_step,
                        "size": c.size,
                        "delta_size": c.delta_size,
                        "state_hash": c.state_hash,
                        "created_at": c.created_at.isoformat(),
                    }
                    for c in cps
                ],
                "approvals": [
                    {
                        "id": a.pk,
                        "name": a.name,
                        "status": a.status,
                        "payload": canonical.loads(a.payload),
                        # What was decided when it differs from what was asked (else null),
                        # and the difference field by field.
                        "edited_payload": (
                            canonical.loads(a.edited_payload) if a.edited_payload else None
                        ),
                        "changes": edits.stored_changes(a),
                        "decided_by": a.decided_by,
                        "comment": a.comment,
                    }
                    for a in approvals
                ],
                "effects": [
                    {
                        "id": e.pk,
                        "key": e.key,
                        "status": e.status,
                        "idempotency_key": e.idempotency_key,
                        "attempts": e.attempts,
                        "duplicates_prevented": e.duplicates_prevented,
                    }
                    for e in effects
                ],
                "calls": JournalEntry.objects.filter(run=run).count(),
                "parent": str(run.parent_run_id) if run.parent_run_id else None,
                "tree": operations.tree(run),
            }
            self.say(json.dumps(data, indent=2, default=str))
            return
        self.say(
            f"run {run.id}  {run.agent}@{run.agent_version}  {run.status.upper()}"
            + (f" ({run.wait_reason}: {run.wait_detail})" if run.wait_reason else "")
        )
        self.say(
            f"  created {run.created_at:%Y-%m-%d %H:%M:%S} by {run.created_by or '-'};"
            f" next step {run.step or '-'}; head #{run.head_seq}; version {run.lease_token}"
        )
        if run.lease_owner:
            self.say(f"  leased by {run.lease_owner} until {run.lease_expires_at:%H:%M:%S}")
        if run.forked_from_id:
            self.say(f"  forked from {run.forked_from_id} at #{run.forked_from_seq}")
        if run.parent_run_id:
            self.say(f"  child of {run.parent_run_id} (spawned as {run.spawn_key!r})")
        children = list(Run.objects.filter(parent_run=run).order_by("created_at"))
        if children:
            self.say("children:")
            for child in children:
                self.say(
                    f"  {child.id}  {child.agent}@{child.agent_version}  {child.status}"
                    + (f": {child.error[:80]}" if child.error else "")
                )
        if run.error:
            self.say(f"  error: {run.error}")
        self.say("checkpoints:")
        for c in cps:
            parent = (
                f" (parent #{c.parent.seq})" if c.parent_id and c.parent.seq != c.seq - 1 else ""
            )
            self.say(
                f"  #{c.seq:<4} {c.reason:<9} {c.step or '-':<14} -> {c.next_step or 'end':<14}"
                f" {c.size:>9,} B  Δ {c.delta_size:>7,} B{parent}"
            )
        if approvals:
            self.say("approvals:")
            for a in approvals:
                who = f" by {a.decided_by}" if a.decided_by else ""
                self.say(f"  {a.name:<14} {a.status:<10}{who} {a.comment}")
                changed = edits.describe(edits.stored_changes(a))
                if changed:
                    self.say(f"    with edits: {changed}")
        if effects:
            self.say("effects:")
            for e in effects:
                self.say(
                    f"  [{e.pk}] {e.key:<14} {e.status:<9} key={e.idempotency_key}"
                    f" attempts={e.attempts} duplicates prevented={e.duplicates_prevented}"
                )
        self.say("recent events:")
        for e in reversed(events):
            who = f" by {e.actor}" if e.actor else (f" on {e.worker}" if e.worker else "")
            why = f": {e.reason[:80]}" if e.reason else ""
            seq = f" #{e.seq}" if e.seq is not None else ""
            self.say(f"  {e.created_at:%H:%M:%S} {e.kind}{seq} {e.step}{who}{why}")

    def do_resume(self, opts: dict) -> None:
        run = operations.resume(
            opts["run"], by=self.by, reason=self.reason, expected_version=opts["expect_version"]
        )
        self.say(f"run {run.id} queued again from checkpoint #{run.head_seq} (step {run.step})")

    def do_rollback(self, opts: dict) -> None:
        plan = operations.plan_rollback(opts["run"], opts["to"])
        decisions = _effect_decisions(plan, opts["effect"])
        hold = not opts["and_continue"]
        if not opts["dry_run"]:
            plan = operations.rollback(
                opts["run"],
                opts["to"],
                by=self.by,
                reason=self.reason,
                and_continue=opts["and_continue"],
                decisions=decisions,
                expected_version=opts["expect_version"],
            )
        verb = "would roll back" if opts["dry_run"] else "rolled back"
        self.say(f"{verb} run {plan.run.id} to checkpoint #{plan.target.seq}:")
        # The same sentences as the dashboard's preview (one function makes them).
        for sentence in plan.sentences(decisions, hold=hold):
            self.say(f"  {sentence}")
        for e in plan.done_not_undone:
            undo = (
                "compensated"
                if decisions.get(e.id) == "compensate"
                else "can be compensated"
                if e.can_compensate
                else "cannot be undone"
            )
            self.say(
                f"  effect {e.id} {e.key} in step {e.step} after #{e.seq} ({e.status}, {undo}):"
                f" {decisions.get(e.id, 'ask')}"
            )

    def do_fork(self, opts: dict) -> None:
        state = None
        if opts["state"]:
            text = self._stdin() if opts["state"] == "-" else self._read(opts["state"])
            state = _json_arg(text, f"--state {opts['state']}")
        if opts["live"] and not opts["what_if"]:
            raise InvalidInput("--live goes with --what-if")
        run = operations.fork(
            opts["run"],
            opts["from_seq"],
            state=state,
            by=self.by,
            reason=self.reason,
            what_if=opts["what_if"],
            live=opts["live"],
        )
        kind = "what-if " if run.what_if else ""
        self.say(f"forked {kind}run {run.id} from #{opts['from_seq']} of {run.forked_from_id}")

    def _stdin(self) -> str:
        try:
            return sys.stdin.read()
        except UnicodeDecodeError:
            raise StateNotJSON("stdin is not text (JSON is UTF-8)") from None

    def _read(self, path: str) -> str:
        try:
            with open(path) as f:
                return f.read()
        except OSError as exc:
            raise InvalidInput(f"cannot read {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise StateNotJSON(f"{path} is not text (JSON is UTF-8)") from None

    def do_cancel(self, opts: dict) -> None:
        run = operations.cancel(
            opts["run"], by=self.by, reason=self.reason, expected_version=opts["expect_version"]
        )
        self.say(f"run {run.id} cancelled")

    def do_approve(self, opts: dict) -> None:
        payload = _json_arg(opts["payload"], "--payload") if opts["payload"] else None
        approval = operations.decide(
            opts["run"],
            opts["name"],
            approve=not opts["reject"],
            by=self.by,
            comment=opts["comment"] or self.reason,
            payload=payload,
            expected_version=opts["expect_version"],
        )
        self.say(f"approval {approval.name!r} of run {approval.run_id} {approval.status}")

    def do_send(self, opts: dict) -> None:
        data = _json_arg(opts["data"], "--data")
        message = operations.send(
            opts["run"],
            opts["name"],
            data,
            idempotency_key=opts["key"],
            by=self.by,
            reason=self.reason,
            expected_version=opts["expect_version"],
        )
        self.say(f"message {message.name!r} #{message.pk} delivered to run {message.run_id}")

    def do_resolve(self, opts: dict) -> None:
        result = _json_arg(opts["result"], "--result")
        effect = operations.resolve_effect(
            opts["run"],
            opts["effect"],
            outcome=opts["outcome"],
            result=result,
            by=self.by,
            note=self.reason,
            expected_version=opts["expect_version"],
        )
        self.say(f"effect {effect.key!r} marked {effect.status}")

    def do_verify(self, opts: dict) -> None:
        reports = operations.verify(opts["run"])
        bad = [r for r in reports if not r.ok]
        for report in reports:
            if not report.ok or opts["run"]:
                self.say(str(report))
        total = sum(r.checked for r in reports)
        if bad:
            raise CommandError(
                f"[{IntegrityViolation.code}] {len(bad)} of {len(reports)} run(s) have a"
                " checkpoint that does not verify",
                returncode=EXIT_INTEGRITY,
            )
        self.say(f"{len(reports)} run(s), {total} checkpoint(s): all verify")

    def do_prune(self, opts: dict) -> None:
        from durability.retention import prune

        report = prune(dry_run=opts["dry_run"])
        for line in report.lines() or ["nothing to prune"]:
            self.say(line)

    def do_hold(self, opts: dict) -> None:
        from durability.retention import hold

        run = hold(opts["run"], on=not opts["release"], by=self.by, reason=self.reason)
        self.say(f"run {run.id} {'on legal hold' if run.legal_hold else 'released from hold'}")

    def do_agents(self, opts: dict) -> None:
        for agent in registry.all():
            steps = " -> ".join(agent.order) if agent.pipeline else ", ".join(agent.order)
            self.say(
                f"{agent.name}@{agent.version}  schema v{agent.schema_version}  steps: {steps}"
            )
            if agent.description:
                self.say(f"    {agent.description}")

    def do_sweep(self, opts: dict) -> None:
        from durability.recovery import sweep

        report = sweep()
        self.say(
            f"recovered {len(report.recovered)}, timers due {len(report.timers)},"
            f" rung again {len(report.rung)}"
        )
