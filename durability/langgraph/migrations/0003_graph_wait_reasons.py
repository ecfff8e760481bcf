"""The runs of graphs executed in their own process, waiting before their runs said what for
(``WaitReason.GRAPH`` or ``INTERRUPT``): said now, from the detail they wait with."""

from django.db import migrations

ANSWER = "an answer to: "  # ``status.ANSWER`` when this was written


def forwards(apps, schema_editor):
    Run = apps.get_model("durability", "Run")
    Thread = apps.get_model("durability_langgraph", "Thread")
    graphs = Run.objects.filter(
        id__in=Thread.objects.values("run_id"), status="waiting", wait_reason=""
    )
    graphs.filter(wait_detail__startswith=ANSWER).update(wait_reason="interrupt")
    graphs.exclude(wait_detail__startswith=ANSWER).update(wait_reason="graph")


def backwards(apps, schema_editor):
    Run = apps.get_model("durability", "Run")
    Run.objects.filter(wait_reason__in=["graph", "interrupt"]).update(wait_reason="")


class Migration(migrations.Migration):
    dependencies = [
        ("durability", "0016_graph_wait_reasons"),
        ("durability_langgraph", "0002_hot_path_references_unconstrained"),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
