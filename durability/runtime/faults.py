"""Named fault points at the engine's commit boundaries, for deterministic crash tests.

Off unless ``DURABILITY_FAULTS`` is set in the environment to a JSON list such as::

    [{"point": "after_call", "when": {"key": "llm", "seq": 37}, "action": "kill"}]

or to ``@/path/to/faults.json``, read again whenever the file changes (tests rewrite it
while workers keep running). Actions: ``kill`` (SIGKILL this process), ``kill-worker``
(SIGKILL this process and its parent, i.e. a whole prefork worker), ``crash`` (raise
``SimulatedCrash``, a ``BaseException`` that unwinds like a dying process, for in-process
tests), ``raise`` (``FaultInjected``), ``exit`` (exit status 3) and ``hang`` (block until
killed). A fault fires once: a marker file in ``DURABILITY_FAULT_DIR`` (default: the system
temp dir) records that it fired, so the restarted worker passes the same point safely;
``"repeat": true`` makes it fire every time.

Every point also knows whether a checkpoint commit sent ahead is in flight at that moment
(``in_flight``: its statement on the wire, its answer not taken): ``when`` may ask for it,
and the marker records it with the rest of the point's context, so a test can show that its
crash happened with a commit in flight. The points fire where the production path reaches
them, with commits sent ahead: "after the commit" is once its answer is in.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import tempfile
import time
from functools import lru_cache
from typing import Any

POINTS = (
    "claimed",  # a run was claimed, before rehydrating
    "before_step",
    "before_call",  # inside ctx.call, before the function runs
    "after_call",  # the function returned; its result is not recorded yet
    "after_intent",  # an effect's intent is committed; the effect has not run
    "after_effect",  # the effect ran; its outcome is not recorded yet
    "after_spawn",  # a child run was created; the parent's step has not checkpointed
    # inside the checkpoint transaction, before COMMIT; sent ahead: made, not sent (with
    # its parent's commit in flight if the step only computed)
    "in_commit",
    "after_commit",  # the checkpoint's answer is in (committed); the worker has not moved on
    "in_snapshot",  # writing a snapshot, after its checkpoint committed
    "suspended",  # the run was suspended (waiting for approval, a timer...)
    "before_ack",  # the task is done; Celery has not acknowledged the message
    "sweep",  # inside the sweeper, after it chose what to recover
)


class FaultInjected(RuntimeError):
    pass


class SimulatedCrash(BaseException):  # noqa: N818 - stands for a process dying
    """Nothing in the engine catches it: the execution stops where it is, as if killed."""


@lru_cache(maxsize=8)
def _parse(raw: str) -> tuple[dict[str, Any], ...]:
    specs = json.loads(raw)
    if isinstance(specs, dict):
        specs = [specs]
    for spec in specs:
        if spec.get("point") not in POINTS:
            raise ValueError(f"DURABILITY_FAULTS: unknown point {spec.get('point')!r}")
    return tuple(specs)


_file_cache: dict[str, tuple[tuple[int, int, int], str]] = {}


def _spec_text(raw: str) -> str:
    if not raw.startswith("@"):
        return raw
    path = raw[1:]
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ""
    # Not the modification time alone: two specs written within one tick of the kernel's
    # coarse clock share it, and a worker kept the older one (a fault that never fired).
    # A spec is replaced by a rename, so its inode changes every time.
    version = (st.st_mtime_ns, st.st_ino, st.st_size)
    cached = _file_cache.get(path)
    if cached is None or cached[0] != version:
        with open(path) as f:
            cached = (version, f.read().strip())
        _file_cache[path] = cached
    return cached[1]


def faults_armed() -> bool:
    return bool(os.environ.get("DURABILITY_FAULTS"))


def fault(point: str, **context: Any) -> None:
    raw = os.environ.get("DURABILITY_FAULTS")
    if not raw:
        return
    text = _spec_text(raw)
    if not text:
        return
    for spec in _parse(text):
        if spec["point"] != point:
            continue
        if "in_flight" not in context:
            context["in_flight"] = _commit_in_flight()
        when = spec.get("when") or {}
        if any(str(context.get(k)) != str(v) for k, v in when.items()):
            continue
        if not _first_time(spec, context):
            continue
        _act(spec.get("action", "kill"))


def _commit_in_flight() -> bool:
    """Whether this thread has a commit sent ahead whose answer is not taken."""
    from durability.runtime import inflight

    return inflight.channel().busy


def _first_time(spec: dict[str, Any], context: dict[str, Any]) -> bool:
    if spec.get("repeat"):
        return True
    folder = os.environ.get("DURABILITY_FAULT_DIR") or tempfile.gettempdir()
    name = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    try:
        fd = os.open(os.path.join(folder, f"fault-{name}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    record = {"point": spec["point"], "pid": os.getpid(), **{k: str(v) for k, v in context.items()}}
    record["in_flight"] = bool(context.get("in_flight"))
    os.write(fd, json.dumps(record).encode())
    os.fsync(fd)
    os.close(fd)
    return True


def _act(action: str) -> None:
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "kill-worker":
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "exit":
        os._exit(3)
    elif action == "hang":
        while True:
            time.sleep(3600)
    elif action == "raise":
        raise FaultInjected("fault injected")
    elif action == "crash":
        raise SimulatedCrash("simulated crash")
    else:
        raise ValueError(f"DURABILITY_FAULTS: unknown action {action!r}")
