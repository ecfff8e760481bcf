"""Operator actions on a run: resume, cancel, roll back, fork, resolve an effect in doubt.

Each view checks the role, validates the form, calls the engine (which re-checks everything
under the run's lock, writes the change and its audit event together, and refuses with a
coded error that changed nothing), then redirects to the run with what happened."""

from __future__ import annotations

import json
from html import escape
from typing import Any

from django.contrib import messages
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.utils.safestring import mark_safe
from django.views.decorators.http import require_http_methods, require_POST
from django_htmx.http import HttpResponseClientRedirect

from dashboard import drafts, graphruns, params, present, runinfo, states
from dashboard.forms import ForkForm, ReasonForm, ResolveForm, RollbackForm, SendForm
from dashboard.permissions import operator_required
from dashboard.submissions import AlreadySubmitted, spend
from dashboard.templatetags.dashboard import ago
from dashboard.views.common import explain, page, status_for
from durability import operations, rollbacks
from durability.agents import registry
from durability.errors import DurabilityError, InvalidInput, InvalidTransition, Stale
from durability.models import Checkpoint, Effect, EffectStatus, Event, Run
from durability.redact import redact


def _who(request: HttpRequest) -> str:
    return request.user.get_username()


def last_action(run: Run) -> str:
    """Who did what to the run last, to tell a second operator why they were refused."""
    event = Event.objects.filter(run=run).exclude(actor="").order_by("-id").first()
    if event is None:
        return ""
    why = f": “{event.reason}”" if event.reason else ""
    return (
        f"Last operator action: {event.get_kind_display()} by {event.actor}"
        f" {ago(event.created_at)}{why}."
    )


def refused(
    request: HttpRequest,
    run: Run | None,
    message: str,
    status: int,
    *,
    hint: str = "",
    title: str = "Refused",
) -> HttpResponse:
    context = {
        "title": title,
        "message": message,
        "hint": hint,
        "back": reverse("dashboard:run", args=[run.id]) if run is not None else "",
    }
    return page(request, "dashboard/error.html", context, fragment="message", status=status)


def _engine_refused(request: HttpRequest, run: Run, exc: DurabilityError) -> HttpResponse:
    hint = last_action(run) if isinstance(exc, InvalidTransition) else ""
    if isinstance(exc, Stale):
        # A form made on a version the run has left (a second tab, a colleague, the run
        # itself moved on): nothing was done, and the useful answer is the run as it is now.
        return land_on_run(request, run, f"Nothing was done: {explain(exc)} {hint}".strip())
    return refused(request, run, explain(exc), status_for(exc), hint=hint)


def land_on_run(request: HttpRequest, run: Run, notice: str) -> HttpResponse:
    """Back on the run's page with a notice: what a repeated or outdated submit gets
    instead of an error page, since nothing went wrong that the operator must fix."""
    messages.warning(request, notice)
    where = reverse("dashboard:run", args=[run.id])
    if getattr(request, "htmx", None):
        return HttpResponseClientRedirect(where)
    return redirect(where)


def _duplicate(request: HttpRequest, run: Run, dup: AlreadySubmitted) -> HttpResponse:
    first = dup.first
    outcome = f" {first.outcome}" if first.outcome else ""
    message = (
        f"This form was already submitted by {first.username} {ago(first.created_at)};"
        f" it was done once and is not done again.{outcome}"
    )
    return land_on_run(request, run, message)


NO_VERSION = (
    "This form does not say which version of the run it was made on (its hidden “version”"
    " field), so it cannot be told apart from a copy of a decision already carried out."
    " Nothing was changed: reload the run's page and act from there."
)


def _version(request: HttpRequest, field: str) -> int | None:
    """The run version the form was made on (the engine acts only if the run is still at it,
    so the decision happens once); None when the form lacks it or it is not a version."""
    raw = request.POST.get(field, "")
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        return None
    return int(raw)


def _spend_if_given(token: Any, *, action: str, request: HttpRequest, run: Run) -> Any:
    if token:
        return spend(token, action=action, username=_who(request), run_id=run.id)
    return None


# --- resume and cancel ------------------------------------------------------------------------


