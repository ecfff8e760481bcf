"""The API's typed shapes (pydantic, through django-ninja): what the OpenAPI document
publishes and what every request body is validated against before the engine is called."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from ninja import Field, Schema
from pydantic import AfterValidator, ConfigDict

from durability.models import RunStatus, WaitReason

JSON = Any  # any JSON value


def _no_nul(value: str) -> str:
    # The database's text columns cannot hold NUL; refuse it here, with the field's name.
    if "\x00" in value:
        raise ValueError("text may not contain NUL characters")
    return value


Text = Annotated[str, AfterValidator(_no_nul)]


class Body(Schema):
    """A request body: a field it does not know is refused, not ignored (a misspelt
    ``dry_run`` would otherwise roll back for real), and values are taken as the JSON types
    they are declared as (``"yes"`` is no ``true``, ``"3"`` no checkpoint number)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ProblemOut(Schema):
    """RFC 9457 problem details, with the engine's error code and the field at fault."""

    type: str
    title: str
    status: int
    code: str = Field(..., description="the engine's error code, e.g. DUR112 (stale)")
    detail: str
    field: str | None = None
    run_id: str | None = None


class LeaseOut(Schema):
    owner: str
    expires_at: datetime | None
    heartbeat_at: datetime | None


class RunOut(Schema):
    id: str
    agent: str
    agent_version: str
    status: str
    version: int = Field(..., description="the run's version: send it back as If-Match")
    head: int = Field(..., description="the number of the head checkpoint")
    step: str
    waiting_for: str | None = Field(
        None,
        description="what a waiting run waits for: approval, message, timer, in_doubt, retry,"
        " children, version, concurrency, rate_limit, hold; a LangGraph graph executed in its"
        " own process: graph (to go on) or interrupt (an answer)",
    )
    wait_detail: str
    outcome: str
    error: str
    error_code: str
    attempts: int
    recoveries: int
    durability: str
    legal_hold: bool = Field(..., description="kept whole: never pruned or compacted")
    created_by: str
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    parent_run: str | None
    forked_from: str | None
    forked_from_seq: int | None
    trace_id: str | None


class GraphInterruptOut(Schema):
    node: str
    value: JSON = None
    id: str | None = Field(None, description="the key of its answer: Command(resume={id: ...})")


class GraphErrorOut(Schema):
    node: str
    error: str


class GraphTaskOut(Schema):
    node: str
    wrote: list[str] = Field(..., description="the channels the task wrote")
    routes: list[str] = Field(..., description="the nodes it routed to")
    error: str | None
    interrupts: list[JSON]
    answers: list[JSON]


class GraphSuperstepOut(Schema):
    seq: int = Field(..., description="the run's checkpoint number")
    title: str
    source: str = Field(..., description="LangGraph's: input, loop, update, fork")
    step: JSON = None
    checkpoint_id: str = Field(..., description="LangGraph's checkpoint id")
    tasks: list[GraphTaskOut] = Field(..., description="the tasks that made this checkpoint")


class GraphCopiedFromOut(Schema):
    thread_id: str
    run: str = Field(..., description="the id of the run it was copied from")


class GraphOut(Schema):
    """A LangGraph graph executed in its own process (DurableSaver): no worker executes it,
    so resume, cancel, rollback, fork, decide, resolve and send are refused (DUR120)."""

    executed_by: str
    thread_id: str | None
    checkpoint_ns: str | None
    copied_from: GraphCopiedFromOut | None = Field(
        None, description="the thread it was copied from (copy_thread), if it is a copy"
    )
    next: list[str] = Field(..., description="the nodes its latest checkpoint runs next")
    interrupts: list[GraphInterruptOut] = Field(..., description="the interrupts waiting")
    errors: list[GraphErrorOut]
    how_to_continue: str | None = Field(
        None, description="the call, in the graph's own process, that continues it"
    )
    supersteps: list[GraphSuperstepOut] = Field(..., description="the latest, oldest first")


class RunDetailOut(RunOut):
    input: JSON
    lease: LeaseOut
    children: list[str]
    pending_approvals: list[int]
    langgraph: GraphOut | None = Field(
        None, description="set for a LangGraph graph executed in its own process, else null"
    )


class RunPage(Schema):
    items: list[RunOut]
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next page")


class StartIn(Body):
    agent: Text = Field(..., min_length=1, max_length=200)
    input: JSON = None
    reason: Text = Field("", max_length=2000)
    durability: Text | None = Field(None, max_length=20)


RunState = Literal[tuple(RunStatus.values)]  # type: ignore[valid-type]
WaitingFor = Literal[tuple(v for v in WaitReason.values if v)]  # type: ignore[valid-type]
EXPECTED_STATUS = (
    "the run's status as the caller saw it: refused (409, DUR112) if it is another now"
)


class ReasonIn(Body):
    reason: Text = Field("", max_length=2000)


class ActIn(ReasonIn):
    expected_status: RunState | None = Field(None, description=EXPECTED_STATUS)


class ApprovalOut(Schema):
    id: int
    run_id: str
    agent: str
    name: str
    step: str
    status: str
    payload: JSON
    edited_payload: JSON = None
    editable: list[str] | None = Field(
        None,
        description="the fields an edit may change; null: any (typed by its asked value);"
        " empty: none, approve or reject as asked",
    )
    group: str = Field(..., description="the policy group that decides (empty: operators)")
    may_decide: bool = Field(..., description="whether the caller may decide it")
    run_version: int = Field(..., description="send it back as If-Match to decide")
    requested_at: datetime
    deadline: datetime | None
    decided_by: str
    decided_at: datetime | None
    comment: str


