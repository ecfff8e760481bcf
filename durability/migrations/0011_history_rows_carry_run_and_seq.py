"""Mutation and snapshot rows carry their checkpoint's run and number (copied, immutable),
indexed, so that a run's latest state is read as one index range instead of a walk up the
parents. Existing rows are filled in from their checkpoints; a row whose checkpoint no longer
exists (no read can reach it: every read goes through a checkpoint) is deleted. The columns
stay nullable: workers of the previous version, still running during a rolling deploy,
insert rows without them (such rows are found by the walk up the parents)."""

from django.db import migrations, models

_TABLES = ("durability_mutation", "durability_snapshot")


def fill(apps, schema_editor):
    with schema_editor.connection.cursor() as cur:
        for table in _TABLES:
            cur.execute(
                f"DELETE FROM {table} WHERE NOT EXISTS"
                f" (SELECT 1 FROM durability_checkpoint c WHERE c.id = {table}.checkpoint_id)"
            )
            # One statement both dialects run (a correlated subquery per column).
            cur.execute(
                f"UPDATE {table} SET"
                f" run_id = (SELECT c.run_id FROM durability_checkpoint c"
                f" WHERE c.id = {table}.checkpoint_id),"
                f" seq = (SELECT c.seq FROM durability_checkpoint c"
                f" WHERE c.id = {table}.checkpoint_id)"
            )


class Migration(migrations.Migration):
    dependencies = [
        ("durability", "0010_rollback_effects"),
    ]

    operations = [
        *(
            migrations.AddField(model_name=model, name=name, field=field)
            for model in ("mutation", "snapshot")
            for name, field in (
                ("run_id", models.UUIDField(null=True)),
                ("seq", models.IntegerField(null=True)),
            )
        ),
        migrations.RunPython(fill, migrations.RunPython.noop),
        migrations.AddIndex(
            model_name="mutation",
            index=models.Index(fields=["run_id", "seq"], name="mutation_run_seq"),
        ),
        migrations.AddIndex(
            model_name="snapshot",
            index=models.Index(fields=["run_id", "seq"], name="snapshot_run_seq"),
        ),
    ]
