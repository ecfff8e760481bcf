"""LangGraph graphs on this product's store: ``DurableSaver``, a LangGraph checkpointer.

    from durability.langgraph import DurableSaver

    graph = builder.compile(checkpointer=DurableSaver())

and graphs the workers execute, registered as agents (``durability.langgraph.registered``)::

    from durability.langgraph import agent, journaled

    agent("support", build_graph, version="3")

Needs the ``langgraph`` extra (``pip install 'durability[langgraph]'``). The tables it
uses are this package's Django app (``durability.langgraph``, in INSTALLED_APPS), which
imports no LangGraph code, so the product starts without the extra installed.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DurableSaver",
    "GraphAgent",
    "ThreadDeleted",
    "agent",
    "effect",
    "journaled",
    "wait_for",
]

# Where each public name lives (imported on first use: they need the extra).
_HOMES = {
    "DurableSaver": "durability.langgraph.saver",
    "GraphAgent": "durability.langgraph.registered",
    "ThreadDeleted": "durability.langgraph.latest",
    "agent": "durability.langgraph.registered",
    "journaled": "durability.langgraph.registered",
    "effect": "durability.langgraph.registered",
    "wait_for": "durability.langgraph.registered",
}

INSTALL_HINT = (
    "durability.langgraph needs LangGraph: install the extra with"
    " `pip install 'durability[langgraph]'` (langgraph and langgraph-checkpoint)"
)


SETUP_HINT = (
    "durability.langgraph keeps its checkpoints in this product's database, through its"
    " Django settings: set DJANGO_SETTINGS_MODULE (config.settings, with DATABASE_URL) and"
    " call django.setup() before using {name} (see docs/langgraph.md)"
)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is not None:
        from django.apps import apps

        # Models are loaded from inside django.setup() on (an agent module imported by
        # an app's ready() may register a graph): anything earlier gets Django's own
        # "settings are not configured" or "apps aren't loaded yet".
        if not apps.models_ready:
            from django.core.exceptions import ImproperlyConfigured

            raise ImproperlyConfigured(SETUP_HINT.format(name=name))
        try:
            module = importlib.import_module(home)
        except ImportError as exc:
            if exc.name and exc.name.split(".")[0] in ("langgraph", "langchain_core"):
                raise ImportError(INSTALL_HINT, name=exc.name) from exc
            raise
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
