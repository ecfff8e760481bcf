"""Django settings for the benchmark process and every subprocess it starts.

The product's own settings, unchanged (lease, heartbeat, sweep and requeue intervals keep
their defaults: the recovery figure is quoted "with default settings"); only the agents
loaded differ. The database is guarded here, in every process, not only in the entry point:
the benchmark TRUNCATEs and DROPs its database, so it must never be one in use elsewhere.
"""

import os

os.environ.setdefault("DURABILITY_AGENT_MODULES", "bench.agents")
os.environ.setdefault("SECRET_KEY", "bench-only-not-secret")

from bench.db import check_bench_database  # noqa: E402
from config.settings import *  # noqa: E402,F403
from config.settings import DATABASES  # noqa: E402

check_bench_database(DATABASES["default"]["NAME"])
