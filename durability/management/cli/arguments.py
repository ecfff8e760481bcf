"""The CLI's arguments: one function per group of subcommands, in the order ``--help``
lists them."""

from __future__ import annotations

import argparse
from typing import Any

from durability.models import RunStatus


def _with_actor(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--by`` and ``--reason`` after the subcommand too. SUPPRESS: when not given here,
    the value given before the subcommand (or the default) stays."""
    p.add_argument("--by", default=argparse.SUPPRESS, help="who is acting")
    p.add_argument("--reason", default=argparse.SUPPRESS, help="why (kept in the audit trail)")
    return p


def _at_least(low: int) -> Any:
    """An argparse type: a whole number no lower than ``low`` (a negative count is refused
    with the rule, not taken)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least {low}")
        return value

    return parse


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds over 0 (a timeout of -5 s waited for nothing)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds over 0")
    return value


def _with_version(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--expect-version",
        type=_at_least(0),
        metavar="N",
        help=(
            "act only if the run is still at this version (see show); without it, the command"
            " acts on what it reads in the same locked transaction"
        ),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--by", default="", help="who is acting (default: $DURABILITY_ACTOR or the OS user)"
    )
    parser.add_argument("--reason", default="", help="why (recorded in the audit trail)")
    sub = parser.add_subparsers(dest="action", required=True, metavar="SUBCOMMAND")
    _runs(sub)
    _history(sub)
    _decisions(sub)
    _upkeep(sub)
    for p in sub.choices.values():
        _with_actor(p)


def _runs(sub: Any) -> None:
    """Starting and reading runs: start, list, show, resume."""
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
    p.add_argument("--timeout", type=_seconds, help="seconds to wait (with --wait; 600)")

    p = sub.add_parser("list", help="list runs, newest first")
    p.add_argument("--status", choices=[s.value for s in RunStatus])
    p.add_argument("--agent", help="an agent name, or name@version as the list shows it")
    p.add_argument("--limit", type=_at_least(1), default=30, help="at most this many runs (30)")
    p.add_argument(
        "--json", action="store_true", help="machine-readable: the API's list of runs, its names"
    )

    p = sub.add_parser("show", help="show a run: header, checkpoints, approvals, effects, events")
    p.add_argument("run")
    p.add_argument("--json", action="store_true", help="machine-readable, with the head state")

    p = sub.add_parser("resume", help="queue a failed or cancelled run again; continue one on hold")
    p.add_argument("run")
    _with_version(p)


def _history(sub: Any) -> None:
    """Going back in a run's history: rollback, fork."""
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


def _decisions(sub: Any) -> None:
    """Deciding for a run: cancel, approve, send, resolve."""
    p = sub.add_parser("cancel", help="cancel a run")
    p.add_argument("run")
    _with_version(p)

    p = sub.add_parser("approve", help="decide a pending approval (approve unless --reject)")
    p.add_argument("run")
    p.add_argument("name")
    p.add_argument("--reject", action="store_true")
    p.add_argument("--comment", default="", help="why (required with --reject)")
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


def _upkeep(sub: Any) -> None:
    """Looking after every run: verify, prune, hold, agents, sweep."""
    p = sub.add_parser("verify", help="check the hash chain of one run, or of all runs")
    p.add_argument("run", nargs="?")

    p = sub.add_parser("prune", help="apply the agents' retention policies")
    p.add_argument("--dry-run", action="store_true", help="only print what it would remove")

    p = sub.add_parser("hold", help="put a run on legal hold (never pruned)")
    p.add_argument("run")
    p.add_argument("--release", action="store_true", help="lift the hold")

    sub.add_parser("agents", help="list the registered agents")
    sub.add_parser("sweep", help="run the sweeper once")
