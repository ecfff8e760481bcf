"""The demo agents' OpenAI-compatible client against a real HTTP server speaking the
chat-completions wire format: how each kind of answer is classified (a retry, a rate limit,
a permanent refusal), with the server's own explanation kept."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from durability import Permanent, RateLimited, Transient
from examples.llm import OpenAICompatible

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
def client(llm):
    return OpenAICompatible(llm.url, "fake-model", api_key="sk-test", timeout=10)


def test_an_answer(client, llm):
    answer = client.complete(MESSAGES)
    assert answer["text"] == "answer to hello" and answer["model"] == "fake-model"
    assert answer["usage"] == {"prompt_tokens": 1, "completion_tokens": 3}


def test_retry_after_as_seconds_or_as_an_http_date(client, llm):
    later = datetime.now(UTC) + timedelta(seconds=30)
    llm.script += [
        (429, {"error": {"message": "slow down"}}, {"Retry-After": "7"}),
        (429, {"error": {"message": "slow down"}}, {"Retry-After": format_datetime(later, True)}),
        (429, {"error": {"message": "slow down"}}, {"Retry-After": "soon"}),
    ]
    with pytest.raises(RateLimited) as seconds:
        client.complete(MESSAGES)
    assert seconds.value.retry_after == 7.0 and "slow down" in str(seconds.value)
    with pytest.raises(RateLimited) as date:
        client.complete(MESSAGES)
    assert 20 <= date.value.retry_after <= 31
    with pytest.raises(RateLimited) as unreadable:
        client.complete(MESSAGES)
    assert unreadable.value.retry_after is None


def test_a_refusal_says_why(client, llm):
    why = "messages with role 'tool' must be a response to a preceding message"
    llm.script.append((400, {"error": {"message": why}}, {}))
    with pytest.raises(Permanent) as refused:
        client.complete(MESSAGES)
    assert "400" in str(refused.value) and why in str(refused.value)


@pytest.mark.parametrize("status", [408, 409, 500, 503])
def test_timeouts_conflicts_and_server_errors_are_retried(client, llm, status):
    llm.script.append((status, {"error": {"message": "try again"}}, {}))
    with pytest.raises(Transient):
        client.complete(MESSAGES)


def test_a_proxy_page_in_place_of_an_answer_is_retried(client, llm):
    llm.script.append((200, b"<html><body>502 Bad Gateway</body></html>", {}))
    with pytest.raises(Transient) as page:
        client.complete(MESSAGES)
    assert "not JSON" in str(page.value)
