"""Settings come from the environment: what a deployment gets from the variables it sets,
and a clear refusal for what it must not run with."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests.procs import ROOT

PROBE = (
    "import os, django; os.environ['DJANGO_SETTINGS_MODULE'] = 'config.settings';"
    "django.setup(); from django.conf import settings as s;"
    "from durability.conf import conf;"
    "import pathlib; key = pathlib.Path(os.environ['DURABILITY_VAR_DIR'], 'secret-key');"
    "print(repr((s.DATABASES['default']['ENGINE'],"
    " key.exists() and s.SECRET_KEY == key.read_text().strip() and len(s.SECRET_KEY) >= 50,"
    " getattr(s, 'SECURE_PROXY_SSL_HEADER', None), s.SESSION_COOKIE_SECURE,"
    " s.CSRF_COOKIE_SECURE, s.SECURE_HSTS_SECONDS, conf.HEARTBEAT_SECONDS)))"
)


def settings_with(tmp_path, probe: str = PROBE, **env: str) -> subprocess.CompletedProcess:
    """config.settings loaded in a process that has only ``env`` (and PATH) set; ``probe``
    prints what the test reads."""
    return subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], "DURABILITY_VAR_DIR": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def env_example() -> dict[str, str]:
    pairs = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            pairs[name.strip()] = value.strip()
    return pairs


def test_env_example_as_is_is_the_embedded_default(tmp_path):
    env = env_example()
    env["DURABILITY_VAR_DIR"] = str(tmp_path)  # not ./var of the checkout
    done = settings_with(tmp_path, **env)
    assert done.returncode == 0, done.stderr
    figures = ast.literal_eval(done.stdout)
    engine, generated_key, proxy, session_secure, csrf_secure, hsts, heartbeat = figures
    # No key set: the embedded default signs with a random key of its own, kept in var/.
    assert engine.endswith("sqlite3") and generated_key
    assert (proxy, session_secure, csrf_secure, hsts) == (None, False, False, 0)
    assert heartbeat == 10.0  # a third of the 30 s lease, not a value of its own


def test_a_server_database_without_secret_key_refuses_to_start(tmp_path):
    url = "postgres://postgres@127.0.0.1:5432/durability_nowhere"
    done = settings_with(tmp_path, DATABASE_URL=url)
    assert done.returncode != 0
    assert "SECRET_KEY is required with a server database" in done.stderr
    # DEBUG is a developer's machine: the embedded key is allowed there.
    assert settings_with(tmp_path, DATABASE_URL=url, DEBUG="1").returncode == 0
    done = settings_with(tmp_path, DATABASE_URL=url, SECRET_KEY="k" * 50)
    assert done.returncode == 0, done.stderr
    assert ast.literal_eval(done.stdout)[1] is False


def test_server_sessions_notice_a_silent_server(tmp_path):
    """TCP keepalives and timeouts on every PostgreSQL session; the URL's own values win."""
    probe = (
        "import os, django; os.environ['DJANGO_SETTINGS_MODULE'] = 'config.settings';"
        "django.setup(); from django.conf import settings as s;"
        "print(repr(s.DATABASES['default']['OPTIONS']))"
    )

    def options(url: str) -> dict:
        done = settings_with(tmp_path, probe, DATABASE_URL=url, SECRET_KEY="k" * 50)
        assert done.returncode == 0, done.stderr
        return ast.literal_eval(done.stdout)

    base = "postgres://postgres@127.0.0.1:5432/durability_nowhere"
    got = options(base)
    assert got["keepalives"] == 1 and got["keepalives_idle"] == 30
    assert got["tcp_user_timeout"] == 60_000 and got["connect_timeout"] == 10
    got = options(base + "?keepalives_idle=5&sslmode=disable")
    assert got["keepalives_idle"] == 5 and got["sslmode"] == "disable"
    assert got["keepalives_count"] == 3


