"""A Celery no-op task: the baseline for steps per second through Celery.

Workers load it with ``--include bench.tasks``. Only the first and the last task of a batch
write anything (their wall-clock time, to Redis), so the batch's rate is Celery's own cost
per task: delivery, prefork hand-off, acknowledgement (``acks_late`` as for engine tasks).
"""

from __future__ import annotations

import time

import redis
from celery import shared_task
from django.conf import settings

_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    return _client


@shared_task(name="bench.noop", ignore_result=True)
def noop(i: int, last: int, key: str) -> None:
    if i == 0 or i == last:
        _redis().set(f"{key}:{i}", repr(time.time()), ex=3600)
