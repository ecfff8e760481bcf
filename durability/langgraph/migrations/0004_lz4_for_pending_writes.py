"""LZ4 for the values of a task's pending writes, as for the engine's large columns
(``durability`` migration 0018, which says why): a graph's write is often a model's whole
answer."""

import importlib

from django.db import migrations

engine = importlib.import_module("durability.migrations.0018_lz4_for_large_text")
COLUMNS = [("durability_langgraph_pendingwrite", "value")]


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(engine.compression("lz4", COLUMNS), params=None)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(engine.compression("default", COLUMNS), params=None)


class Migration(migrations.Migration):
    dependencies = [
        ("durability_langgraph", "0003_graph_wait_reasons"),
        ("durability", "0018_lz4_for_large_text"),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
