"""A LangGraph graph run by a process of its own, for the crash tests:
``python -m tests.langgraph_child THREAD TURNS PAUSE`` takes the thread up from its last
checkpoint in the store (or starts it), with ``DurableSaver`` on the database of
``DATABASE_URL``, printing a line as each node starts and ``finished`` at the end."""

from __future__ import annotations

import sys


def main(thread: str, turns: int, pause: float) -> None:
    import django

    django.setup()
    from durability.langgraph import DurableSaver
    from tests import langgraph_graphs as graphs

    saver = DurableSaver()
    graph = graphs.pairs(turns, pause, announce=True).compile(checkpointer=saver)
    cfg = {"configurable": {"thread_id": thread}}
    begun = saver.get_tuple(cfg) is not None
    graph.invoke(None if begun else graphs.first_input(), cfg, durability="sync")
    saver.close()
    print("finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
