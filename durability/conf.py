"""Every setting of the engine, declared once: its name, type, default and meaning.

Code reads a setting where it uses it, typed, through :data:`conf` (``conf.LEASE_SECONDS``):
the value in Django's settings at that moment (so ``override_settings`` and a changed setting
take effect), else the declared default. A default may follow another setting (the heartbeat
is a third of the lease; the blob and lock folders are in the var dir). A value of the wrong
type is refused with ``ImproperlyConfigured`` naming the setting.

The environment is read by the project's settings module (``config/settings.py``) through
:meth:`Declarations.from_environment`: it parses the variables declared here and returns only
those set, so no default is written twice. That module also applies the plain defaults
(:meth:`Declarations.defaults`), only because a setting that is set reads several times
faster than a missing one. docs/configuration.md lists every declaration with its default,
and a test keeps the two in step.

Who declares what. The engine declares what the engine reads, and what its Celery tasks and
beat are timed by, since those timings are part of the engine's recovery promise (sweep,
prune, ring timeout, shutdown grace). It owns the SLO targets too: ``durability.slo`` computes
against them. Settings only one other part reads are declared there, with the same
machinery, so each part can be read on its own: the dashboard's links and notifications in
``dashboard/conf.py``, the JSON API's rate limit in ``api/conf.py``. Settings that are not
the engine's (Django, Celery, email) stay in ``config/settings.py``, as does the housekeeping
queue's name, which config derives from ``CELERY_QUEUE``.

The var dir is a setting like the others (``DURABILITY_VAR_DIR``, ``./var`` of the working
directory by default): the engine learns where it is from Django's settings, never from
config. The project anchors it at its checkout.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Self, overload

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

PREFIX = "DURABILITY_"
_UNSET: Any = object()
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


# --- kinds: how one type is checked, parsed and shown -----------------------------------------


class Kind[T]:
    """One type of setting: ``accept`` checks a value from Django's settings, ``parse`` reads
    one from the environment; both answer None for a value they refuse. ``noun`` names what
    is expected in the error ("a number")."""

    noun = "a value"

    def accept(self, value: object) -> T | None:
        raise NotImplementedError

    def parse(self, text: str) -> T | None:
        raise NotImplementedError

    def show(self, value: T) -> str:
        """The default as docs/configuration.md shows it ("" for empty)."""
        return str(value)


class Text(Kind[str]):
    noun = "a string"

    def accept(self, value: object) -> str | None:
        return value if isinstance(value, str) else None

    def parse(self, text: str) -> str | None:
        return text


class Folder(Kind[str]):
    """A folder's path: a non-empty string or a ``pathlib.Path``."""

    noun = "a folder path"

    def accept(self, value: object) -> str | None:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        return value if isinstance(value, str) and value else None

    def parse(self, text: str) -> str | None:
        return text


class Choice(Kind[str]):
    def __init__(self, *options: str) -> None:
        self.options = options
        self.noun = "one of " + ", ".join(options)

    def accept(self, value: object) -> str | None:
        return value if isinstance(value, str) and value in self.options else None

    def parse(self, text: str) -> str | None:
        return self.accept(text.strip())


class Whole(Kind[int]):
    noun = "a whole number"

    def accept(self, value: object) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def parse(self, text: str) -> int | None:
        try:
            return int(text)
        except ValueError:
            return None


class Counted(Whole):
    """A whole number with a floor (a count that must be at least one, say)."""

    def __init__(self, minimum: int) -> None:
        self.minimum = minimum
        self.noun = f"a whole number of at least {minimum}"

    def accept(self, value: object) -> int | None:
        found = super().accept(value)
        return found if found is not None and found >= self.minimum else None

    def parse(self, text: str) -> int | None:
        found = super().parse(text)
        return found if found is not None and found >= self.minimum else None


