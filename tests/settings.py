"""Settings for the test suite and the worker processes it starts: the product's settings
with short leases and intervals, and the test agents loaded."""

import os

for _name, _value in {
    "DURABILITY_AGENT_MODULES": "examples.agents,tests.agents",
    "DURABILITY_LEASE_SECONDS": "4",
    "DURABILITY_HEARTBEAT_SECONDS": "0.5",
    "DURABILITY_REQUEUE_SECONDS": "1.5",
    "DURABILITY_SWEEP_SECONDS": "0.5",
    "DURABILITY_SHUTDOWN_GRACE_SECONDS": "2",
    "DURABILITY_DB_WAIT_SECONDS": "60",
    "CELERY_BROKER_POLLING_INTERVAL": "0.05",
    "LOG_LEVEL": "WARNING",
    "SECRET_KEY": "tests-only-not-secret",
    "DURABILITY_PRESENCE_SECONDS": "1",
    "DURABILITY_VERSION_RETRY_SECONDS": "1",
    # Each test scrapes what it just seeded (the cache has a test of its own).
    "DURABILITY_METRICS_CACHE_SECONDS": "0",
}.items():
    os.environ.setdefault(_name, _value)

from config.settings import *  # noqa: E402,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
