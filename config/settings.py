"""Django settings, all from environment variables (see .env.example).

With nothing set, this is the embedded default: SQLite and Celery's filesystem broker
under ./var/, the demo agents loaded.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from api.conf import Api
from config.env import (
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_list,
    env_str,
    generated_secret,
    private_dir,
)
from dashboard.conf import Dashboard
from durability.conf import Engine

BASE_DIR = Path(__file__).resolve().parent.parent

# The DURABILITY_ settings are declared, with their types and defaults, where they are read:
# durability/conf.py (the engine), dashboard/conf.py and api/conf.py. Here: their plain
# defaults (a set setting reads faster than a missing one), then what the environment sets.
_environment: dict = {}
for _group in (Engine, Dashboard, Api):
    globals().update(_group.defaults())
    _environment.update(_group.from_environment())
globals().update(_environment)
# The embedded default's files live in the checkout's var/, wherever a process starts.
DURABILITY_VAR_DIR = _environment.get("DURABILITY_VAR_DIR", str(BASE_DIR / "var"))
VAR_DIR = Path(DURABILITY_VAR_DIR)

DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost"])
# The dashboard's public origin(s) behind a proxy, e.g. https://durability.example.com:
# without it, Django refuses every form posted through that origin.
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])
# Behind a proxy that terminates TLS: the header it sets (X-Forwarded-Proto) to "https".
# Only when the proxy always sets it: a client could otherwise claim HTTPS itself.
_PROXY_SSL_HEADER = env_str("SECURE_PROXY_SSL_HEADER", "")
if _PROXY_SSL_HEADER:
    SECURE_PROXY_SSL_HEADER = (
        "HTTP_" + _PROXY_SSL_HEADER.strip().upper().replace("-", "_"),
        "https",
    )
# Served over HTTPS: cookies only over TLS, and HSTS for this many seconds (0: off).
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = env_bool("SECURE_COOKIES", False)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_htmx",
    "axes",
    "durability",
    "durability.langgraph",
    "workers",
    "dashboard",
    "examples",
    # The JSON API; with ninja installed as an app its docs page uses the package's own
    # static Swagger UI files, not a CDN.
    "ninja",
    "api",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # The API's 404 and 405 answered as its other refusals are (problem+json).
    "api.middleware.problem_replies",
    # Last, as its documentation asks: it turns a locked-out sign-in into its answer.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


PG_TCP_DEFAULTS = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60_000,  # milliseconds
}


def _shown(url: str) -> str:
    """``url`` as an error may quote it: without the credentials before its host."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}…@{rest.rpartition('@')[2]}" if "@" in rest else url


def _database() -> dict:
    url = env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'db.sqlite3'}")
    try:
        db = dj_database_url.parse(url, conn_max_age=env_int("CONN_MAX_AGE", 60))
    except ValueError:
        db = {"ENGINE": ""}
    if db["ENGINE"] not in ("django.db.backends.postgresql", "django.db.backends.sqlite3"):
        # Said before Django tries to load a driver the product does not use.
        raise ImproperlyConfigured(
            f"DATABASE_URL={_shown(url)!r} is not a database the product runs on: use"
            " postgres://USER:PASSWORD@HOST:5432/NAME (PostgreSQL) or sqlite:///PATH"
        )
    db["CONN_HEALTH_CHECKS"] = True
    if db["ENGINE"] == "django.db.backends.sqlite3":
        # Web, worker and beat share one file: WAL lets readers run beside the writer,
        # IMMEDIATE takes the write lock up front (no deadlock on upgrade), and the busy
        # timeout makes a writer wait instead of failing with "database is locked".
        # The folder of the database (the var dir) is this user's only; the files themselves
        # are made 0600 as each connection opens (config.env.private_sqlite_files).
        name = str(db["NAME"])
        if name and name != ":memory:" and not name.startswith("file:"):
            folder = Path(name).parent
            private_dir(folder, tighten=folder.resolve() == VAR_DIR.resolve())
        db["CONN_MAX_AGE"] = 0
        # synchronous=FULL: each commit is on disk before it returns, as PostgreSQL's
        # synchronous_commit=on; relaxed checkpoints alone commit under NORMAL (see
        # durability.checkpoints.sqlite_synchronous), so the levels promise the same here.
        db["OPTIONS"] = {
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;"
            " PRAGMA foreign_keys=ON;",
        }
    if db["ENGINE"] == "django.db.backends.postgresql":
        # A server that vanishes without a reset (a partition, a host powered off) must not
        # hold a worker until the kernel gives up on the socket, about 15 minutes: keepalives
        # find a silent peer of a session waiting for an answer, tcp_user_timeout one that
        # never acknowledges what was sent, connect_timeout one that never answers a
        # connection. Then the lease, the fencing and the sweeper take over as for a crash.
        # Values given in DATABASE_URL's query win.
        options = db.setdefault("OPTIONS", {})
        for name, value in PG_TCP_DEFAULTS.items():
            options.setdefault(name, value)
    db.setdefault("TEST", {})
    if env_str("DATABASE_TEST_NAME", ""):
        db["TEST"]["NAME"] = env_str("DATABASE_TEST_NAME")
    return db


