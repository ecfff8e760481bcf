"""``python manage.py durability <subcommand>``: operate runs without a browser.

Exit codes: 0 success; 1 the run failed or was cancelled (``start --wait``), or an
operation failed; 2 bad input (unknown run, agent or checkpoint, invalid JSON...); 3 a
checkpoint does not verify; 4 ``--wait`` stopped because the run waits for a person;
5 ``--wait`` timed out; 6 the database cannot be reached, or has none of the product's tables
(run ``migrate``). Every error is one line with its code, never a traceback.
"""

from __future__ import annotations

import getpass
import os
import sys
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, InterfaceError, OperationalError

from durability import dispatch, operations, rollbacks, shapes, telemetry
from durability.agents import registry
from durability.errors import (
    DatabaseUnavailable,
    DurabilityError,
    IntegrityViolation,
    InvalidInput,
    StateNotJSON,
)
from durability.langgraph import cli as lg_cli
from durability.management.cli import arguments
from durability.management.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_DATABASE,
    EXIT_FAILED,
    EXIT_INTEGRITY,
    EXIT_TIMEOUT,
    EXIT_WAITING,
    age,
    effect_decisions,
    json_arg,
    json_text,
)
from durability.management.cli.show import show
from durability.models import FINISHED, Effect, EffectStatus, Run, RunStatus, WaitReason
from durability.store import unmigrated


