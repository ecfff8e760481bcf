"""One small LLM client interface with two implementations.

- ``OpenAICompatible``: any server speaking the OpenAI chat-completions wire format
  (``POST {base}/chat/completions``), configured by ``DURABILITY_LLM_BASE_URL``,
  ``DURABILITY_LLM_MODEL`` and ``DURABILITY_LLM_API_KEY``.
- ``OfflineStandIn``: used when no base URL is set. It is *not* a language model: a
  deterministic local stand-in that answers the demo agents' few kinds of prompts by
  keyword overlap (extractive summaries, keyword queries, rule-based tool choice), so the
  demos run without the internet. Its model name says so.

``complete(messages)`` returns a JSON-able dict in the shape the engine journals:
``{"model": ..., "text": ..., "usage": {"prompt_tokens": ..., "completion_tokens": ...}}``.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from http.client import HTTPException
from typing import Any, Protocol

from durability import Permanent, RateLimited, Transient

OFFLINE_MODEL = "offline-stand-in (deterministic, not an LLM)"

# Marker phrases the demo prompts use; a real model reads them as plain instructions.
TASK_QUERIES = "Reply with search queries, one per line."
TASK_SUMMARY = "Answer the question from the notes below, citing sources in brackets."
TASK_TOOL = "Reply with one JSON object choosing the next tool."
# What a tool returned goes to the model as a user message with this prefix: a "tool" role
# must answer an assistant message's tool_calls, which these plain-text agents do not make,
# and OpenAI (and servers following it) refuse it otherwise.
OBSERVATION = "Observation: "


def observation(text: str) -> dict[str, str]:
    return {"role": "user", "content": OBSERVATION + text}


def for_the_model(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """An agent's transcript as chat messages: its "tool" entries become observations."""
    return [observation(m["content"]) if m["role"] == "tool" else m for m in messages]


def _observations(messages: list[dict[str, str]]) -> list[str]:
    return [
        m["content"].removeprefix(OBSERVATION)
        for m in messages
        if m["role"] == "user" and m["content"].startswith(OBSERVATION)
    ]


def _requests(messages: list[dict[str, str]]) -> list[str]:
    return [
        m["content"]
        for m in messages
        if m["role"] == "user" and not m["content"].startswith(OBSERVATION)
    ]


class LLMClient(Protocol):
    def complete(self, messages: list[dict[str, str]], *, max_tokens: int = 512) -> dict: ...


