"""Which live worker can run what: for rolling deploys, where old and new workers serve side
by side and a run must go to one that can continue its checkpoints.

Each worker announces, and renews every ``DURABILITY_PRESENCE_SECONDS``, the agents it has:
version, schema version, the versions it declares compatible and the schema versions it can
upgrade from. ``route(run)`` picks a live worker that can continue the run's head; none
alive means the run waits, saying so, until one is. With no announcement at all (a single
process, a test), anything goes anywhere.
"""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from durability import canonical
from durability.agents import registry
from durability.models import Checkpoint, Run, RunStatus, WaitReason, WorkerPresence


def ttl() -> float:
    return 3 * float(getattr(settings, "DURABILITY_PRESENCE_SECONDS", 15.0))


def capabilities() -> dict[str, dict]:
    return {
        agent.name: {
            "version": agent.version,
            "schema_version": agent.schema_version,
            "compatible": sorted(agent.compatible_versions),
            "upgrades_from": sorted(agent.upgrades),
        }
        for agent in registry.all()
    }


def announce(name: str) -> None:
    now = timezone.now()
    data = canonical.dumps(capabilities()).decode()
    updated = WorkerPresence.objects.filter(pk=name).update(capabilities=data, seen_at=now)
    if not updated:
        WorkerPresence.objects.update_or_create(
            pk=name, defaults={"capabilities": data, "started_at": now, "seen_at": now}
        )


def withdraw(name: str) -> None:
    WorkerPresence.objects.filter(pk=name).delete()


def _can_continue(cap: dict | None, version: str, schema_version: int) -> bool:
    """The same rule as ``Agent.can_continue``, on what a worker announced."""
    if cap is None:
        return False
    if version == cap["version"] or version in cap["compatible"]:
        return True
    if schema_version < cap["schema_version"]:
        return all(v in cap["upgrades_from"] for v in range(schema_version, cap["schema_version"]))
    return False


def live() -> dict[str, dict]:
    since = timezone.now() - timedelta(seconds=ttl())
    return {
        p.name: canonical.loads(p.capabilities)
        for p in WorkerPresence.objects.filter(seen_at__gte=since)
    }


def route(run_id: Any) -> tuple[str | None, str]:
    """``(worker name or None, why not)``. ``(None, "")`` when any worker may take it: nobody
    announced, or every live worker can continue the run."""
    workers = live()
    if not workers:
        return None, ""
    run = Run.objects.filter(pk=run_id).values("agent", "head_seq").first()
    if run is None:
        return None, ""
    head = (
        Checkpoint.objects.filter(run_id=run_id, seq=run["head_seq"])
        .values("agent_version", "schema_version")
        .first()
    )
    if head is None:
        return None, ""
    able = [
        name
        for name, caps in workers.items()
        if _can_continue(caps.get(run["agent"]), head["agent_version"], head["schema_version"])
    ]
    if able and len(able) == len(workers):
        # Every live worker can continue it: the shared queue, which whichever is alive and
        # free consumes. A direct queue would be a bet on one worker, and a worker that died
        # since its last announcement would sit on the run until the sweeper rings again.
        return None, ""
    if able:
        # A rolling deploy: only the workers that have this version may take it.
        return random.choice(able), ""
    running = sorted(
        {
            f"{run['agent']}@{caps[run['agent']]['version']}"
            for caps in workers.values()
            if run["agent"] in caps
        }
    )
    return None, (
        f"no live worker can run {run['agent']}@{head['agent_version']}"
        f" (schema v{head['schema_version']}); live workers run {', '.join(running) or 'none'}"
    )


def wait_for_a_worker(run_id: Any, why: str) -> None:
    """Nobody can take the run now: it waits, saying why; the sweeper asks again."""
    later = timezone.now() + timedelta(seconds=ttl() / 3)
    with transaction.atomic():
        Run.objects.filter(pk=run_id, status=RunStatus.QUEUED).update(
            wait_reason=WaitReason.VERSION, wait_detail=why[:500], wake_at=later, rung_at=later
        )
