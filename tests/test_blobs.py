"""Large values: kept once, by content, outside the state row; the state keeps a reference
the hash chain covers; read only when a step asks."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from durability import END, Agent, Retention, blobs, canonical, operations, registry
from durability.errors import IntegrityViolation
from durability.models import Checkpoint, Mutation, RunStatus, Snapshot
from durability.testing import drive, state_of

pytestmark = pytest.mark.django_db(transaction=True)

DOCUMENT = "lorem ipsum " * 30_000  # ~360 KB


@pytest.fixture(autouse=True)
def agent(settings, tmp_path):
    settings.DURABILITY_BLOB_DIR = str(tmp_path / "blobs")
    registry.unregister("x-docs")
    docs = Agent("x-docs", initial_state=lambda inp: {"docs": [], "n": 0})

    @docs.step(start=True)
    def read(state, ctx):
        state["docs"].append(DOCUMENT)  # the same big document each time
        state["n"] += 1
        return "read" if state["n"] < 3 else "measure"

    @docs.step
    def measure(state, ctx):
        state["lengths"] = [len(ctx.blob(d)) for d in state["docs"]]
        state["image"] = ctx.put_blob(b"\x89PNG" + bytes(range(256)) * 10)
        return END


def test_large_values_are_stored_once_and_referenced():
    run = operations.start("x-docs", {})
    assert drive(run.id).status == RunStatus.SUCCEEDED
    state = state_of(run.id)
    assert all(blobs.is_ref(d) for d in state["docs"])
    assert len({d["$blob"] for d in state["docs"]}) == 1  # shared, not copied
    assert state["lengths"] == [len(DOCUMENT)] * 3
    folder = blobs._folder()
    stored = [f for _, _, files in os.walk(folder) for f in files]
    assert len(stored) == 2  # the document once, the image once
    # No checkpoint row holds the document itself.
    for text in [
        *Snapshot.objects.values_list("state", flat=True),
        *Mutation.objects.values_list("ops", flat=True),
    ]:
        assert "lorem ipsum lorem" not in text
    assert max(Checkpoint.objects.filter(run=run).values_list("size", flat=True)) < 2_000
    assert blobs.get(state["image"])[:4] == b"\x89PNG"
    assert operations.verify(run.id)[0].ok


def test_a_blob_that_changed_on_disk_is_refused():
    ref = blobs.put("a" * 10)
    path = os.path.join(blobs._folder(), blobs._name(ref["$blob"]))
    with open(path, "w") as f:
        f.write("b" * 10)
    with pytest.raises(IntegrityViolation):
        blobs.get(ref)


def _files() -> set[str]:
    return {f for _, _, files in os.walk(blobs._folder()) for f in files}


def _age_blobs(seconds: float) -> None:
    past = time.time() - seconds
    for root, _, files in os.walk(blobs._folder()):
        for f in files:
            os.utime(os.path.join(root, f), (past, past))


@pytest.mark.smoke  # on SQLite too, where references are matched in Python, not in SQL
def test_blobs_of_pruned_runs_are_collected_and_shared_ones_kept(settings):
    from durability.models import Run
    from durability.retention import prune

    registry.get("x-docs").retention = Retention(keep_days=30)
    try:
        gone, kept = operations.start("x-docs", {}), operations.start("x-docs", {})
        drive(gone.id)
        drive(kept.id)
        assert len(_files()) == 2  # both runs share the document and the image
        extra = blobs.put("only the pruned run's " * 20_000)  # referenced by its input
        Run.objects.filter(pk=gone.id).update(
            input='{"doc":' + canonical.dumps(extra).decode() + "}"
        )
        past = timezone.now() - timedelta(days=40)
        Run.objects.filter(pk=gone.id).update(finished_at=past)
        _age_blobs(2 * 86400)

        preview = prune(dry_run=True)
        assert preview.runs_deleted == [str(gone.id)]
        assert preview.blobs_deleted == []  # the run still refers to it until it is deleted
        assert len(_files()) == 3

        report = prune()
        assert report.runs_deleted == [str(gone.id)]
        assert report.blobs_deleted == [extra["$blob"]]  # nothing else referred to it
        assert len(_files()) == 2
        state = state_of(kept.id)
        assert len(blobs.get(state["docs"][0])) == len(DOCUMENT)  # shared: kept
        assert operations.verify(kept.id)[0].ok
        assert f"deleted blob {extra['$blob']} (nothing refers to it)" in report.lines()
    finally:
        registry.get("x-docs").retention = Retention()


def test_a_recent_or_restored_blob_is_not_collected(settings):
    from durability.retention import prune

    settings.DURABILITY_BLOB_GC_GRACE_SECONDS = 3600
    fresh = blobs.put("a step stored this and has not committed yet " * 10_000)
    old = blobs.put("old and unreferenced " * 10_000)
    assert prune().blobs_deleted == []  # unreferenced, but within the grace period
    _age_blobs(7200)
    again = blobs.put("a step stored this and has not committed yet " * 10_000)
    assert again == fresh  # stored again: its time is refreshed, not its content rewritten
    preview = prune(dry_run=True)
    assert preview.blobs_deleted == [old["$blob"]] and len(_files()) == 2
    assert prune().blobs_deleted == [old["$blob"]]
    assert blobs.get(fresh).startswith("a step stored this")
    assert len(_files()) == 1


def test_a_storage_that_cannot_overwrite_is_left_alone(settings, tmp_path):
    from durability.retention import prune

    settings.STORAGES = {
        **settings.STORAGES,
        "blobs": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(tmp_path / "s3-like")},
        },
    }
    settings.DURABILITY_BLOB_STORAGE = "blobs"
    settings.DURABILITY_BLOB_GC_GRACE_SECONDS = 0
    blobs.put("unreferenced " * 30_000)
    report = prune()
    assert report.blobs_deleted == []
    assert "does not overwrite on save" in report.blobs_note
    settings.STORAGES = {
        **settings.STORAGES,
        "blobs": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(tmp_path / "s3-like"), "allow_overwrite": True},
        },
    }
    report = prune(now=timezone.now() + timedelta(seconds=5))
    assert len(report.blobs_deleted) == 1 and report.blobs_note == ""
