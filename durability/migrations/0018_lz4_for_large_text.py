"""LZ4 rather than PostgreSQL's default (pglz) for the columns a step writes that can be large:
snapshots, patches and recorded call results. PostgreSQL compresses every value over about
2 KB as it stores it: on 350 KB of JSON, pglz took 4.7 to 6.0 ms and LZ4 1.2 to 2.5 ms, to
about the same size; on what does not compress (base64, encoded media) pglz spends its time
and stores the value as it was. Values already stored stay as they are; both read alike.

PostgreSQL 14 and later, built with LZ4 (as the distributions' packages are); elsewhere the
columns keep the default and a warning says so. SQLite: nothing to do."""

from django.db import migrations

COLUMNS = [
    ("durability_snapshot", "state"),
    ("durability_mutation", "ops"),
    ("durability_journalentry", "result"),
]


def compression(method: str, columns: list[tuple[str, str]]) -> str:
    alters = "".join(
        f"ALTER TABLE {table} ALTER COLUMN {column} SET COMPRESSION {method};"
        for table, column in columns
    )
    return (
        f"DO $$ BEGIN {alters} EXCEPTION WHEN feature_not_supported OR syntax_error THEN"
        " RAISE WARNING 'large columns keep the default compression: %', SQLERRM; END $$"
    )


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(compression("lz4", COLUMNS), params=None)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(compression("default", COLUMNS), params=None)


class Migration(migrations.Migration):
    dependencies = [("durability", "0017_audit_outlives_runs")]

    operations = [migrations.RunPython(forwards, backwards)]