class Number(Kind[float]):
    noun = "a number"

    def accept(self, value: object) -> float | None:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        return None

    def parse(self, text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None

    def show(self, value: float) -> str:
        return str(int(value)) if value.is_integer() else repr(value)


class Bounded(Number):
    """A number in ``(low, high]``: a period or a size that 0 or less makes meaningless
    (a sweep every 0 s, inputs of at most -1 bytes), a share that is at most 1."""

    def __init__(self, low: float, high: float | None = None, noun: str = "") -> None:
        self.low, self.high = low, high
        self.noun = noun or f"a number over {low:g}"

    def _within(self, value: float | None) -> float | None:
        if value is None or value <= self.low or (self.high is not None and value > self.high):
            return None
        return value

    def accept(self, value: object) -> float | None:
        return self._within(super().accept(value))

    def parse(self, text: str) -> float | None:
        return self._within(super().parse(text))


class Pattern(Text):
    """A regular expression, compiled when the environment is read: a bad one is refused at
    start, not by every run later. (Not when read: it is read on every redaction.)"""

    noun = "a valid regular expression"

    def parse(self, text: str) -> str | None:
        return text if _compiles(text) else None


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


# A rate limit's period, by the names ``DURABILITY_RATE_LIMITS`` takes: its seconds.
PERIODS = {"s": 1, "sec": 1, "second": 1, "min": 60, "minute": 60, "h": 3600, "hour": 3600}


def rate_limits(spec: str) -> dict[str, tuple[float, float]]:
    """``"openai=60/min,search=5/s"`` -> {resource: (capacity, per second)}; ``ValueError``
    naming the part that is not ``NAME=AMOUNT/PERIOD`` with an amount over 0."""
    limits = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, rate = part.partition("=")
        amount, _, period = rate.partition("/")
        try:
            capacity = float(amount)
        except ValueError:
            capacity = math.nan
        seconds = PERIODS.get(period.strip().lower())
        if not name.strip() or seconds is None or not (0 < capacity < math.inf):
            raise ValueError(
                f"{part!r} is not NAME=AMOUNT/PERIOD (AMOUNT over 0; PERIOD: s, min or hour)"
            )
        limits[name.strip()] = (capacity, capacity / seconds)
    return limits


class Rates(Text):
    """Shared rate limits (``rate_limits``), checked when the environment is read: a bad one
    is refused at start, not by the first run that takes from it. (Not when read, as
    ``Pattern``: a value set in Django's settings is checked where it is used.)"""

    noun = "a list of NAME=AMOUNT/PERIOD (AMOUNT over 0; PERIOD: s, min or hour)"

    def parse(self, text: str) -> str | None:
        try:
            rate_limits(text)
        except ValueError:
            return None
        return text


class Flag(Kind[bool]):
    noun = "a boolean (use 1/0, true/false)"

    def accept(self, value: object) -> bool | None:
        return value if isinstance(value, bool) else None

    def parse(self, text: str) -> bool | None:
        word = text.strip().lower()
        return True if word in _TRUE else False if word in _FALSE else None

    def show(self, value: bool) -> str:
        return "1" if value else "0"


class Names(Kind[tuple[str, ...]]):
    """A list of strings; comma-separated in the environment."""

    noun = "a list of strings"

    def accept(self, value: object) -> tuple[str, ...] | None:
        if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
            return tuple(value)
        return None

    def parse(self, text: str) -> tuple[str, ...] | None:
        return tuple(item.strip() for item in text.split(",") if item.strip())

    def show(self, value: tuple[str, ...]) -> str:
        return ",".join(value)


TEXT, FOLDER, WHOLE, NUMBER, FLAG, NAMES = Text(), Folder(), Whole(), Number(), Flag(), Names()
POSITIVE = Bounded(0, noun="a number over 0")
SHARE = Bounded(0, 1, noun="a share over 0 and at most 1 (0.999 for 99.9%)")
SIZE = Counted(1)
PATTERN = Pattern()
RATES = Rates()


# --- one declaration ----------------------------------------------------------------------------


class Derived[T]:
    """A default computed from another setting of the same group (``of``), shown in the docs
    as ``shown``."""

    def __init__(self, of: str, compute: Callable[[Any], T], shown: str) -> None:
        self.of, self.compute, self.shown = of, compute, shown


class Setting[T]:
    """One setting: declared as a class attribute of a :class:`Declarations` group, whose
    attribute name (``LEASE_SECONDS``) gives its Django and environment name
    (``DURABILITY_LEASE_SECONDS``). Read on an instance of the group, it is the current
    value; on the class, the declaration itself."""

    name: str
    group: type[Declarations]

    def __init__(
        self, kind: Kind[T], default: T | Derived[T], doc: str, *, shown: str = ""
    ) -> None:
        self.kind, self.default, self.doc, self._shown = kind, default, doc, shown

    def __set_name__(self, owner: type[Declarations], name: str) -> None:
        self.name, self.group = PREFIX + name, owner

    @overload
    def __get__(self, instance: None, owner: type) -> Self: ...
    @overload
    def __get__(self, instance: object, owner: type) -> T: ...
    def __get__(self, instance: object, owner: type) -> T | Self:
        if instance is None:
            return self
        # Read on hot paths (every checkpoint commit): one attribute look-up, no more.
        raw = getattr(settings, self.name, _UNSET)
        return self.default_in(settings) if raw is _UNSET else self.checked(raw)

    def current(self) -> T:
        """The value in Django's settings now, or the default."""
        raw = getattr(settings, self.name, _UNSET)
        return self.default_in(settings) if raw is _UNSET else self.checked(raw)

    def value_in(self, source: object) -> T:
        """The value in ``source`` (Django's settings, or a mapping of setting names such as
        a settings module's globals), else the default worked out from the same source."""
        if isinstance(source, Mapping):
            raw = source.get(self.name, _UNSET)
        else:
            raw = getattr(source, self.name, _UNSET)
        return self.default_in(source) if raw is _UNSET else self.checked(raw)

    def checked(self, raw: object) -> T:
        value = self.kind.accept(raw)
        if value is None:
            raise ImproperlyConfigured(f"{self.name} must be {self.kind.noun}, not {raw!r}")
        return value

    def default_in(self, source: object) -> T:
        if isinstance(self.default, Derived):
            base: Setting[Any] = getattr(self.group, self.default.of)
            return self.default.compute(base.value_in(source))
        return self.default

    def parse(self, text: str) -> T:
        value = self.kind.parse(text)
        if value is None:
            raise ImproperlyConfigured(f"{self.name}={text!r} is not {self.kind.noun}")
        return value

    @property
    def shown(self) -> str:
        """The default as docs/configuration.md's table shows it."""
        if self._shown:
            return self._shown
        if isinstance(self.default, Derived):
            return self.default.shown
        text = self.kind.show(self.default)
        return f"`{text}`" if text else "empty"


class Declarations:
    """A group of settings. Subclasses declare :class:`Setting` attributes; an instance reads
    them (``conf.LEASE_SECONDS``)."""

    @classmethod
    def declared(cls) -> list[Setting[Any]]:
        return [value for value in vars(cls).values() if isinstance(value, Setting)]

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The plain defaults (not those derived from another setting): ``{name: value}``.
        A settings module that sets them makes each read one attribute look-up, several
        times cheaper than a missing setting's (some are read on every checkpoint commit);
        derived ones stay unset, so they follow what they derive from."""
        return {s.name: s.default for s in cls.declared() if not isinstance(s.default, Derived)}

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The declared settings whose environment variable is set (blank counts as unset,
        so a copied .env.example means the defaults), parsed: ``{name: value}``. A value of
        the wrong type raises ``ImproperlyConfigured`` naming the variable."""
        environ = os.environ if environ is None else environ
        found: dict[str, Any] = {}
        for setting in cls.declared():
            text = environ.get(setting.name)
            if text is not None and text.strip():
                found[setting.name] = setting.parse(text)
        return found


def _a_third(lease: float) -> float:
    return lease / 3


def _in_var_dir(folder: str) -> Derived[str]:
    return Derived("VAR_DIR", lambda var: os.path.join(var, folder), f"`./var/{folder}`")


class Engine(Declarations):
    """The engine's settings (``DURABILITY_`` + the attribute's name)."""

    VAR_DIR = Setting(FOLDER, "var", "where the embedded default keeps its files", shown="`./var`")
    AGENT_MODULES = Setting(
        NAMES, ("examples.agents",), "comma-separated modules whose import registers agents"
    )
    LEASE_SECONDS = Setting(POSITIVE, 30.0, "a run's lease; a stalled worker loses it after this")
    HEARTBEAT_SECONDS = Setting(
        NUMBER,
        Derived("LEASE_SECONDS", _a_third, "a third of the lease"),
        "how often the lease is renewed",
    )
    RECONNECT_MARGIN_SECONDS = Setting(
        NUMBER, 5.0, "after a database restart, how long beyond a heartbeat to take locks back"
    )
    SWEEP_SECONDS = Setting(POSITIVE, 2.0, "how often beat schedules a sweep")
    REQUEUE_SECONDS = Setting(
        NUMBER, 10.0, "a run queued but not claimed this long gets its doorbell rung again"
    )
    RING_TIMEOUT_SECONDS = Setting(
        NUMBER, 5.0, "how long a publish to the broker may take before the caller goes on"
    )
    PRUNE_SECONDS = Setting(POSITIVE, 3600.0, "how often beat applies retention policies")
    POISON_ATTEMPTS = Setting(
        WHOLE, 5, "claims in a row ending with the worker dying before the step is poison"
    )
    MAX_STATE_BYTES = Setting(SIZE, 16 * 1024 * 1024, "largest state accepted")
    MAX_INPUT_BYTES = Setting(SIZE, 1024 * 1024, "largest run input accepted")
    SLICE_SECONDS = Setting(NUMBER, 60.0, "a worker gives a long run back after this long")
    SHUTDOWN_GRACE_SECONDS = Setting(
        NUMBER, 10.0, "on SIGTERM, how long the current step may finish before it is abandoned"
    )
    VERSION_RETRY_SECONDS = Setting(
        NUMBER, 30.0, "a worker that cannot continue a run's version hands it back this long"
    )
    PRESENCE_SECONDS = Setting(
        NUMBER, 15.0, "how often workers announce the agent versions they can run"
    )
    RATE_LIMITS = Setting(RATES, "", "shared rate limits, e.g. openai=60/min,search=5/s")
    LOCK_DIR = Setting(FOLDER, _in_var_dir("locks"), "the embedded default's liveness locks")
    # The database
    PREPARED_STATEMENTS = Setting(FLAG, True, "prepare the commit statement per connection")
    SEND_AHEAD = Setting(FLAG, True, "send a checkpoint and start the next step before the answer")
    SNAPSHOT_MAX_DELTAS = Setting(
        Counted(1), 500, "most patches between two snapshots: the most a state load applies"
    )
    DB_WAIT_SECONDS = Setting(
        NUMBER, 300.0, "how long a worker retries recording a result while the database is away"
    )
    REPLICATION_TIMEOUT_SECONDS = Setting(
        NUMBER, 10.0, "replicated runs: how long a commit waits for the standby before an alarm"
    )
    # Integrity and secrets
    HMAC_KEY = Setting(TEXT, "", "keys the checkpoint chain and the argument hashes")
    HMAC_KEY_FALLBACKS = Setting(NAMES, (), "earlier HMAC keys a replay accepts for arguments")
    SECRET_KEY_PATTERN = Setting(
        PATTERN,
        "",
        "regular expression for secret-looking keys (empty: the built-in one)",
        shown="`api_key`, `token`, `password`, ...",
    )
    # Blobs
    BLOB_BYTES = Setting(SIZE, 256 * 1024, "strings over this many bytes move to the blob store")
    BLOB_DIR = Setting(FOLDER, _in_var_dir("blobs"), "the local blob folder")
    BLOB_STORAGE = Setting(TEXT, "", "a Django storage alias for blobs instead of the folder")
    BLOB_GC_GRACE_SECONDS = Setting(
        NUMBER, 86400.0, "unreferenced blobs are deleted once last stored this long ago"
    )
    # Metrics and SLO targets
    METRICS_TOKEN = Setting(TEXT, "", "bearer token /metrics scrapers must send (empty: open)")
    METRICS_WINDOW_SECONDS = Setting(POSITIVE, 300.0, "the window /metrics figures cover")
    METRICS_CACHE_SECONDS = Setting(NUMBER, 5.0, "one /metrics answer serves scrapes this long")
    SLO_COMMIT_SUCCESS = Setting(SHARE, 0.999, "target share of commits that succeed")
    SLO_COMMIT_P99_MS = Setting(POSITIVE, 100.0, "target p99 commit latency (milliseconds)")
    SLO_RECOVERY_P95_S = Setting(POSITIVE, 30.0, "target p95 recovery time (seconds)")
    SLO_WORK_LOST_P95_S = Setting(POSITIVE, 60.0, "target p95 work lost (seconds)")
    SLO_EFFECTS_IN_DOUBT_MAX = Setting(WHOLE, 0, "effects in doubt tolerated")
    SLO_APPROVAL_WAIT_P95_MIN = Setting(POSITIVE, 60.0, "target p95 approval wait (minutes)")
    SLO_RUN_SUCCESS = Setting(SHARE, 0.95, "target share of runs that succeed")


conf = Engine()
from_environment = Engine.from_environment
