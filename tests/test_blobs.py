"""Large values: kept once, by content, outside the state row; the state keeps a reference
the hash chain covers; read only when a step asks."""

from __future__ import annotations

import os

import pytest

from durability import END, Agent, blobs, operations, registry
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