@require_POST
@operator_required
def resume(request: HttpRequest, ref: str) -> HttpResponse:
    run = states.run_or_404(ref)
    version = _version(request, "resume-version")
    if version is None:
        return refused(request, run, NO_VERSION, 400)
    form = ReasonForm(request.POST, prefix="resume")
    if not form.is_valid():
        return refused(request, run, "the reason is too long (2,000 characters at most)", 422)
    try:
        with transaction.atomic():
            sub = _spend_if_given(
                form.cleaned_data["token"], action="resume", request=request, run=run
            )
            resumed = operations.resume(
                run,
                by=_who(request),
                reason=form.cleaned_data["reason"],
                expected_status=form.cleaned_data["status"] or None,
                expected_version=version,
            )
            if sub is not None:
                sub.outcome = "The run was resumed."
                sub.save(update_fields=["outcome"])
    except AlreadySubmitted as dup:
        return _duplicate(request, run, dup)
    except DurabilityError as exc:
        return _engine_refused(request, run, exc)
    messages.success(request, f"Resumed: queued again from checkpoint #{resumed.head_seq}.")
    return redirect("dashboard:run", ref=str(run.id))


@require_POST
@operator_required
def cancel(request: HttpRequest, ref: str) -> HttpResponse:
    run = states.run_or_404(ref)
    version = _version(request, "cancel-version")
    if version is None:
        return refused(request, run, NO_VERSION, 400)
    form = ReasonForm(request.POST, prefix="cancel", reason_required=True)
    if not form.is_valid():
        return refused(request, run, "say why you cancel the run (the audit log keeps it)", 422)
    try:
        with transaction.atomic():
            sub = _spend_if_given(
                form.cleaned_data["token"], action="cancel", request=request, run=run
            )
            operations.cancel(
                run,
                by=_who(request),
                reason=form.cleaned_data["reason"],
                expected_version=version,
            )
            if sub is not None:
                sub.outcome = "The run was cancelled."
                sub.save(update_fields=["outcome"])
    except AlreadySubmitted as dup:
        return _duplicate(request, run, dup)
    except DurabilityError as exc:
        return _engine_refused(request, run, exc)
    messages.success(request, "Cancelled. A worker still executing it stops at its next write.")
    return redirect("dashboard:run", ref=str(run.id))


# --- roll back --------------------------------------------------------------------------------


@require_http_methods(["GET", "POST"])
@operator_required
def rollback(request: HttpRequest, ref: str) -> HttpResponse:
    run = states.run_or_404(ref)
    if request.method == "POST":
        return _rollback_post(request, run)
    to = params.text(request.GET, "to", 20)
    if not to:
        # "Roll back" undoes the run's most recent outside action first (DESIGN: "A
        # rollback never repays on its own"), not merely its last step.
        default = rollbacks.default_target(run)
        if default is None:
            return refused(
                request,
                run,
                f"run {run.short_id} has only its first checkpoint: nothing to roll back to",
                409,
            )
        to = str(default)
    target = states.checkpoint_or_404(run, to)
    try:
        plan = operations.plan_rollback(run, target.seq)
    except DurabilityError as exc:
        return refused(request, run, explain(exc), status_for(exc))
    form = RollbackForm(
        initial={
            "checkpoint_id": plan.target.id,
            "expected_head": run.head_seq,
            "expected_status": run.status,
            "version": run.lease_token,
        },
        effects=plan.done_not_undone,
    )
    return _rollback_page(request, run, plan, form)


def checkpoint_choices(
    run: Run, *, include_head: bool, selected: int, marked: int | None = None, mark: str = ""
) -> str:
    """The options of a checkpoint picker, newest first: each checkpoint's number, the step
    that made it and when (``marked`` gets ``mark``). One query, values only, the HTML made
    here and escaped (``html.escape``): a run can have thousands of checkpoints, and as
    many template loop turns (or ``format_html`` calls) would cost the page most of its time."""
    rows = (
        Checkpoint.objects.filter(run=run)
        .order_by("-seq")
        .values_list("seq", "step", "reason", "created_at")
    )
    options = []
    for seq, step, reason, at in rows:
        if seq == run.head_seq and not include_head:
            continue
        what = f"after {step}" if step else reason
        note = f" · {mark}" if seq == marked and mark else ""
        if seq == run.head_seq:
            note += " · head"
        label = escape(f"#{seq} · {what} · {at:%Y-%m-%d %H:%M:%S} UTC{note}")
        chosen = " selected" if seq == selected else ""
        options.append(f'<option value="{seq}"{chosen}>{label}</option>')
    return mark_safe("".join(options))  # every label is escaped above