@pytest.mark.django_db
def test_the_sessions_of_this_process_and_its_commit_channel_have_them():
    from django.db import connection

    from durability.runtime import inflight

    if connection.vendor != "postgresql":
        pytest.skip("TCP options are PostgreSQL's")
    connection.ensure_connection()
    ch = inflight.channel()
    ch._pgconn()  # opens the session commits are sent ahead on
    for session in (connection.connection, ch.connection.connection):
        params = session.info.get_parameters()  # what libpq opened the session with
        assert params["keepalives"] == "1" and params["keepalives_idle"] == "30"
        assert params["tcp_user_timeout"] == "60000" and params["connect_timeout"] == "10"


def test_behind_a_tls_proxy(tmp_path):
    done = settings_with(
        tmp_path,
        SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto",
        SECURE_COOKIES="true",
        SECURE_HSTS_SECONDS="31536000",
        DURABILITY_LEASE_SECONDS="12",
    )
    assert done.returncode == 0, done.stderr
    _, _, proxy, session_secure, csrf_secure, hsts, heartbeat = ast.literal_eval(done.stdout)
    assert proxy == ("HTTP_X_FORWARDED_PROTO", "https")
    assert session_secure and csrf_secure and hsts == 31536000
    assert heartbeat == 4.0


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("DURABILITY_SECRET_KEY_PATTERN", "([", "is not a valid regular expression"),
        ("DURABILITY_MAX_INPUT_BYTES", "-1", "is not a whole number of at least 1"),
        ("DURABILITY_SWEEP_SECONDS", "0", "is not a number over 0"),
        ("DURABILITY_SLO_COMMIT_SUCCESS", "5", "is not a share over 0 and at most 1"),
    ],
)
def test_a_value_that_would_fail_later_is_refused_at_start(tmp_path, name, value, message):
    done = settings_with(tmp_path, **{name: value})
    assert done.returncode != 0
    assert f"{name}={value!r} {message}" in done.stderr


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("SECURE_COOKIES", "maybe", "SECURE_COOKIES='maybe' is not a boolean"),
        ("SECURE_HSTS_SECONDS", "a year", "SECURE_HSTS_SECONDS='a year' is not a whole number"),
        # The engine's, the dashboard's and the API's, parsed from their declarations.
        ("DURABILITY_LEASE_SECONDS", "soon", "DURABILITY_LEASE_SECONDS='soon' is not a number"),
        ("DURABILITY_SEND_AHEAD", "maybe", "DURABILITY_SEND_AHEAD='maybe' is not a boolean"),
        (
            "DURABILITY_NOTIFY_WEBHOOK_FORMAT",
            "xml",
            "DURABILITY_NOTIFY_WEBHOOK_FORMAT='xml' is not one of json, slack",
        ),
        (
            "DURABILITY_API_RATE_LIMIT",
            "fast",
            "DURABILITY_API_RATE_LIMIT='fast' is not <requests>/<seconds>",
        ),
        (
            "DURABILITY_RATE_LIMITS",
            "openai=60/min,search=0/s",
            "DURABILITY_RATE_LIMITS='openai=60/min,search=0/s' is not a list of"
            " NAME=AMOUNT/PERIOD (AMOUNT over 0; PERIOD: s, min or hour)",
        ),
        ("LOG_LEVEL", "verbose", "LOG_LEVEL='verbose' is not one of DEBUG, INFO, WARNING"),
        ("DATABASE_URL", "db.sqlite3", "DATABASE_URL='db.sqlite3' is not a database the"),
        # A driver the product does not use is not loaded, and the password is not shown.
        ("DATABASE_URL", "mysql://me:hunter2@db/x", "DATABASE_URL='mysql://…@db/x' is not"),
        ("CELERY_BROKER_URL", "localhost:6379", "CELERY_BROKER_URL='localhost:6379' is not a"),
    ],
)
def test_a_bad_value_is_a_clear_error(tmp_path, name, value, message):
    done = settings_with(tmp_path, **{name: value})
    assert done.returncode != 0
    assert message in done.stderr
    assert "hunter2" not in done.stderr


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_snapshot_cap_below_one_is_refused_by_name(tmp_path, value):
    done = settings_with(tmp_path, DURABILITY_SNAPSHOT_MAX_DELTAS=value)
    assert done.returncode != 0
    assert f"DURABILITY_SNAPSHOT_MAX_DELTAS={value}" in done.stderr.replace("'", "")