class Command(BaseCommand):
    help = (
        "Operate durable agent runs: start and inspect them, decide what they wait for, move"
        " them (resume, roll back, fork, cancel), check and keep their history. Each"
        " subcommand below; SUBCOMMAND --help for its options."
    )

    def get_version(self) -> str:
        """``--version``: the product's, not only Django's."""
        from importlib.metadata import PackageNotFoundError, version

        import django

        try:
            mine = version("durability")
        except PackageNotFoundError:  # a checkout run without installing it
            mine = "unknown"
        return f"durability {mine} (Django {django.get_version()})"

    def add_arguments(self, parser) -> None:
        arguments.add_arguments(parser)

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
        except BrokenPipeError:
            # The reader stopped reading (``| head``): what it read is all it wanted. The
            # rest of the output goes nowhere, so that flushing it at exit fails no more.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except DatabaseError as exc:
            if (said := unmigrated(exc)) is not None:
                raise CommandError(
                    str(DatabaseUnavailable(said)), returncode=EXIT_DATABASE
                ) from None
            if not isinstance(exc, OperationalError | InterfaceError):
                raise
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
        if opts["timeout"] is not None and not opts["wait"]:
            raise InvalidInput("--timeout goes with --wait; nothing was started")
        source = opts["input"]
        if source == "-":
            text, what = self._stdin(), "--input - (stdin)"
        elif source.startswith("@"):
            text, what = self._read(source[1:]), f"--input {source}"
        else:
            text, what = source, "--input"
        payload = json_arg(text, what)
        run, made = operations.started(
            opts["agent"],
            payload,
            by=self.by,
            reason=self.reason,
            idempotency_key=opts["idempotency_key"],
            durability=opts["durability"],
        )
        if made:
            self.say(f"started {run.agent}@{run.agent_version} run {run.id}")
        else:  # a retry: the key's first start made it. The id stays the line's last word.
            self.say(
                "already started with this idempotency key, nothing new started:"
                f" {run.agent}@{run.agent_version} run {run.id}"
            )
        if opts["wait"]:
            self._wait(run, 600.0 if opts["timeout"] is None else opts["timeout"])

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
            said = f": {code}{run.error}" if run.error else ""  # a cancel gives no error
            raise CommandError(f"run {run.id} {run.status}{said}", returncode=EXIT_FAILED)
        self.say(f"run {run.id} succeeded with {run.head_seq + 1} checkpoints")

    def do_list(self, opts: dict) -> None:
        runs = Run.objects.all()
        if opts["status"]:
            runs = runs.filter(status=opts["status"])
        if opts["agent"]:
            # As the agent column shows it too: name@version.
            name, at, version = opts["agent"].partition("@")
            runs = runs.filter(agent=name, **({"agent_version": version} if at else {}))
        rows = list(runs.order_by("-created_at")[: opts["limit"]])
        if opts["json"]:  # as GET /api/v1/runs pages them
            self.say(json_text({"items": [shapes.run(run) for run in rows]}))
            return
        if not rows and (opts["status"] or opts["agent"]):
            given = ", ".join(f"{key} {opts[key]}" for key in ("agent", "status") if opts[key])
            self.say(
                f"no runs match ({given}); without the filters: python manage.py durability list"
            )
            return
        if not rows:
            self.say(
                "no runs yet; start one with: python manage.py durability start research"
                ' --input \'{"question": "What is a fencing token?"}\''
            )
            return
        # As wide as the page's longest agent@version (a graph's version is "langgraph"),
        # within reason.
        agents = [f"{run.agent}@{run.agent_version}"[:40] for run in rows]
        wide = max(16, max(map(len, agents)) + 1)
        self.say(
            f"{'run':<10}{'agent':<{wide}}{'status':<11}{'step':<14}{'ckpts':>6}  {'age':<8}"
            "waiting on, or error"
        )
        graphs = lg_cli.marks(rows)  # LangGraph graphs executed in their own process
        for run, agent in zip(rows, agents, strict=True):
            waiting = f"{run.wait_reason} {run.wait_detail}".strip() if run.wait_reason else ""
            if run.pk in graphs:
                waiting = f"[{graphs[run.pk]}] {run.wait_detail[:60]}".strip()
            if run.status == RunStatus.FAILED:
                waiting = run.error[:60]
            # One row a run: an error or a wait of several lines (LangGraph's add a link on
            # their second) on one.
            waiting = " ".join(waiting.split())
            self.say(
                f"{run.short_id:<10}{agent:<{wide}}"
                f"{run.status:<11}{(run.step or '-')[:13]:<14}{run.head_seq + 1:>6}  "
                f"{age(run.created_at):<8}{waiting}"
            )

    def do_show(self, opts: dict) -> None:
        show(self.say, opts["run"], as_json=opts["json"])
        if not opts["json"]:
            lg_cli.show(self.say, operations.get_run(opts["run"]))

    def do_resume(self, opts: dict) -> None:
        asked = operations.get_run(opts["run"])
        doubts = list(Effect.objects.filter(run=asked, status=EffectStatus.IN_DOUBT))
        run = operations.resume(
            opts["run"], by=self.by, reason=self.reason, expected_version=opts["expect_version"]
        )
        self.say(f"run {run.id} queued again from checkpoint #{run.head_seq} (step {run.step})")
        for effect in doubts:
            # A resume settles nothing: the step asks the effect's reconcile function again.
            self.say(
                f"  effect {effect.key!r} [{effect.pk}] is still in doubt: the step asks its"
                " reconcile function again if it has one, else waits in doubt again; resolve"
                f" it with durability resolve {run.id} {effect.pk} done|failed|retry"
            )

    def do_rollback(self, opts: dict) -> None:
        plan = operations.plan_rollback(opts["run"], opts["to"])
        decisions = effect_decisions(plan, opts["effect"])
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
                "to be compensated before the run goes on"
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
            state = json_arg(text, f"--state {opts['state']}")
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
        if run.what_if:
            # What the operator must know before the run goes further than the reused calls.
            self.say(
                "  live: its effects (and its child runs') are performed for real, under new keys"
                if run.what_if_live
                else "  its effects (and its child runs') are recorded as would have run, not"
                " performed"
            )

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
        if owed := rollbacks.owed(run):
            self.say(
                f"  not performed: the compensation{'s' * (len(owed) > 1)} chosen at its"
                f" rollback ({'; '.join(owed)}); resuming the run performs"
                f" {'them' if len(owed) > 1 else 'it'} first"
            )

    def do_approve(self, opts: dict) -> None:
        payload = json_arg(opts["payload"], "--payload") if opts["payload"] else None
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
        data = json_arg(opts["data"], "--data")
        message, made = operations.delivered(
            opts["run"],
            opts["name"],
            data,
            idempotency_key=opts["key"],
            by=self.by,
            reason=self.reason,
            expected_version=opts["expect_version"],
        )
        if made:
            self.say(f"message {message.name!r} #{message.pk} delivered to run {message.run_id}")
        else:
            self.say(
                f"message {message.name!r} #{message.pk} already delivered with this key, not"
                f" again, to run {message.run_id}"
            )

    def do_resolve(self, opts: dict) -> None:
        result = json_arg(opts["result"], "--result")
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
        if run.legal_hold:
            self.say(f"run {run.id} on legal hold: retention and deletion leave it alone")
            return
        self.say(f"run {run.id} released from legal hold")
        if run.status == RunStatus.WAITING and run.wait_reason == WaitReason.HOLD:
            # Two holds share the word: this one is a rollback's, which resume ends.
            self.say(
                "  it is still on hold after a rollback (not a legal hold): continue it with"
                f" durability resume {run.id}"
            )

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