def _rollback_page(
    request: HttpRequest,
    run: Run,
    plan: Any,
    form: RollbackForm,
    status: int = 200,
    error: str = "",
) -> HttpResponse:
    decisions: dict[int, str] = {}
    hold = True
    if form.is_bound and form.is_valid():
        decisions = form.decisions()
        hold = form.cleaned_data["then"] != "continue"
    context = {
        "nav": "runs",
        "run": run,
        "plan": plan,
        "form": form,
        "error": error,
        # What will happen, in plain words: the same sentences as `rollback --dry-run`.
        "sentences": plan.sentences(decisions, hold=hold),
        "checkpoints": checkpoint_choices(
            run,
            include_head=False,
            selected=plan.target.seq,
            marked=rollbacks.default_target(run),
            mark="last before the last effect",
        ),
    }
    return page(request, "dashboard/rollback.html", context, status=status)


def _rollback_post(request: HttpRequest, run: Run) -> HttpResponse:
    version = _version(request, "version")
    if version is None:
        return refused(request, run, NO_VERSION, 400)
    try:
        chosen = params.bounded(
            request.POST.get("checkpoint_id", ""), "checkpoint_id", maximum=params.ID_MAX
        )
        plan = operations.plan_rollback(run, checkpoint_id=chosen)
    except (DurabilityError, params.BadParameter) as exc:
        form = RollbackForm(request.POST)
        form.is_valid()
        detail = _errors(form) or (explain(exc) if isinstance(exc, DurabilityError) else str(exc))
        return refused(request, run, "the confirmation form is incomplete: " + detail, 422)
    form = RollbackForm(request.POST, effects=plan.done_not_undone)
    if not form.is_valid():
        return _rollback_page(request, run, plan, form, 422)
    if request.POST.get("action") == "preview":
        return _rollback_page(request, run, plan, form)
    try:
        result = _roll_back(request, run, form, version)
    except AlreadySubmitted as dup:
        return _duplicate(request, run, dup)
    except InvalidInput as exc:
        if isinstance(exc, InvalidTransition):
            return _engine_refused(request, run, exc)
        return _rollback_page(request, run, plan, form, 422, error=explain(exc))
    except DurabilityError as exc:
        return _engine_refused(request, run, exc)
    messages.success(request, _rolled_back(result))
    return redirect(
        "dashboard:checkpoint",
        ref=str(run.id),
        seq=result.checkpoint.seq,  # type: ignore[union-attr]
    )


def _roll_back(request: HttpRequest, run: Run, form: Any, version: int) -> Any:
    """The confirmed rollback and its submission record, in one transaction."""
    data = form.cleaned_data
    with transaction.atomic():
        sub = spend(data["token"], action="rollback", username=_who(request), run_id=run.id)
        # A second operator (or the run itself) may have moved the head since the
        # confirmation was shown: the engine refuses then.
        result = operations.rollback(
            run,
            checkpoint_id=data["checkpoint_id"],
            by=_who(request),
            reason=data["reason"],
            and_continue=data["then"] == "continue",
            decisions=form.decisions(),
            expected_head=data["expected_head"],
            expected_status=data["expected_status"] or None,
            expected_version=version,
        )
        sub.outcome = (
            f"It rolled the run back to #{result.target.seq} (new head"
            f" #{result.checkpoint.seq})."  # type: ignore[union-attr]
        )
        sub.save(update_fields=["outcome"])
    return result


def _rolled_back(result: Any) -> str:
    if result.held:
        then = (
            " The run is on hold: nothing runs until someone continues it"
            f"{' (next step: ' + result.will_run_from + ')' if result.will_run_from else ''}."
        )
    elif result.will_run_from:
        then = f" It continues with {result.will_run_from}."
    else:
        then = " That was its end: it is marked succeeded."
    return f"Rolled back to #{result.target.seq}: new head #{result.checkpoint.seq}.{then}"  # type: ignore[union-attr]


def _errors(form: Any) -> str:
    return "; ".join(f"{k}: {' '.join(v)}" for k, v in form.errors.items())


# --- fork -------------------------------------------------------------------------------------


def _check_fork(run: Run, seq: int, state: Any, by: str) -> None:
    """The engine's own validation of this fork, writing nothing."""
    operations.check_fork(run, seq, state)