def _started(tmp_path, argv: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], "DURABILITY_VAR_DIR": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


# Telemetry on: its Django instrumentation, finding the settings unloadable, would configure
# empty ones in their place and hide why (config/settings_check.py).
TRACED = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "SECRET_KEY": ""}
SERVER_DB = {"DATABASE_URL": "postgres://postgres@127.0.0.1:5432/nowhere"}


def test_a_command_started_with_a_bad_environment_says_why_in_one_line(tmp_path):
    done = _started(tmp_path, ["manage.py", "durability", "list"], **TRACED, **SERVER_DB)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: SECRET_KEY is required with a server database")
    assert "Traceback" not in done.stderr
    bad = _started(tmp_path, ["manage.py", "migrate"], DURABILITY_LEASE_SECONDS="abc")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: DURABILITY_LEASE_SECONDS='abc' is not a number over 0"


def test_the_web_process_refuses_to_load_with_a_bad_environment_rather_than_serve_errors(
    tmp_path,
):
    probe = "import config.wsgi"
    done = _started(tmp_path, ["-c", probe], **TRACED, **SERVER_DB)
    assert done.returncode != 0
    assert "ImproperlyConfigured: SECRET_KEY is required with a server database" in done.stderr
    assert "ROOT_URLCONF" not in done.stderr


@pytest.mark.parametrize(
    "env",
    [
        {"DURABILITY_LEASE_SECONDS": "6", "DURABILITY_HEARTBEAT_SECONDS": "20"},
        {"DURABILITY_LEASE_SECONDS": "6", "DURABILITY_HEARTBEAT_SECONDS": "6"},
        {"DURABILITY_HEARTBEAT_SECONDS": "-1"},
    ],
)
def test_a_heartbeat_no_sooner_than_the_lease_expires_is_refused(tmp_path, env):
    done = settings_with(tmp_path, **env)
    assert done.returncode != 0
    assert "must be positive and shorter than DURABILITY_LEASE_SECONDS" in done.stderr


def test_a_worker_started_with_a_bad_telemetry_variable_stops_saying_which(tmp_path):
    """Its pool processes would meet it in a signal handler and leave the worker hanging."""
    done = _started(
        tmp_path,
        ["-m", "celery", "-A", "config", "worker", "-Q", "none", "-c", "1"],
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/json",
        SECRET_KEY="x",
        CELERY_BROKER_URL="memory://",
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: OTEL_EXPORTER_OTLP_PROTOCOL='http/json'")


def test_a_blob_storage_that_names_no_storage_is_refused_at_start(tmp_path):
    done = _started(tmp_path, ["manage.py", "durability", "list"], DURABILITY_BLOB_STORAGE="s3")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "error: DURABILITY_BLOB_STORAGE='s3' names no storage in STORAGES (there: default,"
        " staticfiles): add it to STORAGES, or leave the variable empty to keep blobs in"
        " DURABILITY_BLOB_DIR"
    )


def test_a_command_on_a_database_never_migrated_says_to_migrate(tmp_path):
    """The embedded default's database before ``migrate`` (a fresh var dir): one line that
    says what to do, the database's exit code, no traceback."""
    done = _started(tmp_path, ["manage.py", "durability", "list"])
    assert done.returncode == 6, done.stderr
    assert "no such table: durability_run: this database has no tables of the product's;" in (
        done.stderr
    )
    assert "python manage.py migrate" in done.stderr and "Traceback" not in done.stderr
