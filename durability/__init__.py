"""Durable, observable AI agent runs.

What agent authors import::

    from durability import Agent, END, Transient, RateLimited, Permanent, RetryPolicy

    agent = Agent("research", version=3, schema=ResearchState,
                  retry=RetryPolicy(max_retries=6, base=0.5, cap=10))

    @agent.step(start=True)
    def think(state, ctx):
        answer = ctx.call("llm", llm.complete, state["messages"])
        ...
        return "act"

    # An operator may edit amount_eur only (RefundEdit, a pydantic model), and
    # within_price(asked, edited) -> error sentence | None checks it when they decide.
    decision = ctx.approval("refund", {"order": "A-1", "amount_eur": 349.0},
                            editable=RefundEdit, validate=within_price)

Operations on runs (``start``, ``resume``, ``rollback``, ``fork``, ``cancel``, ``decide``,
``resolve_effect``, ``verify``) are importable from here too once Django is set up.
"""

from durability.agents import END, Agent, registry
from durability.errors import (
    AlreadyDecided,
    DurabilityError,
    EffectFailed,
    IntegrityViolation,
    InvalidInput,
    InvalidTransition,
    NonDeterminismError,
    Permanent,
    RateLimited,
    SchemaViolation,
    StateNotJSON,
    StateTooLarge,
    StepTimeout,
    Transient,
    UnknownAgent,
    UnknownCheckpoint,
    UnknownRun,
)
from durability.policies import DurabilityPolicy, Limits, Retention, RetryPolicy

_OPERATIONS = (
    "start",
    "resume",
    "rollback",
    "plan_rollback",
    "fork",
    "cancel",
    "decide",
    "resolve_effect",
    "send",
    "tree",
    "verify",
    "get_run",
    "state_at",
)

__all__ = [
    "END",
    "NOT_DONE",
    "Agent",
    "AlreadyDecided",
    "BlobRef",
    "Context",
    "Decision",
    "DurabilityError",
    "DurabilityPolicy",
    "EditRefused",
    "EffectFailed",
    "IntegrityViolation",
    "InvalidInput",
    "InvalidTransition",
    "Limits",
    "NonDeterminismError",
    "Permanent",
    "RateLimited",
    "Retention",
    "RetryPolicy",
    "SchemaViolation",
    "StateNotJSON",
    "StateTooLarge",
    "StepTimeout",
    "Transient",
    "UnknownAgent",
    "UnknownCheckpoint",
    "UnknownRun",
    "registry",
    *_OPERATIONS,
]


def __getattr__(name: str):
    # Models cannot be imported before Django's app registry is ready, and agent modules
    # import this package while it loads: the model-backed names are resolved lazily.
    if name in _OPERATIONS:
        from durability import operations

        return getattr(operations, name)
    if name == "BlobRef":
        from pydantic import BaseModel, ConfigDict, Field

        class BlobRef(BaseModel):
            """For state schemas: a field that may hold a large value moved to the blob
            store, e.g. ``document: str | BlobRef``."""

            model_config = ConfigDict(populate_by_name=True)
            blob: str = Field(alias="$blob")
            bytes: int
            kind: str

        globals()["BlobRef"] = BlobRef
        return BlobRef
    if name == "EditRefused":
        from durability.approvals import EditRefused

        return EditRefused
    if name in ("Context", "Decision", "NOT_DONE"):
        from durability.runtime import context

        return getattr(context, name)
    raise AttributeError(f"module 'durability' has no attribute {name!r}")
