"""Create the first administrator (and the operator and viewer groups) if missing, and
print the sign-in details. The password is kept in ``var/admin-password`` so that running
``make up`` again prints it again.

A password given with ``--password`` or ``DURABILITY_ADMIN_PASSWORD`` (sets it on an existing
account too) passes Django's password validators first: a rejected one prints their
sentences and nothing is created or changed."""

from __future__ import annotations

import os
import secrets

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from dashboard.permissions import OPERATORS, VIEWERS


class Command(BaseCommand):
    help = "Create the admin user and the operator/viewer groups if they do not exist."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--username", default="admin")
        parser.add_argument(
            "--password",
            default="",
            help="the password to set (default: DURABILITY_ADMIN_PASSWORD, else a random one"
            " for a new account)",
        )

    def handle(self, *args, **opts) -> None:
        users = get_user_model()
        keep = settings.VAR_DIR / "admin-password"
        username = opts["username"]
        chosen = opts["password"] or os.environ.get("DURABILITY_ADMIN_PASSWORD", "")
        user = users.objects.filter(username=username).first()
        password = chosen or (secrets.token_urlsafe(12) if user is None else "")
        if password:
            try:
                validate_password(password, user or users(username=username))
            except ValidationError as exc:
                raise CommandError(
                    f"the password for {username} was refused, nothing was changed: "
                    + " ".join(exc.messages)
                ) from None
        with transaction.atomic():
            for name in (OPERATORS, VIEWERS):
                Group.objects.get_or_create(name=name)
            if user is None:
                user = users.objects.create_superuser(username, "", password)
                user.groups.add(Group.objects.get(name=OPERATORS))
            elif chosen:
                user.set_password(password)
                user.save(update_fields=["password"])
        if password and not chosen:
            keep.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(keep, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(password + "\n")
            keep.chmod(0o600)
        elif chosen:
            password = "(the password you gave)"
            keep.unlink(missing_ok=True)
        elif keep.exists():
            password = keep.read_text().strip()
        else:
            password = "(unchanged; set one with: python manage.py changepassword admin)"
        # The port the Procfile's web process binds (DURABILITY_PORT, default 8000).
        port = os.environ.get("DURABILITY_PORT", "8000")
        self.stdout.write(
            self.style.SUCCESS(
                f"\n  Sign in at http://127.0.0.1:{port}/ as {username} / {password}\n"
            )
        )