DATABASES = {"default": _database()}

# The embedded default (SQLite) must start with nothing configured: it makes a random key on
# first start, kept in the var dir (0600) so sessions survive a restart and web, worker and
# beat agree. A server database means a deployment, where the key is configuration (every
# web process must share it): refuse to start without one.
SECRET_KEY = env_str("SECRET_KEY", "")
if not SECRET_KEY:
    if not DATABASES["default"]["ENGINE"].endswith("sqlite3") and not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY is required with a server database: set it to a long random value,"
            " e.g. $(openssl rand -hex 32)"
        )
    SECRET_KEY = generated_secret(private_dir(VAR_DIR) / "secret-key")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Every password the product sets (ensure_admin, createsuperuser, changepassword, the admin)
# passes Django's standard validators.
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {
        "NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
        "OPTIONS": {"min_length": env_int("PASSWORD_MIN_LENGTH", 10)},
    },
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

# Sign-in throttling (django-axes): after AXES_FAILURE_LIMIT failed attempts for one username
# from one address, that pair is locked out for AXES_COOLOFF_MINUTES (the sign-in page says
# so). A success resets the count. Behind a proxy, set CLIENT_IP_HEADER to the header it
# appends the client's address to (X-Forwarded-For), or every client shares the proxy's.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = timedelta(minutes=env_float("AXES_COOLOFF_MINUTES", 15.0))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "dashboard.lockout.locked_out"
AXES_VERBOSE = False
CLIENT_IP_HEADER = env_str("CLIENT_IP_HEADER", "")
AXES_CLIENT_IP_CALLABLE = "dashboard.lockout.client_ip"
AXES_USERNAME_CALLABLE = "dashboard.lockout.username_of"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"

# Python's level names (WARN and FATAL are its own aliases of WARNING and CRITICAL).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    # Celery's three lines per sweep (every two seconds) stay out of the console.
    "filters": {"quiet_housekeeping": {"()": "config.logs.QuietHousekeeping"}},
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "filters": ["quiet_housekeeping"],
        }
    },
    "root": {"handlers": ["console"], "level": env_choice("LOG_LEVEL", "INFO", LOG_LEVELS)},
}

# --- Celery (the doorbell; PostgreSQL stays the truth) -------------------------------------


def _broker(url: str) -> str:
    """``url`` if Celery has a transport for its scheme: said at start, not by the first
    doorbell."""
    from kombu.transport import TRANSPORT_ALIASES

    scheme = url.partition("://")[0]
    if "://" not in url or scheme not in TRANSPORT_ALIASES:
        raise ImproperlyConfigured(
            f"CELERY_BROKER_URL={_shown(url)!r} is not a broker URL: use"
            " redis://HOST:6379/0 (rediss:// with TLS), or filesystem:// for the embedded"
            " default"
        )
    return url


CELERY_BROKER_URL = _broker(env_str("CELERY_BROKER_URL", "filesystem://"))
if CELERY_BROKER_URL.startswith("filesystem://"):
    _broker_dir = private_dir(VAR_DIR) / "broker"
    for _sub in ("queue", "control"):
        (_broker_dir / _sub).mkdir(parents=True, exist_ok=True)
    # Kombu's filesystem transport, with message files written atomically (see there).
    CELERY_BROKER_TRANSPORT = "workers.fsbroker:Transport"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "queue"),
        "data_folder_out": str(_broker_dir / "queue"),
        "control_folder": str(_broker_dir / "control"),
        "store_processed": False,
        "polling_interval": env_float("CELERY_BROKER_POLLING_INTERVAL", 0.2),
    }
else:
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        # A whole-worker SIGKILL leaves its message unacked until this expires; the sweeper,
        # not this timeout, is what recovers such runs quickly.
        "visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 3600),
        "global_keyprefix": env_str("CELERY_KEY_PREFIX", ""),
        # A Redis that accepts connections and never answers must not hold a socket forever
        # (kombu and redis-py wait without limit by default). Longer than the consumer's
        # one-second blocking pop.
        "socket_connect_timeout": 5,
        "socket_timeout": 30,
        "socket_keepalive": True,
    }
