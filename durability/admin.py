"""Read-only admin over the store: the operator's view until the dashboard lands. Changes go
through the engine's operations (the CLI), never through admin forms."""

from django.contrib import admin

from durability.models import Approval, Checkpoint, Effect, Event, JournalEntry, Run


class ReadOnly(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class CheckpointInline(admin.TabularInline):
    model = Checkpoint
    fields = (
        "seq",
        "reason",
        "step",
        "next_step",
        "size",
        "delta_size",
        "state_hash",
        "created_at",
    )
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True
    ordering = ("-seq",)

    def has_add_permission(self, request, obj=None):
        return False


class EventInline(admin.TabularInline):
    model = Event
    fields = ("created_at", "kind", "seq", "step", "actor", "worker", "reason")
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ("-id",)

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Run)
class RunAdmin(ReadOnly):
    list_display = (
        "id",
        "agent",
        "agent_version",
        "status",
        "wait_reason",
        "step",
        "head_seq",
        "attempts",
        "created_at",
        "updated_at",
    )
    list_filter = ("status", "agent", "wait_reason")
    search_fields = ("id", "input", "error")
    date_hierarchy = "created_at"
    inlines = [CheckpointInline, EventInline]


@admin.register(Checkpoint)
class CheckpointAdmin(ReadOnly):
    list_display = ("run", "seq", "reason", "step", "next_step", "size", "delta_size", "created_at")
    list_filter = ("reason",)
    search_fields = ("run__id",)


@admin.register(Approval)
class ApprovalAdmin(ReadOnly):
    list_display = ("run", "name", "status", "requested_at", "decided_by", "decided_at")
    list_filter = ("status", "name")


@admin.register(Effect)
class EffectAdmin(ReadOnly):
    list_display = (
        "run",
        "key",
        "status",
        "idempotency_key",
        "attempts",
        "duplicates_prevented",
        "created_at",
    )
    list_filter = ("status",)


@admin.register(JournalEntry)
class JournalAdmin(ReadOnly):
    list_display = ("run", "key", "occurrence", "kind", "function", "duration_ms", "created_at")
    list_filter = ("kind",)


@admin.register(Event)
class EventAdmin(ReadOnly):
    list_display = ("created_at", "run", "kind", "seq", "step", "actor", "worker")
    list_filter = ("kind",)
