"""Limits every worker respects: at most K executing runs per agent, and shared rate limits
for named resources (an LLM provider's requests per minute). A run over a limit waits in
the database with the reason shown, never in a sleeping worker.

Rate limits are declared in ``DURABILITY_RATE_LIMITS`` (``"openai=60/min,search=5/s"``)
and attached to calls by the agent: ``Agent(limits=Limits(calls={"llm": "openai"}))`` makes every
``ctx.call("llm", ...)`` take one request from the ``openai`` bucket before it runs
(replays take nothing).
"""

from __future__ import annotations

from datetime import timedelta
from functools import lru_cache
from uuid import UUID

from django.db import IntegrityError, transaction
from django.utils import timezone

from durability import lifecycle
from durability.conf import conf, rate_limits
from durability.errors import AgentDefinitionError
from durability.models import RateBucket, Run, RunStatus, WaitReason
from durability.store import store


@lru_cache(maxsize=8)
def _parse(spec: str) -> dict[str, tuple[float, float]]:
    """``"openai=60/min,search=5/s"`` -> {resource: (capacity, per second)}."""
    try:
        return rate_limits(spec)
    except ValueError as exc:
        raise AgentDefinitionError(f"DURABILITY_RATE_LIMITS: {exc}") from None


def configured() -> dict[str, tuple[float, float]]:
    return _parse(conf.RATE_LIMITS)


def take(resource: str, cost: float = 1.0) -> float:
    """Take ``cost`` from the resource's bucket: 0.0 when taken, else how many seconds until
    it could be (nothing is taken then)."""
    limits = configured()
    if resource not in limits:
        raise AgentDefinitionError(
            f"rate limit {resource!r} is not declared in DURABILITY_RATE_LIMITS"
        )
    capacity, per_second = limits[resource]
    if cost > capacity:
        raise AgentDefinitionError(f"a cost of {cost:g} never fits in {resource!r}")
    now = timezone.now()
    with transaction.atomic():
        bucket = RateBucket.objects.select_for_update().filter(pk=resource).first()
        if bucket is None:
            try:
                with transaction.atomic():
                    bucket = RateBucket.objects.create(
                        resource=resource,
                        capacity=capacity,
                        per_second=per_second,
                        tokens=capacity,
                        updated_at=now,
                    )
            except IntegrityError:
                bucket = RateBucket.objects.select_for_update().get(pk=resource)
        elapsed = max(0.0, (now - bucket.updated_at).total_seconds())
        available = min(capacity, bucket.tokens + elapsed * per_second)
        taken = available >= cost
        RateBucket.objects.filter(pk=resource).update(
            tokens=available - cost if taken else available,
            updated_at=now,
            capacity=capacity,
            per_second=per_second,
        )
    return 0.0 if taken else (cost - available) / per_second


def agent_slot_taken(agent: str, limit: int, run_id: UUID | str) -> str:
    """Inside the claim's transaction: "" when ``run_id`` may execute, else why not. The
    agent-wide lock makes concurrent claims count one after the other."""
    store().lock_agent_slots(agent)
    running = Run.objects.filter(agent=agent, status=RunStatus.RUNNING).exclude(pk=run_id).count()
    if running >= limit:
        return f"{running} of {limit} {agent} runs are executing"
    return ""


def park(run_id: object, why: str, seconds: float = 5.0) -> None:
    """Leave a run queued, saying why, until a slot frees (or ``seconds`` pass)."""
    later = timezone.now() + timedelta(seconds=seconds)
    lifecycle.park(run_id, WaitReason.CONCURRENCY, why, later)


def next_in_line(agent: str) -> object | None:
    """A slot freed: the oldest run of the agent waiting for one, made due now."""
    with transaction.atomic():
        run_id = (
            Run.objects.select_for_update(skip_locked=True)
            .filter(agent=agent, status=RunStatus.QUEUED, wait_reason=WaitReason.CONCURRENCY)
            .order_by("created_at")
            .values_list("id", flat=True)
            .first()
        )
        if run_id is None:
            return None
        now = timezone.now()
        Run.objects.filter(pk=run_id).update(wake_at=None, rung_at=now)
    return run_id
