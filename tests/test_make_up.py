"""``make up`` in a terminal: the sign-in details come after the processes' start-up logs,
and Ctrl-C stops everything with exit status 0 (not make's "Interrupt", status 130).

Real make, scripts/up, the real preparation (migrate, collectstatic, ensure_admin, seed_demo,
on the test database) and honcho, in a pseudo-terminal where Ctrl-C is a keypress; the four
processes are stand-ins that print what the real ones print when they have started, so the
test takes seconds (the real processes, and the demo's crash logged in one line, were
checked by hand)."""

from __future__ import annotations

import os
import pty
import select
import signal
import sys
import time

import pytest

from tests import conftest
from tests.procs import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

STAND_INS = {
    "web": "Listening at: http://127.0.0.1:0",
    "worker": "celery@test ready.",
    "housekeeping": "housekeeping@test ready.",
    "beat": "beat: Starting...",
}


def _procfile(folder) -> str:
    path = folder / "Procfile"
    lines = [
        f'{name}: {sys.executable} -c "import time; time.sleep(0.3 * {i}); '
        f"print('{said}', flush=True); time.sleep(600)\""
        for i, (name, said) in enumerate(STAND_INS.items())
    ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _read(fd: int, out: bytearray, until: float, wanted: bytes = b"") -> bool:
    while time.monotonic() < until:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the terminal closed: everything exited
            return False
        if not chunk:
            return False
        out.extend(chunk)
        if wanted and wanted in out:
            return True
    return False


def test_make_up_prints_the_sign_in_last_and_ctrl_c_exits_0(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    env.update(
        DATABASE_URL=conftest.test_database_url(),
        DURABILITY_VAR_DIR=str(tmp_path / "var"),
        DURABILITY_UP_PROCFILE=_procfile(tmp_path),
        DURABILITY_ADMIN_PASSWORD="a long passphrase for the test",
        DURABILITY_PORT="18999",
        PATH=f"{ROOT / '.venv' / 'bin'}:{env['PATH']}",
    )
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session of its own, the pseudo-terminal as its terminal
        os.chdir(ROOT)
        os.execvpe("make", ["make", "--no-print-directory", "-o", "install", "up"], env)
    out = bytearray()
    try:
        assert _read(fd, out, time.monotonic() + 120, b"Stop everything with Ctrl-C"), bytes(
            out
        ).decode(errors="replace")[-3000:]
        text = out.decode(errors="replace")
        sign_in = text.index("Sign in at http://127.0.0.1:18999/ as admin")
        for said in STAND_INS.values():
            assert -1 < text.index(said) < sign_in, f"{said!r} came after the sign-in"
        assert "Demo runs:" in text[sign_in:]
        os.write(fd, b"\x03")  # Ctrl-C, as typed
        stopped_at = time.monotonic()
        _read(fd, out, stopped_at + 30)
        _, status = os.waitpid(pid, 0)
        pid = 0
        took = time.monotonic() - stopped_at
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    text = out.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text[-3000:]
    assert "Stopped." in text and "Interrupt" not in text and "Error" not in text
    assert took < 15, f"stopping took {took:.1f} s"


def test_a_lost_pool_process_is_reported_once_without_a_traceback(caplog):
    """The pool reports a dead process in one line; Celery's second report of it, with a
    traceback of the pool's own code, is dropped. Other task errors are still logged."""
    import logging

    from billiard.exceptions import WorkerLostError

    import config.celery  # noqa: F401 (installs the filter, as every worker does)

    logger = logging.getLogger("celery.worker.request")
    caplog.set_level(logging.INFO)
    try:
        raise WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL) Job: 2.")
    except WorkerLostError as exc:
        logger.error("Task handler raised error: %r", exc, exc_info=True)
    try:
        raise ValueError("a real bug")
    except ValueError as exc:
        logger.error("Task handler raised error: %r", exc, exc_info=True)
    logged = [r.getMessage() for r in caplog.records if r.name == "celery.worker.request"]
    assert logged == ["Task handler raised error: ValueError('a real bug')"]
