"""The engine's models: runs, checkpoints (snapshot or delta), the mutation log, the journal
of calls, effects, approvals and the event timeline.

State and patches are stored as canonical JSON text (never jsonb: the hashes are computed
over exactly these bytes). A run's status changes only through ``durability.lifecycle``,
not here; these classes hold data and small derived properties.
"""

from durability.models.events import (
    Event,
    EventKind,
    EventQuerySet,
    RateBucket,
    WorkerPresence,
)
from durability.models.history import (
    Checkpoint,
    CheckpointReason,
    Mutation,
    Snapshot,
)
from durability.models.records import (
    AbandonedEffect,
    Approval,
    ApprovalStatus,
    CallKind,
    Effect,
    EffectStatus,
    JournalEntry,
    Message,
    Repeat,
)
from durability.models.runs import (
    FINISHED,
    RECOVERY_POINTS,
    TIMED_WAITS,
    Durability,
    Run,
    RunStatus,
    WaitReason,
)

__all__ = [
    "AbandonedEffect",
    "Approval",
    "ApprovalStatus",
    "CallKind",
    "Checkpoint",
    "CheckpointReason",
    "Durability",
    "Effect",
    "EffectStatus",
    "Event",
    "EventKind",
    "EventQuerySet",
    "FINISHED",
    "JournalEntry",
    "Message",
    "Mutation",
    "RECOVERY_POINTS",
    "RateBucket",
    "Repeat",
    "Run",
    "RunStatus",
    "Snapshot",
    "TIMED_WAITS",
    "WaitReason",
    "WorkerPresence",
]
