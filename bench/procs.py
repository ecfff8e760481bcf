"""Subprocesses of the benchmark: Celery workers, beat, CPU burners, cold probes.

Each runs in its own process group and is registered, so ``stop_all()`` (called in the entry
point's ``finally``, and on SIGTERM/SIGINT) kills every one of them, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.procs import _children, beat_argv, worker_argv

ROOT = Path(__file__).resolve().parent.parent

_running: list[Proc] = []


def children(pid: int) -> list[int]:
    """Live (non-zombie) child processes of ``pid``, from /proc."""
    return _children(pid)


class Proc:
    """A subprocess in its own process group (so killing it kills what it started), its
    output in a log file under the benchmark's folder."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], folder: Path) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = folder / f"{name}.log"
        self.popen: subprocess.Popen[bytes] | None = None
        self._log = None

    def start(self) -> Proc:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _running.append(self)
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_log(self, needle: str, timeout: float = 90.0) -> None:
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            if needle in self.text():
                return
            if not self.alive():
                raise RuntimeError(f"{self.name} exited early:\n{self.text()[-3000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"{self.name}: no {needle!r} after {timeout} s:\n{self.text()[-3000:]}")

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the group, then SIGKILL it: workers get to release their leases."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=grace)
        # The group, not only the leader: pool children and anything they started.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=30)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self in _running:
            _running.remove(self)


def stop_all() -> None:
    for proc in reversed(list(_running)):
        with contextlib.suppress(Exception):
            proc.stop(grace=5.0)


class Worker(Proc):
    """A Celery worker as the product runs it (prefork), minus mingle/gossip/heartbeat,
    which only add start-up time and broker chatter to a single-node benchmark."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        folder: Path,
        *,
        queues: list[str],
        concurrency: int = 1,
        include: str = "",
    ) -> None:
        argv = worker_argv(name, queues, concurrency)
        if include:
            argv += ["--include", include]
        super().__init__(name, argv, env, folder)
        self.concurrency = concurrency

    def start(self) -> Worker:
        super().start()
        self.wait_for_log(" ready.")
        return self

    def pool(self) -> list[int]:
        return children(self.pid)


class Beat(Proc):
    def __init__(self, name: str, env: dict[str, str], folder: Path) -> None:
        # Beat's default --max-interval: the benchmarks keep the product's settings.
        super().__init__(name, beat_argv(folder / f"{name}-schedule"), env, folder)

    def start(self) -> Beat:
        super().start()
        self.wait_for_log("beat: Starting")
        return self


BURN = "while True:\n    pass\n"


def burners(count: int, env: dict[str, str], folder: Path) -> list[Proc]:
    """``count`` processes spinning on the CPU, to oversubscribe it."""
    return [
        Proc(f"burner-{i}", [sys.executable, "-c", BURN], env, folder).start() for i in range(count)
    ]
