"""A trigram index for the dashboard's search in run inputs (``input__icontains``, which
PostgreSQL runs as ``UPPER(input) LIKE UPPER('%...%')``): without it that search reads every
run. PostgreSQL only, and only where the pg_trgm extension can be created (it is trusted
since PostgreSQL 13, so a database owner may); elsewhere the search still works, by a scan.
Not in the model's Meta: SQLite has no such index."""

import logging

from django.db import migrations

log = logging.getLogger(__name__)


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cur:
        cur.execute("SAVEPOINT trigram")
        try:
            cur.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
        except Exception as exc:  # no privilege, or the extension is not installed
            cur.execute("ROLLBACK TO SAVEPOINT trigram")
            log.warning("no pg_trgm (%s): searching run inputs will read every run", exc)
            return
        cur.execute(
            "CREATE INDEX IF NOT EXISTS run_input_trgm"
            " ON durability_run USING gin (upper(input) gin_trgm_ops)"
        )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP INDEX IF EXISTS run_input_trgm")


class Migration(migrations.Migration):
    dependencies = [("durability", "0002_identity_covers_base")]

    operations = [migrations.RunPython(create, drop)]
