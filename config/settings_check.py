"""Loading the settings before anything else touches them.

OpenTelemetry's Django instrumentation reads the settings when it is installed and, when
they cannot be loaded, configures empty ones in their place: a missing ``SECRET_KEY`` or a
bad ``DURABILITY_*`` value would then start a web process that answers every request with
an error about ``ROOT_URLCONF``, and a command that complains about ``DATABASES``, never
naming the variable to set. Loaded first, the settings' own refusal is what is said."""

from __future__ import annotations

import sys

from django.core.exceptions import ImproperlyConfigured


def load() -> None:
    """Load the settings, and check the telemetry's variables and what the settings name in
    each other; their ``ImproperlyConfigured`` as it is."""
    from django.conf import settings

    from config import telemetry
    from durability.conf import conf

    settings.INSTALLED_APPS  # noqa: B018 - the import is the point
    telemetry.check()
    # Checked here rather than in the settings module: a deployment's own settings module,
    # importing ours, may add the storage after it.
    blobs = conf.BLOB_STORAGE
    if blobs and blobs not in settings.STORAGES:
        raise ImproperlyConfigured(
            f"DURABILITY_BLOB_STORAGE={blobs!r} names no storage in STORAGES (there:"
            f" {', '.join(settings.STORAGES)}): add it to STORAGES, or leave the variable"
            " empty to keep blobs in DURABILITY_BLOB_DIR"
        )


def load_or_exit() -> None:
    """``load``, or the refusal on one line of stderr and exit status 2 (bad input), for a
    command line."""
    try:
        load()
    except ImproperlyConfigured as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
