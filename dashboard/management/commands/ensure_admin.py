"""Create the first administrator (and the operator and viewer groups) if missing, and
print the sign-in details. The password is kept in ``var/admin-password`` so that running
``make up`` again prints it again."""

from __future__ import annotations

import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand

OPERATORS, VIEWERS = "operators", "viewers"


class Command(BaseCommand):
    help = "Create the admin user and the operator/viewer groups if they do not exist."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--username", default="admin")

    def handle(self, *args, **opts) -> None:
        for name in (OPERATORS, VIEWERS):
            Group.objects.get_or_create(name=name)
        users = get_user_model()
        keep = settings.VAR_DIR / "admin-password"
        username = opts["username"]
        user = users.objects.filter(username=username).first()
        if user is None:
            password = secrets.token_urlsafe(12)
            user = users.objects.create_superuser(username, "", password)
            user.groups.add(Group.objects.get(name=OPERATORS))
            keep.parent.mkdir(parents=True, exist_ok=True)
            keep.write_text(password + "\n")
            keep.chmod(0o600)
        elif keep.exists():
            password = keep.read_text().strip()
        else:
            password = "(unchanged; set one with: python manage.py changepassword admin)"
        self.stdout.write(
            self.style.SUCCESS(
                f"\n  Sign in at http://127.0.0.1:8000/ as {username} / {password}\n"
            )
        )
