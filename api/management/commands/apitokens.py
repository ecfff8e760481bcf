"""``manage.py apitokens create|list|revoke``: personal API tokens from the command line.

manage.py apitokens create alice ci-pipeline --expires-in-days 90
manage.py apitokens list alice
manage.py apitokens revoke alice 12
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from api import tokens
from api.models import ApiToken
from durability.errors import DurabilityError


class Command(BaseCommand):
    help = "Create, list and revoke personal API tokens."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="make a token; its secret is printed once")
        create.add_argument("username")
        create.add_argument("name")
        create.add_argument("--expires-in-days", type=int, default=None)
        listing = sub.add_parser("list", help="a user's tokens")
        listing.add_argument("username")
        revoke = sub.add_parser("revoke", help="revoke a token by its id")
        revoke.add_argument("username")
        revoke.add_argument("token_id", type=int)

    def handle(self, *args: Any, **options: Any) -> None:
        users = get_user_model()
        user = users.objects.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"no user {options['username']!r}")
        try:
            getattr(self, f"_{options['action']}")(user, options)
        except DurabilityError as exc:
            raise CommandError(f"[{exc.code}] {exc.message}") from None

    def _create(self, user: Any, options: dict[str, Any]) -> None:
        days = options["expires_in_days"]
        if days is not None and not 1 <= days <= 3650:
            raise CommandError("--expires-in-days must be from 1 to 3650")
        expires = timezone.now() + timedelta(days=days) if days else None
        token, secret = tokens.create(user, options["name"], expires_at=expires)
        self.stderr.write(f"token {token.id} {token.name!r} for {user.get_username()}")
        # The secret alone on stdout, so that a script can capture it.
        self.stdout.write(secret)

    def _list(self, user: Any, options: dict[str, Any]) -> None:
        for token in ApiToken.objects.filter(user=user):
            expires = token.expires_at.isoformat() if token.expires_at else "never"
            self.stdout.write(
                f"{token.id}\t{token.name}\t{token.hint}…\t{token.state()}\texpires {expires}"
            )

    def _revoke(self, user: Any, options: dict[str, Any]) -> None:
        token = tokens.revoke(user, options["token_id"])
        self.stdout.write(f"token {token.id} {token.name!r} revoked")
