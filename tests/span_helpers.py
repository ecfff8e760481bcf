"""Spans as the engine makes them, for tests that compare what reaches processors and
exporters."""

from __future__ import annotations

import pytest

from durability import telemetry


def steps_with_a_failing_call() -> None:
    """An execution, a step, a call that raises, a commit sent ahead, an event on the step."""
    with telemetry.tracer().start_as_current_span("run x"):
        with telemetry.step("plan", 3, 1) as step:
            with pytest.raises(ValueError), telemetry.call("llm", "agents.ask", "call") as call:
                telemetry.describe_result(
                    call, {"model": "m1", "usage": {"prompt_tokens": 5, "completion_tokens": 7}}
                )
                raise ValueError("rate limited")
            telemetry.note("call.replayed", key="llm", occurrence=None)
            commit = telemetry.start_commit("r-1", 4, 1200, 300, False)
            telemetry.set_attributes(step, **{"durability.step.next": "act"})
        telemetry.end_commit(commit)