@require_http_methods(["GET", "POST"])
@operator_required
def fork(request: HttpRequest, ref: str) -> HttpResponse:
    run = states.run_or_404(ref)
    if (elsewhere := graphruns.refusal(run, "fork it")) is not None:
        return _engine_refused(request, run, elsewhere)  # no editor for what cannot be done
    source = request.POST if request.method == "POST" else request.GET
    cp = states.checkpoint_or_404(run, source.get("from_seq") or source.get("from") or run.head_seq)
    loaded = states.load(cp)
    if not loaded.ok:
        return refused(request, run, loaded.error, 409)
    context: dict[str, Any] = {
        "nav": "runs",
        "run": run,
        "checkpoint": cp,
        "schema": _schema_text(run),
        "checkpoints": checkpoint_choices(run, include_head=True, selected=cp.seq),
        "done_after": _effects_done_after(run, cp.seq),
    }
    if request.method == "GET":
        shown, _ = redact(loaded.state)
        form = ForkForm(
            initial={"from_seq": cp.seq, "state": json.dumps(shown, indent=2, ensure_ascii=False)}
        )
        return page(request, "dashboard/fork.html", {**context, "form": form})
    form = ForkForm(request.POST)
    checking = request.POST.get("action") == "check"
    if not form.is_valid():
        return page(request, "dashboard/fork.html", {**context, "form": form}, status=422)
    data = form.cleaned_data
    try:
        if checking:
            _check_fork(run, cp.seq, data["state"], _who(request))
            context["checked"] = True
            return page(request, "dashboard/fork.html", {**context, "form": form})
        with transaction.atomic():
            sub = spend(data["token"], action="fork", username=_who(request), run_id=run.id)
            new = operations.fork(
                run,
                cp.seq,
                state=data["state"],
                what_if=data["mode"] == "what_if",
                by=_who(request),
                reason=data["reason"],
            )
            sub.outcome = f"It created run {new.id}."
            sub.result_run_id = new.id
            sub.save(update_fields=["outcome", "result_run_id"])
    except AlreadySubmitted as dup:
        return _duplicate(request, run, dup)
    except InvalidInput as exc:
        if isinstance(exc, InvalidTransition):
            return _engine_refused(request, run, exc)
        form.add_error("state", explain(exc))
        return page(request, "dashboard/fork.html", {**context, "form": form}, status=422)
    except DurabilityError as exc:
        return _engine_refused(request, run, exc)
    return _forked(request, run, cp.seq, new, what_if=data["mode"] == "what_if")


def _forked(request: HttpRequest, run: Run, seq: int, new: Run, *, what_if: bool) -> HttpResponse:
    how = "what-if: its effects are recorded, not performed" if what_if else "live"
    messages.success(request, f"Forked from #{seq} of {run.short_id} into this new run ({how}).")
    return redirect("dashboard:run", ref=str(new.id))


def _effects_done_after(run: Run, seq: int) -> list[str]:
    """What the run performed after checkpoint ``seq`` (on any branch), in the agent's words:
    what a live fork taking the same path performs again."""
    done = Effect.objects.filter(run=run, status=EffectStatus.DONE, base__seq__gte=seq)
    return [rollbacks.words_for(e) for e in done.order_by("id")[:20]]


def _schema_text(run: Run) -> str:
    """The agent's state schema as JSON, for reference beside the editor."""
    try:
        definition = registry.get(run.agent)
    except DurabilityError:
        return ""
    schema = definition.schema
    if schema is None:
        return ""
    if hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    try:
        return json.dumps(schema, indent=2, sort_keys=True)
    except TypeError:
        return ""


# --- effects in doubt -------------------------------------------------------------------------


