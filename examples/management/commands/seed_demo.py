"""Start a handful of demo runs that show the product's moving parts."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from durability import operations
from durability.models import Run

DEMOS = [
    (
        "research",
        {"question": "How do fencing tokens make leases safe?", "slow_ms": 800},
        "waits for your approval before it publishes",
    ),
    (
        "research",
        {
            "question": "Why add jitter to exponential backoff?",
            "slow_ms": 600,
            "crash_at": "summarise",
        },
        "its worker is killed once in 'summarise', after the LLM call: it recovers and"
        " replays that call instead of paying for it again; then waits for your approval",
    ),
    (
        "research",
        {"question": "What does a write-ahead log guarantee?", "slow_ms": 500, "fail_transient": 2},
        "each search fails twice with a transient error, is retried with backoff, then"
        " succeeds; then waits for your approval",
    ),
    (
        "support",
        {
            "customer": "ada@example.com",
            "message": "Hi, I'd like a refund for order A-1001 please.",
            "slow_ms": 500,
        },
        "a small refund, issued without approval",
    ),
    (
        "support",
        {
            "customer": "grace@example.com",
            "message": "The monitor from order A-1002 flickers; I want to return it.",
            "slow_ms": 500,
        },
        "a 349 EUR refund that waits for an operator",
    ),
]


class Command(BaseCommand):
    help = "Start the demo runs (only when there are no runs yet, unless --force)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--force", action="store_true")

    def handle(self, *args, **opts) -> None:
        if Run.objects.exists() and not opts["force"]:
            self.stdout.write("demo runs already seeded (use --force for more)")
            return
        for agent, payload, what in DEMOS:
            run = operations.start(agent, payload, by="seed", reason="demo")
            self.stdout.write(f"  {run.short_id}  {agent:<9} {what}")
        chat = operations.start("concierge", {"user": "demo"}, by="seed", reason="demo")
        operations.send(chat.id, "user", "How do idempotency keys make retries safe?", by="seed")
        self.stdout.write(
            f"  {chat.short_id}  concierge a conversation: each question goes to a research"
            " sub-agent; ask the next one with\n"
            f"            .venv/bin/python manage.py durability send {chat.short_id} user"
            " --data '\"What is a write-ahead log?\"'"
        )
