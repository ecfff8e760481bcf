"""One cold measurement in a fresh process: ``python -m bench.probe OP ARG``.

"Cold" here means a new Python process with a new database session: no Python-level cache
and a backend whose catalog caches are empty. The connection is opened (and proved with
``SELECT 1``) before the clock starts, since a connection pool would have it open already.
The server's shared buffers and the OS page cache stay warm: emptying them would mean
restarting or reconfiguring a server other people use.

Prints one JSON line: the cold time, the median of a few warm repeats, and what was read.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

WARM_REPEATS = 5


def main(argv: list[str]) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()
    import orjson
    from django.db import connection

    # Imported before the clock starts, as a running process has them: the operations'
    # own imports are then lookups.
    import durability.checkpoints
    import durability.models  # noqa: F401

    op, arg = argv[0], argv[1]
    ops: dict[str, Callable[[str], dict[str, Any]]] = {
        "rebuild": _rebuild,
        "whole": _whole,
        "list": _listing,
    }
    fn = ops[op]
    connection.ensure_connection()
    with connection.cursor() as cur:
        cur.execute("SELECT 1")
    started = time.perf_counter()
    facts = fn(arg)
    cold = time.perf_counter() - started
    warm = []
    for _ in range(WARM_REPEATS):
        started = time.perf_counter()
        fn(arg)
        warm.append(time.perf_counter() - started)
    warm.sort()
    print(
        orjson.dumps({"op": op, "cold_s": cold, "warm_s": warm[len(warm) // 2], **facts}).decode()
    )


def _rebuild(arg: str) -> dict[str, Any]:
    from durability import checkpoints

    rebuilt = checkpoints.rebuild(int(arg))
    return {"bytes_read": rebuilt.bytes_read, "deltas": rebuilt.deltas}


def _whole(arg: str) -> dict[str, Any]:
    # The baseline: the same state stored whole in one row, fetched and parsed.
    import orjson
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT state FROM bench_whole WHERE id = %s", [int(arg)])
        text = cur.fetchone()[0]
    orjson.loads(text)
    return {"bytes_read": len(text)}


def _listing(arg: str) -> dict[str, Any]:
    # What a run's checkpoint page would ask: every checkpoint, no state.
    from durability.models import Checkpoint

    rows = list(
        Checkpoint.objects.filter(run_id=arg)
        .order_by("seq")
        .values(
            "id",
            "seq",
            "parent_id",
            "reason",
            "step",
            "next_step",
            "size",
            "delta_size",
            "state_hash",
            "created_by",
            "created_at",
        )
    )
    return {"rows": len(rows)}


if __name__ == "__main__":
    main(sys.argv[1:])