@require_http_methods(["GET", "POST"])
@operator_required
def resolve(request: HttpRequest, ref: str, effect_id: int) -> HttpResponse:
    run = states.run_or_404(ref)
    effect = None
    if 0 < effect_id <= params.ID_MAX:
        effect = Effect.objects.filter(run=run, pk=effect_id).select_related("base").first()
    if effect is None:
        return refused(request, run, f"run {run.short_id} has no effect {effect_id}", 404)
    context = _resolve_context(run, effect)
    if request.method == "GET":
        form = ResolveForm(initial={"attempts": effect.attempts, "version": run.lease_token})
        return page(request, "dashboard/resolve.html", {**context, "form": form})
    version = _version(request, "version")
    if version is None:
        return refused(request, run, NO_VERSION, 400)
    form = ResolveForm(request.POST)
    if not form.is_valid():
        if effect.status != EffectStatus.IN_DOUBT:
            # Its page shows no form to put the errors on: say why there is none.
            by = f" It was resolved by {effect.resolved_by}." if effect.resolved_by else ""
            message = f"effect {effect.key} is {effect.get_status_display()}: nothing to resolve."
            return refused(request, run, message + by, 409)
        return page(request, "dashboard/resolve.html", {**context, "form": form}, status=422)
    data = form.cleaned_data
    try:
        _resolve(request, run, effect, data, version)
    except AlreadySubmitted as dup:
        return _duplicate(request, run, dup)
    except InvalidTransition as exc:
        effect.refresh_from_db()
        hint = f"It was resolved by {effect.resolved_by}." if effect.resolved_by else ""
        if isinstance(exc, Stale):
            return land_on_run(request, run, f"Nothing was done: {explain(exc)} {hint}".strip())
        return refused(request, run, explain(exc), 409, hint=hint)
    except DurabilityError as exc:
        form.add_error(None, explain(exc))
        return page(
            request, "dashboard/resolve.html", {**context, "form": form}, status=status_for(exc)
        )
    messages.success(request, f"Effect {effect.key} marked {data['outcome']}; the run continues.")
    return redirect("dashboard:run", ref=str(run.id))


def _resolve_context(run: Run, effect: Effect) -> dict[str, Any]:
    return {
        "nav": "runs",
        "run": run,
        "effect": effect,
        "args": runinfo.effect_args(effect),
        "result": present.show(json.loads(effect.result), limit=2000, pretty=True)
        if effect.result
        else None,
    }


def _resolve(
    request: HttpRequest, run: Run, effect: Effect, data: dict[str, Any], version: int
) -> None:
    """The operator's word on an effect in doubt and its submission record, together."""
    with transaction.atomic():
        sub = _spend_if_given(data["token"], action="resolve", request=request, run=run)
        operations.resolve_effect(
            run,
            effect.pk,
            outcome=data["outcome"],
            result=data.get("result_value"),
            by=_who(request),
            note=data["note"],
            expected_attempts=data["attempts"],
            expected_version=version,
        )
        if sub is not None:
            sub.outcome = f"It marked effect {effect.key} {data['outcome']}."
            sub.save(update_fields=["outcome"])


# --- messages -----------------------------------------------------------------------------------


@require_POST
@operator_required
def send(request: HttpRequest, ref: str) -> HttpResponse:
    """Send a message to a run (a chat turn, a reply it waits for). The form's one-time
    token is the message's idempotency key: a double submit delivers it once. Without the
    token, the engine keys the message by the run version the form was made on and its
    contents: the same message posted again on that version is still delivered once."""
    run = states.run_or_404(ref)
    version = _version(request, "send-version")
    if version is None:
        return refused(request, run, NO_VERSION, 400)
    form = SendForm(request.POST, prefix="send")
    if not form.is_valid():
        return refused(request, run, _errors(form), 422)
    data = form.cleaned_data
    try:
        operations.send(
            run,
            data["name"],
            data["value"],
            idempotency_key=f"dashboard:{data['token']}" if data["token"] else "",
            by=_who(request),
            expected_version=version,
        )
    except InvalidTransition as exc:
        # The run moved on since the page was drawn (or finished): the page as it is now,
        # what was typed not lost.
        run.refresh_from_db()
        return _not_sent(request, run, form, explain(exc))
    except DurabilityError as exc:
        return _engine_refused(request, run, exc)
    messages.success(request, f"Message {data['name']!r} sent.")
    return redirect("dashboard:run", ref=str(run.id))


def _not_sent(request: HttpRequest, run: Run, form: SendForm, why: str) -> HttpResponse:
    """Back on the run's page, saying why nothing was sent, with the operator's text put
    back in the form, or quoted when the run no longer waits for a message."""
    text, as_json = form.cleaned_data["data"], bool(form.cleaned_data["as_json"])
    if drafts.waits_for_message(run):
        drafts.keep(request, run, text, as_json)
        kept = "What you typed is back in the form: check the run and send it again."
    elif text.strip():
        kept = f"It no longer waits for a message; what you typed was: {drafts.quoted(text)}"
    else:
        kept = "It no longer waits for a message."
    return land_on_run(request, run, f"Nothing was sent: {why} {kept}")
