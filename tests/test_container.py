"""The container image holds what the product needs to start: every package of this
repository that the settings load or that those packages import, and nothing that
``.dockerignore`` keeps out of the build context. The suite's machines have no container
daemon, so the Dockerfile is read as text: a package added to the product but not to the
image's ``COPY`` lines fails here rather than when the image starts."""

from __future__ import annotations

import ast
import fnmatch
import shlex
from pathlib import Path

from django.conf import settings

from tests.procs import ROOT


def runtime_copies() -> set[str]:
    """The paths the Dockerfile's last stage copies from the build context."""
    stages: list[list[str]] = []
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if line.upper().startswith("FROM "):
            stages.append([])
        elif line.upper().startswith("COPY ") and stages:
            stages[-1].append(line)
    copied: set[str] = set()
    for line in stages[-1]:
        words = shlex.split(line)[1:]
        if any(w.startswith("--from") for w in words):
            continue
        sources = [w for w in words if not w.startswith("--")][:-1]
        copied.update(s.rstrip("/").removeprefix("./") for s in sources)
    return copied


def local_packages() -> set[str]:
    return {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}


def loaded_by_settings() -> set[str]:
    """The repository's packages the settings name: apps, URLs, the WSGI application."""
    names = [*settings.INSTALLED_APPS, settings.ROOT_URLCONF, settings.WSGI_APPLICATION]
    return {n.split(".")[0] for n in names} & local_packages()


def imported_by(package: str) -> set[str]:
    """The repository's packages that ``package``'s modules import."""
    found: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found & local_packages()


def needed() -> set[str]:
    """Every package the settings load, and what they import, transitively."""
    wanted, todo = set(), list(loaded_by_settings())
    while todo:
        package = todo.pop()
        if package not in wanted:
            wanted.add(package)
            todo.extend(imported_by(package) - wanted)
    return wanted


def test_the_image_copies_every_package_the_product_loads():
    missing = needed() - runtime_copies()
    assert not missing, f"the Dockerfile's runtime stage does not COPY {sorted(missing)}"


def test_the_image_copies_the_templates_and_manage_py():
    template_dirs = {
        str(Path(d).relative_to(ROOT)) for t in settings.TEMPLATES for d in t.get("DIRS", [])
    }
    missing = ({"manage.py"} | template_dirs) - runtime_copies()
    assert not missing, f"the Dockerfile's runtime stage does not COPY {sorted(missing)}"


def test_dockerignore_keeps_nothing_the_image_copies_out_of_the_context():
    patterns = [
        p.strip()
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith(("#", "!"))
    ]
    for copied in runtime_copies():
        hit = [p for p in patterns if fnmatch.fnmatch(copied, p.rstrip("/"))]
        assert not hit, f".dockerignore's {hit} keep {copied!r} out of the build context"


def test_the_check_finds_a_package_left_out():
    """The check itself: the settings name packages, and those import further ones."""
    assert {"durability", "dashboard", "api", "config"} <= needed()
