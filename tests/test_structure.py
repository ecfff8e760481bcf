"""The structure rules scripts/check-structure enforces in `make test`: they hold for the
repository, and they catch what they promise to catch."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check-structure"

pytestmark = pytest.mark.smoke


def _checker():
    loader = importlib.machinery.SourceFileLoader("check_structure", str(SCRIPT))
    spec = importlib.util.spec_from_loader("check_structure", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_the_repository_keeps_the_rules():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_long_function_a_long_module_and_a_dialect_test_are_caught():
    check = _checker()
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    found = check.breaches(Path("durability/x.py"), f"def long():\n{body}\n")
    assert found == ["durability/x.py:1: function long is 62 lines (at most 60)"]
    assert check.breaches(Path("api/y.py"), "x = 1\n" * 601) == [
        "api/y.py: 601 lines (at most 600)"
    ]
    vendor = "from django.db import connection\nif connection.vendor == 'sqlite':\n    pass\n"
    assert check.breaches(Path("dashboard/z.py"), vendor) == [
        "dashboard/z.py:2: a dialect test outside durability/store/"
    ]
    assert check.breaches(Path("durability/store/sqlite.py"), vendor) == []
    assert check.breaches(Path("durability/x.py"), f"def short():\n{body[:200]}\n") == []
