"""The LangGraph checkpointer's tables: which run holds a thread, its checkpoints' LangGraph
ids and metadata, and pending writes. Installed whether or not LangGraph is: the tables
need no LangGraph code, only the saver does."""

from django.apps import AppConfig


class LangGraphConfig(AppConfig):
    name = "durability.langgraph"
    label = "durability_langgraph"
    verbose_name = "LangGraph checkpoints"
    default_auto_field = "django.db.models.BigAutoField"
