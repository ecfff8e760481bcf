from django.apps import AppConfig
from django.core import checks

from durability.conf import conf


class DurabilityConfig(AppConfig):
    name = "durability"
    verbose_name = "Durable runs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.signals import setting_changed
        from django.db import connections
        from django.db.backends.signals import connection_created

        from durability import redact

        checks.register(check_settings, "durability")
        checks.register(check_agents, "durability")
        # The redaction gate (durability/redact.py) on every statement of every connection,
        # those opened before this point included, and on every log record.
        connection_created.connect(redact.on_connection_created, dispatch_uid="durability.gate")
        for conn in connections.all(initialized_only=True):
            redact.install_database_gate(conn)
        redact.install_log_gate()
        setting_changed.connect(redact.on_setting_changed, dispatch_uid="durability.hash-keys")


def check_settings(app_configs=None, **kwargs):
    from django.conf import settings

    problems = []
    lease = conf.LEASE_SECONDS
    beat = conf.HEARTBEAT_SECONDS
    if beat <= 0 or lease <= 0:
        problems.append(
            checks.Error(
                "DURABILITY_LEASE_SECONDS and DURABILITY_HEARTBEAT_SECONDS must be positive",
                id="durability.E001",
            )
        )
    elif beat > lease / 2:
        problems.append(
            checks.Warning(
                f"heartbeats every {beat:g} s renew a {lease:g} s lease: one late heartbeat"
                " loses it",
                hint="Keep DURABILITY_HEARTBEAT_SECONDS at most a third of the lease.",
                id="durability.W001",
            )
        )
    if conf.POISON_ATTEMPTS < 1:
        problems.append(
            checks.Error("DURABILITY_POISON_ATTEMPTS must be at least 1", id="durability.E002")
        )
    embedded = settings.DATABASES["default"]["ENGINE"].endswith("sqlite3")
    if settings.SECRET_KEY.startswith("insecure-") and not embedded:
        problems.append(
            checks.Warning(
                "SECRET_KEY is the embedded default",
                hint="Set SECRET_KEY in the environment for anything but a local trial.",
                id="durability.W002",
            )
        )
    return problems


def check_agents(app_configs=None, **kwargs):
    from durability.agents import registry
    from durability.errors import AgentDefinitionError

    problems = []
    try:
        registry.discover()
    except ImportError as exc:
        return [
            checks.Error(
                f"an agent module in DURABILITY_AGENT_MODULES does not import: {exc}",
                id="durability.E003",
            )
        ]
    for agent in registry.all():
        try:
            agent.first_step  # noqa: B018 - raises if the definition is incomplete
        except AgentDefinitionError as exc:
            problems.append(checks.Error(str(exc), id="durability.E004"))
    return problems
