from django.urls import URLPattern, path

from dashboard.middleware import answered, login_required, no_nul
from dashboard.permissions import reader_required
from dashboard.views import actions, approvals, audit, diff, run, runs, slo, start

app_name = "dashboard"

urlpatterns = [
    path("", runs.runs, name="runs"),
    path("runs/new/", start.start, name="start"),  # before runs/<ref>/, which would take "new"
    path("runs/<str:ref>/", run.run_detail, name="run"),
    path("runs/<str:ref>/checkpoints/", run.checkpoint_list, name="checkpoints"),
    path("runs/<str:ref>/checkpoints/<int:seq>/", run.checkpoint_detail, name="checkpoint"),
    path("runs/<str:ref>/checkpoints/<int:seq>/tree/", run.tree, name="tree"),
    path("runs/<str:ref>/checkpoints/<int:seq>/state.json", run.state_json, name="state_json"),
    path("runs/<str:ref>/timeline/", run.timeline_earlier, name="timeline"),
    path("runs/<str:ref>/diff/", diff.diff, name="diff"),
    path("runs/<str:ref>/diff/words/", diff.diff_words, name="diff_words"),
    path("runs/<str:ref>/resume/", actions.resume, name="resume"),
    path("runs/<str:ref>/cancel/", actions.cancel, name="cancel"),
    path("runs/<str:ref>/rollback/", actions.rollback, name="rollback"),
    path("runs/<str:ref>/fork/", actions.fork, name="fork"),
    path("runs/<str:ref>/send/", actions.send, name="send"),
    path("runs/<str:ref>/effects/<int:effect_id>/resolve/", actions.resolve, name="resolve"),
    path("approvals/", approvals.inbox, name="approvals"),
    path("approvals/<int:pk>/", approvals.approve_with_edits, name="approval"),
    path("approvals/<int:pk>/decide/", approvals.decide, name="decide"),
    path("slo/", slo.slo_page, name="slo"),
    path("audit/", audit.audit, name="audit"),
    path("notifications/", audit.notifications, name="notifications"),
]


def _guarded(pattern: URLPattern) -> URLPattern:
    # Every dashboard page needs a login and a role (viewer, operator or superuser), takes no
    # NUL character in a parameter, and says what was wrong with a request it refuses:
    # checked here once, not remembered per view.
    pattern.callback = login_required(reader_required(no_nul(answered(pattern.callback))))
    return pattern


urlpatterns = [_guarded(p) for p in urlpatterns]
