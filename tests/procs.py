"""Real processes for the tests: Celery workers and beat, and throwaway PostgreSQL and Redis
servers for the tests that stop them. Each process gets its own process group, killed in a
finalizer even when the test fails."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("DURABILITY_TEST_ARTIFACTS", ROOT / "test-artifacts"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return sorted(found)


class Proc:
    """A subprocess in its own process group, logging to a file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.log_path = ARTIFACTS / f"{name}.log"
        self.popen: subprocess.Popen | None = None
        self.mark = 0

    def start(self) -> Proc:
        self.mark = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.log = open(self.log_path, "a")  # noqa: SIM115 - closed in stop()
        self.log.write(f"\n===== start {' '.join(self.argv)}\n")
        self.log.flush()
        self.popen = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, needle: str, timeout: float = 60.0, since: int | None = None) -> None:
        since = self.mark if since is None else since
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            if needle in self.text()[since:]:
                return
            if not self.alive():
                raise AssertionError(f"{self.name} exited early:\n{self.text()[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(
            f"{self.name}: no {needle!r} after {timeout} s:\n{self.text()[-3000:]}"
        )

    def kill(self) -> None:
        """SIGKILL the whole process group at once."""
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)

    def terminate(self, timeout: float = 30.0) -> int | None:
        if self.popen is None:
            return None
        try:
            os.kill(self.popen.pid, signal.SIGTERM)
            return self.popen.wait(timeout=timeout)
        except ProcessLookupError:
            return self.popen.poll()
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def stop(self) -> None:
        if self.alive():
            self.terminate(timeout=15)
        self.kill()
        if hasattr(self, "log"):
            self.log.close()


def worker_argv(
    name: str, queues: list[str], concurrency: int = 1, pool: str = "prefork"
) -> list[str]:
    """A Celery worker of this project (prefork unless told otherwise), quiet on the broker
    (no mingle, gossip or heartbeat events), named ``name@host``: for the tests and the
    benchmarks."""
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "config",
        "worker",
        "--pool",
        pool,
        "--concurrency",
        str(concurrency),
        "--without-mingle",
        "--without-gossip",
        "--without-heartbeat",
        "--queues",
        ",".join(queues),
        "--hostname",
        f"{name}@%h",
        "--loglevel",
        "INFO",
    ]


class CeleryWorker(Proc):
    """A run worker, on the runs' queue (``CELERY_QUEUE``) unless ``queues`` says otherwise
    (the housekeeping worker: ``[housekeeping_queue(env)]``)."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        concurrency: int = 1,
        pool: str = "prefork",
        queues: list[str] | None = None,
    ) -> None:
        argv = worker_argv(name, queues or [env["CELERY_QUEUE"]], concurrency, pool)
        super().__init__(name, argv, env)

    # Started and not waited for yet (``start(wait=False)``).
    booting = False

    def start(self, wait: bool = True) -> CeleryWorker:
        """Start the worker and, unless told not to (workers started together, each
        waited for after), wait until it consumes."""
        super().start()
        self.booting = True
        if wait:
            self.ready()
        return self

    def ready(self) -> CeleryWorker:
        self.wait_for_log(" ready.")
        self.booting = False
        return self

    def children(self) -> list[int]:
        return _children(self.pid)

    def kill_child(self) -> int:
        kids = self.children()
        assert kids, f"{self.name} has no pool process"
        os.kill(kids[0], signal.SIGKILL)
        return kids[0]

    def restart(self) -> CeleryWorker:
        self.stop()
        return self.start()


def housekeeping_queue(env: dict[str, str]) -> str:
    """Where beat sends sweeps (``DURABILITY_HOUSEKEEPING_QUEUE`` in config/settings.py)."""
    return f"{env.get('CELERY_QUEUE') or 'durability'}.housekeeping"


def beat_argv(schedule: Path, max_interval: float | None = None) -> list[str]:
    """Celery beat of this project, its schedule file at ``schedule``: for the tests and
    the benchmarks."""
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "config",
        "beat",
        "--loglevel",
        "INFO",
        "--schedule",
        str(schedule),
    ]
    if max_interval is not None:
        argv += ["--max-interval", f"{max_interval:g}"]
    return argv


class Beat(Proc):
    def __init__(self, name: str, env: dict[str, str], folder: Path) -> None:
        super().__init__(name, beat_argv(folder / f"{name}-schedule", max_interval=1), env)

    def start(self, wait: bool = True) -> Beat:
        super().start()
        if wait:
            self.ready()
        return self

    def ready(self) -> Beat:
        self.wait_for_log("beat: Starting")
        return self


# --- throwaway servers ---------------------------------------------------------------------


def _pg_bin(name: str) -> str:
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
    for folder in reversed(versions):
        if (folder / name).exists():
            return str(folder / name)
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found")
    return found


class ThrowawayPostgres:
    """A PostgreSQL cluster in a temporary folder on a free port, run as the postgres user
    (initdb refuses root). Never the machine's own server."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="durability-pg-"))
        self.port = free_port()
        self.data = self.folder / "data"
        self.socket_dir = self.folder / "sock"

    def _as_postgres(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run([*prefix, *argv], check=check, capture_output=True, text=True)

    def init(self) -> ThrowawayPostgres:
        self.socket_dir.mkdir(parents=True)
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
            shutil.chown(self.socket_dir, "postgres", "postgres")
        self._as_postgres(
            _pg_bin("initdb"), "--no-sync", "-A", "trust", "-U", "postgres", "-D", str(self.data)
        )
        return self

    def start(self) -> None:
        opts = (
            f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1"
            " -c fsync=off -c max_connections=100"
        )
        self._as_postgres(
            _pg_bin("pg_ctl"),
            "-D",
            str(self.data),
            "-o",
            opts,
            "-w",
            "-l",
            str(self.folder / "log"),
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        self._as_postgres(
            _pg_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop", check=False
        )

    def url(self, dbname: str = "postgres") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{dbname}"

    def psql(self, sql: str) -> None:
        subprocess.run(["psql", self.url(), "-qc", sql], check=True, capture_output=True)

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.folder, ignore_errors=True)


class ThrowawayRedis(Proc):
    def __init__(self) -> None:
        self.port = free_port()
        super().__init__(
            f"redis-{self.port}",
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            dict(os.environ),
        )

    def start(self) -> ThrowawayRedis:
        super().start()
        self.wait_for_log("Ready to accept connections")
        return self

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"
