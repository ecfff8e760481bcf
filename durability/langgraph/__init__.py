"""LangGraph graphs on this product's store: ``DurableSaver``, a LangGraph checkpointer.

    from durability.langgraph import DurableSaver

    graph = builder.compile(checkpointer=DurableSaver())

Needs the ``langgraph`` extra (``pip install 'durability[langgraph]'``). The tables it
uses are this package's Django app (``durability.langgraph``, in INSTALLED_APPS), which
imports no LangGraph code, so the product starts without the extra installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DurableSaver"]

INSTALL_HINT = (
    "durability.langgraph needs LangGraph: install the extra with"
    " `pip install 'durability[langgraph]'` (langgraph and langgraph-checkpoint)"
)


def __getattr__(name: str) -> Any:
    if name == "DurableSaver":
        try:
            from durability.langgraph.saver import DurableSaver
        except ImportError as exc:
            if exc.name and exc.name.split(".")[0] in ("langgraph", "langchain_core"):
                raise ImportError(INSTALL_HINT, name=exc.name) from exc
            raise
        return DurableSaver
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
