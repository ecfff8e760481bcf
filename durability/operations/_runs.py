"""Finding runs and checkpoints, and the checks every operation makes before it acts:
the status and the version the operator saw."""

from __future__ import annotations

import re
import uuid
from typing import Any

from durability import canonical, checkpoints
from durability.conf import Setting
from durability.errors import InvalidInput, Stale, StateTooLarge, UnknownCheckpoint, UnknownRun
from durability.integrity import Report, verify_run
from durability.models import Checkpoint, Event, Run

_HEX = re.compile(r"^[0-9a-f-]{4,36}$")


def get_run(ref: Any) -> Run:
    """A run by its id, or by a unique prefix of at least 4 characters."""
    if isinstance(ref, Run):
        return ref
    text = str(ref).strip().lower()
    try:
        return Run.objects.get(pk=uuid.UUID(text))
    except ValueError:
        pass
    except Run.DoesNotExist:
        raise UnknownRun(f"no run {text}") from None
    if not _HEX.match(text):
        raise UnknownRun(
            f"{ref!r} is not a run id: give the id, or its first 4 or more characters (0-9, a-f)"
        )
    matches = list(Run.objects.filter(id__startswith=text).only("id")[:2])
    if not matches:
        raise UnknownRun(f"no run whose id starts with {text}")
    if len(matches) > 1:
        raise UnknownRun(f"more than one run id starts with {text}; give more characters")
    return Run.objects.get(pk=matches[0].pk)


def _locked(ref: Any) -> Run:
    run = get_run(ref)
    return Run.objects.select_for_update().get(pk=run.pk)


def _checkpoint_of(run: Run, seq: int | None = None, checkpoint_id: int | None = None):
    if checkpoint_id is not None:
        cp = Checkpoint.objects.filter(pk=checkpoint_id).select_related("parent").first()
        if cp is None:
            raise UnknownCheckpoint(f"no checkpoint with id {checkpoint_id}", run_id=run.id)
        if cp.run_id != run.id:
            raise InvalidInput(
                f"checkpoint id {checkpoint_id} belongs to run {cp.run_id}, not to this one;"
                " a run can only be rolled back to its own checkpoints (fork the other run"
                " instead)",
                run_id=run.id,
            )
        return cp
    try:
        seq = int(seq)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise UnknownCheckpoint(f"{seq!r} is not a checkpoint number", run_id=run.id) from None
    cp = Checkpoint.objects.filter(run=run, seq=seq).select_related("parent").first()
    if cp is None:
        raise UnknownCheckpoint(
            f"run has no checkpoint #{seq} (its checkpoints are #0 to #{run.head_seq})",
            run_id=run.id,
        )
    return cp


def state_at(ref: Any, seq: int | None = None) -> Any:
    """The verified state of a run at checkpoint ``seq`` (default: the head; for a ``Run``,
    the head it was read with)."""
    run_id: uuid.UUID | None
    if isinstance(ref, Run):
        run_id, seq = ref.id, ref.head_seq if seq is None else seq
    else:
        run_id = _as_uuid(ref)
    if run_id is not None and (seq is None or type(seq) is int):
        rebuilt = checkpoints.run_state(run_id, seq)
        if rebuilt is not None:
            return rebuilt.state
    # A prefix, a number given as text, or no such run or checkpoint: found (or refused,
    # with the reason) the long way.
    run = get_run(ref)
    cp = _checkpoint_of(run, run.head_seq if seq is None else seq)
    state, _, _ = checkpoints.verified_state(cp)
    return state


def _as_uuid(ref: Any) -> uuid.UUID | None:
    if isinstance(ref, uuid.UUID):
        return ref
    try:
        return uuid.UUID(str(ref).strip())
    except ValueError:
        return None


def _encoded(value: Any, what: str, limit_setting: Setting[int]) -> bytes:
    canonical.check_json(value, what=what)
    data = canonical.dumps(value, what=what)
    limit = limit_setting.current()
    if len(data) > limit:
        raise StateTooLarge(
            f"{what} is {len(data):,} bytes, over the limit of {limit:,} ({limit_setting.name})"
        )
    return data


def _check_status(run: Run, expected_status: str | None) -> None:
    """A decision made on a page showing the run in one state must not act on another: an
    operator resuming a waiting run must not revive one a colleague cancelled meanwhile."""
    if expected_status is not None and run.status != expected_status:
        raise Stale(
            f"the run changed since this was shown: it is {run.status} now, not"
            f" {expected_status}{_last_change(run)}; review it again",
            run_id=run.id,
        )


def _check_version(run: Run, expected_version: int | None) -> None:
    """Once per decision. The version of a run is its fencing token (``lease_token``), which
    every operator transition (resume, cancel, rollback), every claim by a worker and every
    requeue by the sweeper advances in the same statement as its change. A decision names the
    version it was made on and is checked here under the run's row lock, so a second copy of
    it (a double click without the form's token, a retried request, a script run twice) finds
    the version moved and changes nothing, even after the run came back to the status the
    decision expects (resumed, claimed and failed again). None: the caller decides on what
    it reads inside this same locked transaction (the CLI without ``--expect-version``)."""
    if expected_version is None or run.lease_token == expected_version:
        return
    if expected_version > run.lease_token:
        # Not a version the run has left: one it never had (a typo, another run's).
        raise Stale(
            f"the run is at version {run.lease_token}, and has never been at"
            f" {expected_version}: check the run and the version you meant (show prints it)",
            run_id=run.id,
        )
    raise Stale(
        f"the run moved on since you saw it: it was at version {expected_version}, it is"
        f" at {run.lease_token} now ({run.status}{_last_change(run)}); review it again",
        run_id=run.id,
    )


def _last_change(run: Run) -> str:
    """What changed the run last, for a refused decision: ", last: resumed by ann at ..."."""
    event = (
        Event.objects.filter(run=run)
        .order_by("-id")
        .only("kind", "actor", "worker", "created_at")
        .first()
    )
    if event is None:
        return ""
    who = f" by {event.actor}" if event.actor else (f" on {event.worker}" if event.worker else "")
    return f"; last: {event.get_kind_display()}{who} at {event.created_at:%H:%M:%S} UTC"


def verify(ref: Any | None = None) -> list[Report]:
    """Verify one run's checkpoints, or every run's."""
    if ref is not None:
        return [verify_run(get_run(ref).id)]
    return [
        verify_run(run_id)
        for run_id in Run.objects.order_by("created_at").values_list("id", flat=True)
    ]