# Publishing must not hang an operator's request when the broker is down: the sweeper rings
# again for any run whose doorbell was lost.
CELERY_TASK_PUBLISH_RETRY_POLICY = {
    "max_retries": 2,
    "interval_start": 0,
    "interval_step": 0.2,
    "interval_max": 0.5,
}
CELERY_TASK_DEFAULT_QUEUE = env_str("CELERY_QUEUE", "durability")
# Sweeps and the other housekeeping beat sends go to a queue of their own, which a small
# worker of its own consumes (Procfile, compose.yaml): on the runs' queue, recovery waited
# behind the longest step. Run workers consume it as well, so a deployment without that
# worker still sweeps (as before: only when a run worker has a free slot).
DURABILITY_HOUSEKEEPING_QUEUE = f"{CELERY_TASK_DEFAULT_QUEUE}.housekeeping"
CELERY_TASK_ROUTES = {
    task: {"queue": DURABILITY_HOUSEKEEPING_QUEUE}
    for task in ("durability.sweep", "durability.prune", "dashboard.notify")
}
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# A killed pool process's message stays unacked, holding one of the worker's prefetch slots,
# until Celery stops waiting for a result it might have sent (10 s by default): with the other
# processes busy, not even the sweep that would recover the run gets in. Tasks send no result
# and a second delivery of one is harmless, so a second is enough.
CELERY_WORKER_LOST_WAIT = env_float("CELERY_WORKER_LOST_WAIT", 1.0)
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
CELERY_BEAT_SCHEDULE = {
    "durability-sweep": {
        "task": "durability.sweep",
        "schedule": Engine.SWEEP_SECONDS.value_in(globals()),
        "options": {"expires": 30},
    },
    # Retention policies (per agent: keep_days, keep_checkpoints).
    "durability-prune": {
        "task": "durability.prune",
        "schedule": Engine.PRUNE_SECONDS.value_in(globals()),
        "options": {"expires": 600},
    },
}

# --- The engine -----------------------------------------------------------------------------
# Its settings (leases, limits, blobs, keys, metrics, SLO targets...) are declared in
# durability/conf.py and applied from the environment above; docs/configuration.md lists them.

# A lease renewed no sooner than it expires is lost at every beat: each run would be taken
# over, again and again, and never finish. Refused here, where every process (web, worker,
# beat) loads it; a heartbeat over half the lease is only warned about (durability.W001).
_lease = Engine.LEASE_SECONDS.value_in(globals())
_beat = Engine.HEARTBEAT_SECONDS.value_in(globals())
if _lease <= 0 or _beat <= 0 or _beat >= _lease:
    raise ImproperlyConfigured(
        f"DURABILITY_HEARTBEAT_SECONDS={_beat:g} must be positive and shorter than"
        f" DURABILITY_LEASE_SECONDS={_lease:g} (a third of it is the default): a lease renewed"
        " no sooner than it expires is lost at every beat"
    )

# Request bodies up to the largest state the engine accepts (a fork's edited state, sent to
# the API or the dashboard), with room for the other fields; Django's own 2.5 MB would refuse
# states the engine takes. Larger bodies: 413 from the API.
DATA_UPLOAD_MAX_MEMORY_SIZE = Engine.MAX_STATE_BYTES.value_in(globals()) + 1024 * 1024

# Earlier SECRET_KEYs Django (and argument hashes without DURABILITY_HMAC_KEY) still accept.
SECRET_KEY_FALLBACKS = env_list("SECRET_KEY_FALLBACKS", [])

# --- Dashboard ------------------------------------------------------------------------------
# Server-rendered pages (Django templates + htmx). Every page needs a login; viewers read,
# members of the "operators" group (and superusers) may act on runs.

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard:runs"
LOGOUT_REDIRECT_URL = "login"
MIDDLEWARE += ["django.middleware.csp.ContentSecurityPolicyMiddleware"]

# Content-Security-Policy (Django's built-in middleware): scripts and styles only from our own
# static files. No inline script, no 'unsafe-inline', no 'unsafe-eval': agent output that
# slipped through escaping still could not run.
from django.utils.csp import CSP  # noqa: E402

SECURE_CSP = {
    "default-src": [CSP.SELF],
    "script-src": [CSP.SELF],
    "style-src": [CSP.SELF],
    "img-src": [CSP.SELF],
    "font-src": [CSP.SELF],
    "connect-src": [CSP.SELF],
    "object-src": [CSP.NONE],
    "base-uri": [CSP.NONE],
    "form-action": [CSP.SELF],
    "frame-ancestors": [CSP.NONE],
}

# Notifications (dashboard/conf.py declares their settings): a webhook (JSON, or a
# Slack-compatible body) and/or email when an approval is requested or waits too long, a run
# fails, or an effect goes in doubt. Once per event, retried with backoff, each delivery
# recorded (dashboard.models.Notification).
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "durability@localhost")
# Django 6.1's MAILERS (the EMAIL_* settings are deprecated): SMTP from the environment.
MAILERS = {
    "default": {
        "BACKEND": env_str("EMAIL_BACKEND", "django.core.mail.backends.smtp.EmailBackend"),
        "OPTIONS": {
            "host": env_str("EMAIL_HOST", "localhost"),
            "port": env_int("EMAIL_PORT", 25),
            "username": env_str("EMAIL_HOST_USER", ""),
            "password": env_str("EMAIL_HOST_PASSWORD", ""),
            "use_tls": env_bool("EMAIL_USE_TLS", False),
            "timeout": env_int("EMAIL_TIMEOUT", 10),
        },
    }
}
if Dashboard.NOTIFY_WEBHOOK_URL.value_in(globals()) or Dashboard.NOTIFY_EMAIL_TO.value_in(
    globals()
):
    CELERY_BEAT_SCHEDULE["dashboard-notify"] = {
        "task": "dashboard.notify",
        "schedule": Dashboard.NOTIFY_SECONDS.value_in(globals()),
        "options": {"expires": 60},
    }
