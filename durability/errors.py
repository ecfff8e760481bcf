"""Coded errors. Every message names the run it is about, so a log line is enough to act on.

Two families: ``DurabilityError`` (an ``Exception``) for things callers handle, and the
control-flow signals (``BaseException``) that unwind a step and that agent code must not
swallow with a bare ``except Exception``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from durability.runtime.waits import Suspension


class DurabilityError(Exception):
    """Base of every error the engine raises on purpose."""

    code = "DUR000"
    # The input at fault, in the caller's terms (an API field, a form field), where one is.
    field = ""

    def __init__(self, message: str, *, run_id: object | None = None, field: str = "") -> None:
        self.message = message
        self.run_id = run_id
        if field:
            self.field = field
        super().__init__(message)

    def __str__(self) -> str:
        where = f" (run {self.run_id})" if self.run_id else ""
        return f"[{self.code}] {self.message}{where}"


# --- bad input: a clear message and nothing changed ------------------------------------------


class InvalidInput(DurabilityError):
    code = "DUR100"


class UnknownAgent(InvalidInput):
    code = "DUR101"


class SchemaViolation(InvalidInput):
    """Input or state that fails the agent's schema. Permanent: retrying cannot fix it."""

    code = "DUR102"


class StateNotJSON(InvalidInput):
    code = "DUR103"


class StateTooLarge(InvalidInput):
    code = "DUR104"


class UnknownRun(InvalidInput):
    code = "DUR105"


class UnknownCheckpoint(InvalidInput):
    code = "DUR106"


class InvalidTransition(InvalidInput):
    """The operation does not apply to the run in its current status."""

    code = "DUR107"


class Stale(InvalidTransition):
    """The decision was made on a version of the run that is no longer current: another
    decision (or a copy of this one) or a worker moved it on since. Nothing was changed."""

    code = "DUR112"


class TransitionNotAllowed(InvalidTransition):
    """A change of status the run's state machine does not allow from the status the run is
    in (the table in ``durability.lifecycle``). Nothing was changed."""

    code = "DUR114"


class ExecutedElsewhere(InvalidTransition):
    """The run is executed outside the workers (a LangGraph graph compiled with
    ``DurableSaver`` in its own process: ``durability.langgraph.runs``), so an action that
    needs a worker to carry it out (resume, cancel, roll back, fork, decide, resolve, send)
    cannot be done here. Nothing was changed."""

    code = "DUR120"


class OnLegalHold(InvalidTransition):
    """The run is on legal hold (``durability hold``): it may not be deleted, by retention
    or by anything else, until the hold is released. Nothing was changed."""

    code = "DUR121"


class AlreadyDecided(InvalidInput):
    code = "DUR108"


class UnknownApproval(InvalidInput):
    code = "DUR109"


class UnknownEffect(InvalidInput):
    code = "DUR110"


class NotAllowed(InvalidInput):
    """The person acting is not among those the policy lets decide."""

    code = "DUR111"


class IdempotencyConflict(InvalidInput):
    """An idempotency key already used for another request (another agent, input or
    message): nothing was done; a new request needs a new key."""

    code = "DUR115"


# --- integrity ---------------------------------------------------------------------------------


class IntegrityViolation(DurabilityError):
    """A checkpoint's stored bytes do not match its hashes; it is never rehydrated."""

    code = "DUR200"

    def __init__(self, message: str, *, run_id: object | None = None, seq: int | None = None):
        self.seq = seq
        super().__init__(message, run_id=run_id)


# --- execution -----------------------------------------------------------------------------


class FencedOut(DurabilityError):
    """A fenced write found another lease or another head: this worker must stop."""

    code = "DUR300"

    def __init__(self, message: str, *, run_id: object | None = None, guard: str = "lease"):
        self.guard = guard
        super().__init__(message, run_id=run_id)


class NonDeterminismError(DurabilityError):
    """A replayed operation met a different function or arguments than it recorded."""

    code = "DUR400"


class EffectFailed(DurabilityError):
    """An effect an operator marked as failed, raised into the step that asked for it."""

    code = "DUR401"


class IncompatibleVersion(DurabilityError):
    """A checkpoint written by an agent version this code cannot continue."""

    code = "DUR402"


class PoisonStep(DurabilityError):
    code = "DUR500"


class StepError(DurabilityError):
    """A step raised an error that is not transient; the run fails with it recorded."""

    code = "DUR501"


class RetriesExhausted(DurabilityError):
    code = "DUR502"


class AgentDefinitionError(DurabilityError):
    code = "DUR600"


class SecretMissing(DurabilityError):
    code = "DUR601"


# --- the database ---------------------------------------------------------------------------


class DatabaseUnavailable(DurabilityError):
    """The database could not be reached, or stopped answering, while a command ran."""

    code = "DUR700"


# --- what agent code raises ----------------------------------------------------------------


class Transient(Exception):
    """Raise (or subclass) for an error worth retrying: a timeout, a 503, a dropped socket.

    The run is rescheduled with exponential backoff and jitter; no worker sleeps meanwhile.
    """

    def __init__(self, message: str = "", *, retry_after: float | None = None) -> None:
        self.retry_after = retry_after
        super().__init__(message)


class RateLimited(Transient):
    """The provider said "slow down"; ``retry_after`` (seconds) is honoured when given."""


class StepTimeout(Transient):
    """A step ran past its agent's ``step_timeout``."""


class Permanent(Exception):
    """Raise for an error that retrying cannot fix; the run fails with it recorded."""


# --- control flow: BaseException so that ``except Exception`` in agent code lets it pass -----


class Suspend(BaseException):  # noqa: N818 - a signal, not an error
    """Unwinds a step that waits (approval, timer, in-doubt effect); the worker is released.

    Carries a ``durability.runtime.context.Suspension`` saying what to record and what to re-check.
    """

    def __init__(self, suspension: Suspension) -> None:
        self.suspension = suspension
        super().__init__(suspension)


class LeaseLost(BaseException):  # noqa: N818 - a signal, not an error
    """Another worker owns the run now; this one stops without writing anything else."""

    def __init__(self, message: str, guard: str = "lease") -> None:
        self.guard = guard
        super().__init__(message)


class Abandon(BaseException):  # noqa: N818 - a signal, not an error
    """The worker is shutting down and the step did not finish within the grace period."""
