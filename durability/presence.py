"""Which live worker can run what: for rolling deploys, where old and new workers serve side
by side and a run must go to one that can continue its checkpoints.

Each worker announces, and renews every ``DURABILITY_PRESENCE_SECONDS``, the agents it has:
version, schema version, the versions it declares compatible and the schema versions it can
upgrade from. On PostgreSQL it also holds an advisory lock while it lives, so a killed
worker stops counting as live at once. ``route(run)`` picks a live worker that can continue
the run's head; none alive means the run waits, saying so, until one is. With no
announcement at all (a single process, a test), anything goes anywhere.
"""

from __future__ import annotations

import hashlib
import random
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from durability import canonical, lifecycle
from durability.agents import registry
from durability.conf import conf
from durability.models import Checkpoint, Run, WaitReason, WorkerPresence
from durability.store import store


def ttl() -> float:
    return 3 * conf.PRESENCE_SECONDS


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


# Advisory locks taken as (namespace, key) pairs: apart from the runs' single-bigint keys.
_LOCK_NAMESPACE = 0x70726573  # "pres"


def liveness_key(name: str) -> int:
    """A worker's advisory-lock key: 31 bits of a hash of its name (a collision only makes a
    dead worker look alive while its twin lives, which is what the time to live allows)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") & 0x7FFFFFFF


def announce(name: str, *, hold: bool = False) -> None:
    """Announce what this worker can run. ``hold``: also take, on this thread's connection,
    the advisory lock that tells the worker is alive (PostgreSQL); the caller keeps that
    connection open for the worker's life, and announces from it again to renew."""
    now = timezone.now()
    data = canonical.dumps(capabilities()).decode()
    key = None
    if hold and store().session_locks:
        key = liveness_key(name)
        store().hold_worker_lock(_LOCK_NAMESPACE, key)
    fields = {"capabilities": data, "seen_at": now, "liveness_key": key}
    if not WorkerPresence.objects.filter(pk=name).update(**fields):
        WorkerPresence.objects.update_or_create(pk=name, defaults={**fields, "started_at": now})


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
    """The workers announced within the time to live, less those whose liveness lock is
    free: their process died."""
    since = timezone.now() - timedelta(seconds=ttl())
    found = list(WorkerPresence.objects.filter(seen_at__gte=since))
    held = _held_keys() if any(p.liveness_key is not None for p in found) else set()
    return {
        p.name: canonical.loads(p.capabilities)
        for p in found
        if p.liveness_key is None or p.liveness_key in held
    }


def _held_keys() -> set[int]:
    return store().held_worker_keys(_LOCK_NAMESPACE)


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
        lifecycle.park(run_id, WaitReason.VERSION, why, later)
