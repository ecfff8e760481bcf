"""State hashes chained over patches instead of over each whole state; sealed snapshots.

Before: every checkpoint's state hash was the SHA-256 of its whole canonical state. After:
a checkpoint stored as a patch on its parent hashes the parent's state hash and the patch
(``canonical.patched``), and every snapshot carries a digest binding it to its checkpoint's
state hash (``canonical.seal``). See docs/architecture.md, "Hashes and verify".

Existing checkpoints are re-sealed run by run, in the order verify walks them: each one is
first checked under the rule it was written with, and only what checks out is rewritten. A
checkpoint that does not (and everything built on it) is left exactly as it was, so that
``verify`` still names it afterwards instead of the migration laundering it. The reverse
migration does the same the other way round.
"""

from collections import Counter

from django.conf import settings
from django.db import migrations, models

from durability import canonical, diff


def _key() -> bytes:
    return (getattr(settings, "DURABILITY_HMAC_KEY", "") or "").encode()


def _link(cp, parent_chain: str, state_hash: str, key: bytes) -> str:
    return canonical.chain_hash(
        parent_chain,
        state_hash,
        run_id=str(cp.run_id),
        seq=cp.seq,
        step=cp.step,
        next_step=cp.next_step,
        schema_version=cp.schema_version,
        agent_version=cp.agent_version,
        key=key,
    )


def _reseal_run(apps, run_id, to_chained: bool, key: bytes) -> None:
    Checkpoint = apps.get_model("durability", "Checkpoint")
    Mutation = apps.get_model("durability", "Mutation")
    Snapshot = apps.get_model("durability", "Snapshot")
    cps = list(Checkpoint.objects.filter(run_id=run_id).order_by("seq"))
    ops_of = dict(
        Mutation.objects.filter(checkpoint__run_id=run_id).values_list("checkpoint_id", "ops")
    )
    snapshots = {
        cid: (state, digest)
        for cid, state, digest in Snapshot.objects.filter(checkpoint__run_id=run_id).values_list(
            "checkpoint_id", "state", "digest"
        )
    }
    children = Counter(cp.parent_id for cp in cps if cp.parent_id)
    # id -> (state, hash as stored, chain as stored, hash as rewritten, chain as rewritten)
    done: dict = {}
    for cp in cps:
        compacted = bool(cp.parent_chain)
        parent = done.get(cp.parent_id) if cp.parent_id and not compacted else None
        if cp.parent_id and not compacted and parent is None:
            continue  # built on a checkpoint that did not check out: left as it was
        text = ops_of.get(cp.id)
        try:
            if parent is not None:
                base = canonical.loads(canonical.dumps(parent[0]))  # a sibling may share it
                state = diff.apply(base, canonical.loads(text))
            else:
                state = canonical.loads(snapshots[cp.id][0])
            whole = canonical.sha256_hex(canonical.dumps(state))
        except Exception:
            continue
        if parent is not None:
            chained = canonical.patched(parent[3] if to_chained else parent[1], text.encode())
        elif compacted:
            # Its patch was made on a parent that is gone: its hash stays as it is.
            chained = cp.state_hash
        else:
            chained = whole
        before, after = (whole, chained) if to_chained else (chained, whole)
        snapshot = snapshots[cp.id][0].encode() if cp.id in snapshots else None
        if snapshot is not None:
            if canonical.sha256_hex(snapshot) != whole:
                continue  # a snapshot that is not the state its history gives
            if not to_chained and canonical.seal(before, snapshot, key) != snapshots[cp.id][1]:
                continue
        parent_chain_now = cp.parent_chain or (parent[2] if parent is not None else "")
        parent_chain_new = cp.parent_chain or (parent[4] if parent is not None else "")
        if cp.state_hash != before or _link(cp, parent_chain_now, before, key) != cp.chain_hash:
            continue
        chain = _link(cp, parent_chain_new, after, key)
        Checkpoint.objects.filter(pk=cp.pk).update(state_hash=after, chain_hash=chain)
        if snapshot is not None:
            digest = canonical.seal(after, snapshot, key) if to_chained else ""
            Snapshot.objects.filter(checkpoint_id=cp.id).update(digest=digest)
        if cp.parent_id in done:
            children[cp.parent_id] -= 1
            if children[cp.parent_id] <= 0:
                done.pop(cp.parent_id, None)
        if children.get(cp.id):
            done[cp.id] = (state, cp.state_hash, cp.chain_hash, after, chain)


def _reseal(apps, to_chained: bool) -> None:
    Run = apps.get_model("durability", "Run")
    key = _key()
    for run_id in Run.objects.order_by("created_at", "id").values_list("id", flat=True):
        _reseal_run(apps, run_id, to_chained, key)


def forward(apps, schema_editor) -> None:
    _reseal(apps, to_chained=True)


def backward(apps, schema_editor) -> None:
    _reseal(apps, to_chained=False)


class Migration(migrations.Migration):
    dependencies = [
        ("durability", "0005_run_composite_indexes_only"),
    ]

    operations = [
        migrations.AddField(
            model_name="snapshot",
            name="digest",
            field=models.CharField(blank=True, db_default="", default="", max_length=64),
        ),
        migrations.RunPython(forward, backward, elidable=False),
    ]
