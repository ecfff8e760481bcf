"""Storage: every product table's total size (heap, indexes, TOAST; checkpoints, mutations,
snapshots, events, journal...) after steps that each append 1 KB of incompressible text,
against the final state's size. The tables are truncated first, so the figure holds this
run's rows and the first pages of every table the run wrote to (counted, not subtracted).
Tables the run never touched (API tokens, the LangGraph saver's, the dashboard's...) keep
their empty first pages whatever runs do: they are reported beside the figure, not in it, so
adding a feature's table does not change what a run costs.
No VACUUM FULL, no ANALYZE: the sizes a production database would have.
"""

from __future__ import annotations

from bench import agents
from bench.common import Bench, doorbell, execute_until_done, fmt_ratio, truncate_product_tables
from bench.db import PRODUCT_TABLES_SQL
from bench.stats import ratio, size, table


def table_sizes() -> dict[str, int]:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(PRODUCT_TABLES_SQL)
        return {name: int(total) for name, total in cur.fetchall()}


def run(b: Bench) -> None:
    from durability import operations
    from durability.models import Run

    print("\n== Storage after N steps appending 1 KB each")
    total_steps = 500
    milestones = [100, 200, 300, 400, 500]
    truncate_product_tables()
    first = table_sizes()
    empty = sum(first.values())
    rows = []
    totals: dict[int, int] = {0: empty}
    last: dict[str, int] = {}
    state_size = 0
    with doorbell(False):
        run_ = operations.start("bench-append", {"n": total_steps}, by="bench")
        agents.COUNTER[0] = 0
        for mark in milestones:
            # The engine checks should_stop before each step: it yields the run (a released
            # event, like any time slice) once this many steps ran, and is executed again.
            outcome = execute_until_done(run_.id, should_stop=lambda m=mark: agents.COUNTER[0] >= m)
            head = Run.objects.get(pk=run_.id)
            if head.head_seq != mark:
                raise RuntimeError(f"expected head #{mark}, got #{head.head_seq} ({outcome})")
            last = table_sizes()
            total = sum(last.values())
            totals[mark] = total
            state_size = head.checkpoints.get(seq=mark).size
            rows.append(
                [
                    mark,
                    size(state_size),
                    size(total),
                    fmt_ratio(ratio(total, state_size)),
                    size(total - totals[mark - 100]),
                ]
            )
    _print_sizes(run_.id, empty, rows, last)
    untouched = sum(n for name, n in first.items() if last.get(name) == n)
    print(f"tables this run never wrote to (left out of the figure): {size(untouched)}")
    _figures(b, totals, state_size, untouched)
    truncate_product_tables()


def _print_sizes(run_id: object, empty: int, rows: list[list], last: dict[str, int]) -> None:
    from durability.models import Snapshot

    print(f"empty product tables (indexes' first pages): {size(empty)}")
    snapshots = sorted(
        Snapshot.objects.filter(checkpoint__run_id=run_id).values_list("checkpoint__seq", flat=True)
    )
    print(f"snapshots at checkpoint seq {snapshots}")
    print(table(rows, ["steps", "state", "all product tables", "ratio", "growth /100 steps"]))
    print(
        table(
            [[name, size(n)] for name, n in sorted(last.items(), key=lambda kv: -kv[1])],
            ["table (after 500 steps)", "total relation size"],
        )
    )


def _figures(b: Bench, totals: dict[int, int], state_size: int, untouched: int) -> None:
    stored = totals[500] - untouched
    final = ratio(stored, state_size)
    b.add(
        "storage",
        "tables the run wrote to / final state after 500 x 1 KB",
        f"{size(stored)} / {size(state_size)} = {fmt_ratio(final)}"
        f" (with every empty table: {fmt_ratio(ratio(totals[500], state_size))})",
        "<= 4x",
        final <= 4.0,
    )
    # Linear growth: steps 300-500 cost about what steps 100-300 did. Quadratic growth
    # would make the later window 2x the earlier one ((500^2-300^2)/(300^2-100^2)). Windows
    # of 200 steps, because pages are allocated in steps that make 100-step windows jumpy;
    # the first 100 steps also pay for the empty tables' first pages, so they are left out.
    early = totals[300] - totals[100]
    late = totals[500] - totals[300]
    growth = ratio(late, early)
    b.add(
        "storage",
        "growth steps 300-500 / steps 100-300",
        f"{size(late)} / {size(early)} = {fmt_ratio(growth)}",
        "~1x (linear; quadratic 2x)",
        growth <= 1.3,
    )
