"""Operations on runs: start, resume, roll back, fork, cancel, decide, resolve, send.

Each validates its input first and changes nothing when it refuses; each locks the run row,
decides, writes the change with an event naming who and why in the same transaction, and
only then rings the doorbell (after commit). A run's status changes only through
``durability.lifecycle``; events are built by ``durability.events``.

The modules here are private; everything callers use is imported from this package.
"""

from __future__ import annotations

# Also reachable from here: the canonical encoding, and the two helpers retention uses.
from durability import canonical as canonical
from durability.operations._control import WAKES_BY_ITSELF, cancel, resume
from durability.operations._decisions import (
    OPERATORS_GROUP,
    check_may_decide,
    decide,
    expire_approvals,
)
from durability.operations._effects import resolve_effect
from durability.operations._fork import check_fork, fork
from durability.operations._messages import delivered, send
from durability.operations._rollback import RollbackPlan, RollbackResult, plan_rollback, rollback
from durability.operations._runs import _locked as _locked
from durability.operations._runs import get_run, state_at, verify
from durability.operations._start import (
    check_durability,
    spawn_child,
    start,
    started,
    tree,
    wake_parent,
)

__all__ = [
    "OPERATORS_GROUP",
    "WAKES_BY_ITSELF",
    "RollbackPlan",
    "RollbackResult",
    "cancel",
    "check_durability",
    "check_fork",
    "check_may_decide",
    "decide",
    "expire_approvals",
    "fork",
    "get_run",
    "plan_rollback",
    "resolve_effect",
    "resume",
    "rollback",
    "send",
    "spawn_child",
    "delivered",
    "start",
    "started",
    "state_at",
    "tree",
    "verify",
    "wake_parent",
]
