"""Who may do what, one rule for every way in (the dashboard's pages, the JSON API):
viewers read; operators (members of the "operators" group, and superusers) act; an account
in neither group reads nothing. Deciding an approval whose policy names a group is further
narrowed to the operators in that group (``operations.check_may_decide``, under the run's
lock)."""

from __future__ import annotations

from typing import Any

from durability.errors import NotAllowed

OPERATORS = "operators"
VIEWERS = "viewers"

NOT_OPERATOR = (
    "Only operators may approve, reject, resume, roll back, fork, cancel or resolve. "
    "Your account can view runs but not change them; ask an administrator to add you to "
    'the "operators" group.'
)


def groups(user: Any) -> frozenset[str]:
    # One query per request, cached on the user object: a page asks once per button.
    cached = getattr(user, "_durability_groups", None)
    if cached is None:
        cached = frozenset(user.groups.values_list("name", flat=True))
        user._durability_groups = cached
    return cached


def active(user: Any) -> bool:
    return bool(getattr(user, "is_authenticated", False) and user.is_active)


def is_operator(user: Any) -> bool:
    if not active(user):
        return False
    return bool(user.is_superuser or OPERATORS in groups(user))


def is_reader(user: Any) -> bool:
    """Whether ``user`` may read runs: viewers, operators, superusers."""
    if not active(user):
        return False
    return bool(user.is_superuser or groups(user) & {VIEWERS, OPERATORS})


def may_decide(user: Any, approval: Any) -> bool:
    """An operator, and when the approval's policy names a group, an operator in that group
    (superusers always)."""
    if not is_operator(user):
        return False
    group = getattr(approval, "group", "")
    return bool(not group or user.is_superuser or group in groups(user))


def role_of(user: Any) -> str:
    if is_operator(user):
        return "operator"
    return "viewer" if is_reader(user) else "none"


def no_role_message(user: Any) -> str:
    return (
        f"Your account “{user.get_username()}” has no role yet, so it cannot see runs. Ask"
        " an administrator (or one of your operators, who know who administers it) to add"
        f' you to the "{VIEWERS}" group to read runs, or to the "{OPERATORS}" group to act'
        " on them."
    )


def require_reader(user: Any) -> None:
    """Refuse (``NotAllowed``) an account that may not read runs."""
    if not is_reader(user):
        raise NotAllowed(no_role_message(user))


def require_operator(user: Any) -> None:
    """Refuse (``NotAllowed``) an account that may not act on runs."""
    require_reader(user)
    if not is_operator(user):
        raise NotAllowed(NOT_OPERATOR)