class OpenAICompatible:
    def __init__(self, base_url: str, model: str, api_key: str = "", timeout: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout = timeout

    def complete(self, messages: list[dict[str, str]], *, max_tokens: int = 512) -> dict:
        body = json.dumps(
            {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        ).encode()
        request = urllib.request.Request(
            f"{self.base_url}/chat/completions",
            data=body,
            headers={
                "Content-Type": "application/json",
                **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}),
            },
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = _error_detail(exc)
            if exc.code == 429:
                raise RateLimited(
                    f"LLM rate limit ({exc.code}){detail}",
                    retry_after=_retry_after(exc.headers.get("Retry-After")),
                ) from None
            if exc.code >= 500 or exc.code in (408, 409):
                raise Transient(f"LLM server error {exc.code}{detail}") from None
            raise Permanent(f"LLM request refused: {exc.code} {exc.reason}{detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, HTTPException) as exc:
            raise Transient(f"LLM unreachable: {exc}") from None
        try:
            payload = json.loads(raw)
        except ValueError:
            # A proxy's error page in place of the server's answer: worth another try.
            raise Transient(f"LLM answer is not JSON: {raw[:200]!r}") from None
        try:
            text = payload["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise Permanent(f"unexpected LLM response: {str(payload)[:200]}") from None
        usage = payload.get("usage") or {}
        return {
            "model": payload.get("model", self.model),
            "text": text,
            "usage": {
                "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
            },
        }


def _error_detail(exc: urllib.error.HTTPError) -> str:
    """The server's own explanation (OpenAI puts it in the body), for the run's error."""
    try:
        body = exc.read()[:500].decode("utf-8", "replace").strip()
    except Exception:
        return ""
    return f": {body}" if body else ""


def _retry_after(value: str | None) -> float | None:
    """Retry-After is seconds or an HTTP date (RFC 9110); anything else is ignored."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


_WORD = re.compile(r"[a-zA-Z][a-zA-Z\-]{2,}")
_STOP = {
    "add",
    "the",
    "and",
    "for",
    "with",
    "that",
    "this",
    "from",
    "what",
    "how",
    "why",
    "are",
    "was",
    "were",
    "has",
    "have",
    "had",
    "not",
    "but",
    "you",
    "your",
    "can",
    "its",
    "their",
    "they",
    "them",
    "into",
    "when",
    "then",
    "than",
    "does",
    "did",
    "will",
    "would",
    "should",
    "could",
    "about",
    "which",
    "who",
    "whom",
    "there",
    "these",
    "those",
    "been",
    "being",
    "also",
    "such",
    "more",
    "most",
    "some",
    "any",
    "all",
    "each",
    "our",
    "out",
    "over",
    "under",
    "between",
    "after",
    "before",
    "while",
    "where",
    "is",
    "of",
    "to",
    "in",
    "on",
    "at",
    "by",
    "an",
    "as",
    "be",
    "it",
    "or",
    "if",
    "no",
    "so",
    "do",
    "we",
    "he",
    "she",
}


def words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text) if w.lower() not in _STOP]


class OfflineStandIn:
    """Deterministic, local, honest about what it is (see module docstring)."""

    def complete(self, messages: list[dict[str, str]], *, max_tokens: int = 512) -> dict:
        system = " ".join(m["content"] for m in messages if m["role"] == "system")
        user = next(reversed(_requests(messages)), "")
        if TASK_QUERIES in system:
            text = self._queries(user)
        elif TASK_SUMMARY in system:
            text = self._summary(user, messages)
        elif TASK_TOOL in system:
            text = self._tool(messages)
        else:
            text = "The offline stand-in only answers the demo agents' prompts."
        prompt_tokens = sum(len(m["content"].split()) for m in messages)
        return {
            "model": OFFLINE_MODEL,
            "text": text,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(text.split())},
        }

    def _queries(self, question: str) -> str:
        terms = list(dict.fromkeys(words(question)))
        if not terms:
            return question
        queries = [" ".join(terms[:3])]
        queries += [f"{a} {b}" for a, b in zip(terms, terms[1:], strict=False)][:2]
        return "\n".join(dict.fromkeys(queries))

    def _summary(self, question: str, messages: list[dict[str, str]]) -> str:
        wanted = set(words(question))
        notes = _observations(messages)
        scored = []
        for note in notes:
            source = note.split("]", 1)[0].lstrip("[") if note.startswith("[") else "notes"
            for sentence in re.split(r"(?<=[.!?])\s+", note.split("]", 1)[-1]):
                overlap = len(wanted & set(words(sentence)))
                if overlap:
                    scored.append((overlap, len(scored), sentence.strip(), source))
        scored.sort(key=lambda s: (-s[0], s[1]))
        picked = scored[:3]
        if not picked:
            return "The bundled documents say nothing about this question."
        return " ".join(f"{sentence} [{source}]" for _, _, sentence, source in picked)

    def _tool(self, messages: list[dict[str, str]]) -> str:
        seen = " ".join(_observations(messages))
        request = next(iter(_requests(messages)), "")
        order = re.search(r"\b[A-Z]-\d{4}\b", request)
        if order and "order_found" not in seen and "order_missing" not in seen:
            return json.dumps({"tool": "lookup_order", "args": {"order_id": order.group(0)}})
        wants_refund = "refund" in request.lower() or "return" in request.lower()
        if wants_refund and "order_found" in seen and "refund_" not in seen:
            return json.dumps({"tool": "refund", "args": {"order_id": order.group(0)}})
        if "refund_done" in seen:
            reply = "Your refund has been issued; it will reach your account in 3-5 days."
        elif "refund_declined" in seen:
            reply = "We could not approve this refund; a colleague will contact you."
        elif "order_missing" in seen:
            reply = "We could not find that order number; could you check it?"
        elif "order_found" in seen:
            reply = "Thanks for reaching out; here is the status of your order."
        else:
            reply = "Thanks for your message; could you give us your order number?"
        return json.dumps({"tool": "reply", "args": {"text": reply}})


def client() -> LLMClient:
    base = os.environ.get("DURABILITY_LLM_BASE_URL", "")
    if base:
        return OpenAICompatible(
            base,
            os.environ.get("DURABILITY_LLM_MODEL", "gpt-4o-mini"),
            os.environ.get("DURABILITY_LLM_API_KEY", ""),
            float(os.environ.get("DURABILITY_LLM_TIMEOUT", "60")),
        )
    return OfflineStandIn()


def complete(messages: list[dict[str, str]], max_tokens: int = 512) -> dict[str, Any]:
    """The function agents journal with ``ctx.call``: its name stays the same whichever
    client is configured, so switching clients does not break replays."""
    return client().complete(messages, max_tokens=max_tokens)
