"""Settings declared once (durability/conf.py, dashboard/conf.py, api/conf.py): read typed at
the moment of use, parsed from the environment, documented, and read nowhere else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from api.conf import Api
from dashboard.conf import Dashboard
from durability.conf import Engine, conf
from tests.procs import ROOT

GROUPS = (Engine, Dashboard, Api)

# Where a DURABILITY_ setting may still be read from Django's settings directly: the
# declarations themselves, and modules whose reads are converted separately. Empty it as they
# are converted; a new module never belongs here.
READS_ALLOWED = {
    "durability/conf.py",
    "dashboard/conf.py",
    "api/conf.py",
}
# Values config/settings.py derives from settings that are not ours (the housekeeping queue
# from CELERY_QUEUE): no default to repeat, so any module may read them.
DERIVED_BY_CONFIG = {"DURABILITY_HOUSEKEEPING_QUEUE"}


def test_a_setting_is_read_at_the_moment_of_use(settings):
    settings.DURABILITY_LEASE_SECONDS = 12
    assert conf.LEASE_SECONDS == 12.0 and isinstance(conf.LEASE_SECONDS, float)
    del settings.DURABILITY_HEARTBEAT_SECONDS
    assert conf.HEARTBEAT_SECONDS == 4.0  # a third of the lease, as it is now
    settings.DURABILITY_HEARTBEAT_SECONDS = 1
    assert conf.HEARTBEAT_SECONDS == 1.0


def test_folders_follow_the_var_dir(settings, tmp_path):
    for name in ("DURABILITY_BLOB_DIR", "DURABILITY_LOCK_DIR"):
        if hasattr(settings, name):
            delattr(settings, name)
    settings.DURABILITY_VAR_DIR = tmp_path  # a Path is accepted
    assert str(tmp_path / "blobs") == conf.BLOB_DIR
    assert str(tmp_path / "locks") == conf.LOCK_DIR


def test_an_unset_setting_is_its_declared_default(settings):
    for name in ("DURABILITY_SLICE_SECONDS", "DURABILITY_NOTIFY_WEBHOOK_FORMAT"):
        if hasattr(settings, name):
            delattr(settings, name)
    assert conf.SLICE_SECONDS == 60.0
    assert Dashboard().NOTIFY_WEBHOOK_FORMAT == "json"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "DURABILITY_LEASE_SECONDS",
            "30",
            "DURABILITY_LEASE_SECONDS must be a number over 0, not '30'",
        ),
        ("DURABILITY_POISON_ATTEMPTS", 2.5, "must be a whole number, not 2.5"),
        ("DURABILITY_SEND_AHEAD", "yes", "DURABILITY_SEND_AHEAD must be a boolean"),
        ("DURABILITY_HMAC_KEY_FALLBACKS", "old-key", "must be a list of strings, not 'old-key'"),
        ("DURABILITY_BLOB_DIR", "", "DURABILITY_BLOB_DIR must be a folder path"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_setting(settings, name, value, message):
    setattr(settings, name, value)
    attribute = name.removeprefix("DURABILITY_")
    with pytest.raises(ImproperlyConfigured, match=re.escape(message)):
        getattr(conf, attribute)


def test_a_bad_rate_limit_for_the_api_is_refused(settings):
    settings.DURABILITY_API_RATE_LIMIT = "3 per minute"
    with pytest.raises(ImproperlyConfigured, match="DURABILITY_API_RATE_LIMIT must be"):
        Api().API_RATE_LIMIT  # noqa: B018


def test_the_environment_gives_only_what_it_sets():
    environ = {
        "DURABILITY_LEASE_SECONDS": "12",
        "DURABILITY_POISON_ATTEMPTS": "3",
        "DURABILITY_SEND_AHEAD": "off",
        "DURABILITY_AGENT_MODULES": "examples.agents, mine.agents,",
        "DURABILITY_HMAC_KEY": "   ",  # blank counts as unset, as in a copied .env.example
        "UNRELATED": "x",
    }
    assert Engine.from_environment(environ) == {
        "DURABILITY_LEASE_SECONDS": 12.0,
        "DURABILITY_POISON_ATTEMPTS": 3,
        "DURABILITY_SEND_AHEAD": False,
        "DURABILITY_AGENT_MODULES": ("examples.agents", "mine.agents"),
    }
    assert Engine.from_environment({}) == {}
    # A derived default follows what the environment set.
    assert Engine.HEARTBEAT_SECONDS.value_in(Engine.from_environment(environ)) == 4.0
    with pytest.raises(ImproperlyConfigured, match="DURABILITY_POISON_ATTEMPTS='3.5' is not"):
        Engine.from_environment({"DURABILITY_POISON_ATTEMPTS": "3.5"})


def documented_defaults() -> dict[str, str]:
    """``{name: default cell}`` of the tables in docs/configuration.md."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `(DURABILITY_\w+)` \| ([^|]*) \|", text, re.M)
    return {name: cell.strip() for name, cell in rows}


def test_every_declared_setting_is_documented_with_its_default():
    documented = documented_defaults()
    missing, wrong = [], []
    for group in GROUPS:
        for setting in group.declared():
            if setting.name not in documented:
                missing.append(setting.name)
            elif not documented[setting.name].startswith(setting.shown):
                wrong.append(f"{setting.name}: {documented[setting.name]!r}, not {setting.shown}")
    assert not missing, f"not in docs/configuration.md: {missing}"
    assert not wrong, f"documented with another default: {wrong}"


def test_every_declared_setting_is_in_env_example():
    listed = set(re.findall(r"^(DURABILITY_\w+)=", (ROOT / ".env.example").read_text(), re.M))
    declared = {setting.name for group in GROUPS for setting in group.declared()}
    assert declared <= listed, f"not in .env.example: {sorted(declared - listed)}"


def settings_reads(path: Path) -> list[str]:
    """The DURABILITY_ settings ``path`` reads from Django's settings object directly:
    ``settings.DURABILITY_X`` or ``getattr(settings, "DURABILITY_X", ...)``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "settings"
            and node.attr.startswith("DURABILITY_")
        ):
            found.append(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == "settings"
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("DURABILITY_")
        ):
            found.append(str(node.args[1].value))
    return [name for name in found if name not in DERIVED_BY_CONFIG]


def test_settings_are_read_only_through_their_declaration():
    offenders = {}
    for part in ("durability", "workers", "dashboard", "api", "examples", "bench"):
        for path in sorted((ROOT / part).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if "/migrations/" in relative or relative in READS_ALLOWED:
                continue
            if reads := settings_reads(path):
                offenders[relative] = reads
    assert not offenders, f"read these through durability/dashboard/api conf: {offenders}"