class ApprovalPage(Schema):
    items: list[ApprovalOut]
    next_cursor: str | None = None


class DecisionIn(Body):
    approve: bool
    comment: Text = Field("", max_length=2000)
    payload: JSON = Field(
        None,
        description="approve with edits: the corrected payload; of an object, only the fields"
        " it changes (the rest keep their asked values); any JSON value where the approval"
        " asked one (a LangGraph interrupt's text, say)",
    )


class MessageIn(Body):
    name: Text = Field(..., min_length=1, max_length=200)
    data: JSON = None
    reason: Text = Field("", max_length=2000)


class MessageOut(Schema):
    id: int
    run_id: str
    name: str
    data: JSON
    sent_by: str
    created_at: datetime
    consumed: bool


class CheckpointOut(Schema):
    seq: int
    parent: int | None
    reason: str
    step: str
    next_step: str
    state_hash: str
    chain_hash: str
    schema_version: int
    agent_version: str
    size: int
    delta_size: int
    created_by: str
    created_at: datetime


class CheckpointPage(Schema):
    items: list[CheckpointOut]
    next_cursor: str | None = None


class DiffOp(Schema):
    op: str
    path: str
    value: JSON = None


class DiffOut(Schema):
    run_id: str
    from_seq: int
    to_seq: int
    to_run_id: str
    changes: list[DiffOp]


class MutationsOut(Schema):
    run_id: str
    seq: int
    ops: list[DiffOp] = Field(..., description="the RFC 6902 operations from its parent")


class VerifyOut(Schema):
    run_id: str
    ok: bool
    checked: int
    problems: list[str]


class RollbackIn(Body):
    checkpoint: int = Field(..., ge=0, le=2**31 - 1, description="the checkpoint number")
    reason: Text = Field("", max_length=2000)
    dry_run: bool = Field(False, description="only say what it would do; change nothing")
    and_continue: bool = Field(False, description="queue the run at once instead of holding")
    decisions: dict[str, Text] = Field(
        default_factory=dict,
        description="effect id -> ask, reuse, again or compensate (default: ask)",
    )
    expected_head: int | None = Field(
        None,
        ge=0,
        le=2**31 - 1,
        description="the head checkpoint the preview was read at: refused (409, DUR112) if"
        " the run moved on since, so that nothing is undone that the preview did not show",
    )
    expected_status: RunState | None = Field(None, description=EXPECTED_STATUS)


class EffectDoneOut(Schema):
    id: int
    key: str
    what: str
    status: str
    seq: int
    can_compensate: bool
    choices: list[str]


class RollbackOut(Schema):
    run_id: str
    target: int
    preview_head: int | None = Field(
        None,
        description="a preview's: the head it was read at; send it as expected_head to roll"
        " back only if nothing happened since",
    )
    dry_run: bool
    will_run_from: str
    effects: list[EffectDoneOut]
    sentences: list[str] = Field(..., description="the preview in plain words")
    held: bool
    new_head: int | None
    run: RunDetailOut | None


class ForkIn(Body):
    checkpoint: int = Field(..., ge=0, le=2**31 - 1)
    state: dict[str, JSON] | None = Field(None, description="an edited state (validated)")
    what_if: bool = False
    reason: Text = Field("", max_length=2000)


class HoldIn(Body):
    hold: bool = Field(..., description="true: put on legal hold; false: release it")
    reason: Text = Field("", max_length=2000)


class ResolveIn(Body):
    outcome: Text = Field(..., pattern="^(done|failed|retry)$")
    result: JSON = None
    note: Text = Field("", max_length=2000)


class EffectOut(Schema):
    id: int
    run_id: str
    key: str
    status: str
    attempts: int
    resolved_by: str
    resolution_note: str


class EventOut(Schema):
    id: int
    kind: str
    seq: int | None
    step: str
    actor: str
    reason: str
    worker: str
    data: JSON
    created_at: datetime


class EventPage(Schema):
    items: list[EventOut]
    next_cursor: str | None = None


class IndicatorOut(Schema):
    key: str
    label: str
    unit: str
    value: float | None
    target: float | None
    met: bool | None
    total: int
    bad: int
    budget: float | None


class SloOut(Schema):
    window: str
    agent: str | None
    start: datetime
    end: datetime
    indicators: list[IndicatorOut]


class SloPerAgentOut(Schema):
    window: str
    agents: dict[str, list[IndicatorOut]]


class EffectRowOut(Schema):
    id: int
    key: str
    occurrence: int
    step: str
    function: str
    label: str
    status: str
    idempotency_key: str
    args: JSON
    result: JSON
    error: str
    attempts: int
    duplicates_prevented: int = Field(
        ...,
        description="times a re-run reached the effect, found it done and returned its"
        " recorded outcome instead of performing it again",
    )
    idempotent: bool
    resolved_by: str
    created_at: datetime
    completed_at: datetime | None


class EffectPage(Schema):
    items: list[EffectRowOut]
    next_cursor: str | None = None


class CallOut(Schema):
    id: int
    key: str
    occurrence: int
    kind: str
    step: str
    function: str
    result: JSON
    duration_ms: float
    replays: int
    reused_from: int | None = Field(
        None,
        description="in a what-if fork: the id of the source run's call it reused instead of"
        " calling again (null: called)",
    )
    created_at: datetime


class CallPage(Schema):
    items: list[CallOut]
    next_cursor: str | None = None
