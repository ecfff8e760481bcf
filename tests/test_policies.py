"""An agent's policies (durability.policies): what they hold, what the engine reads from
them, and bad values refused with a sentence that names the option."""

from __future__ import annotations

import dataclasses

import pytest

from durability import Agent, DurabilityPolicy, Limits, Retention, RetryPolicy, Transient
from durability.agents import registry
from durability.errors import AgentDefinitionError, UnknownAgent


def test_defaults_when_no_policy_is_named():
    agent = Agent("x-plain", register=False)
    assert agent.retry == RetryPolicy()
    assert (agent.max_retries, agent.retry_base, agent.retry_cap) == (5, 1.0, 300.0)
    assert (agent.durability, agent.periodic_steps, agent.periodic_seconds) == ("strict", 10, 5.0)
    assert agent.max_concurrent is None and agent.limits.get("llm") is None
    assert (agent.keep_days, agent.keep_checkpoints, agent.compact_after_days) == (None, "all", 7)


def test_the_engine_reads_each_policy_through_the_agent():
    retry = RetryPolicy(max_retries=2, base=0.5, cap=4, transient=[ConnectionError])
    agent = Agent(
        "x-policies",
        retry=retry,
        durability=DurabilityPolicy("periodic", every_steps=3, every_seconds=2),
        limits=Limits(max_concurrent=4, calls={"llm": "openai"}),
        retention=Retention(keep_days=30, keep_checkpoints="snapshots", compact_after_days=1),
        register=False,
    )
    assert agent.retry is retry and agent.transient == (ConnectionError,)
    assert agent.is_transient(ConnectionError()) and agent.is_transient(Transient("x"))
    assert not agent.is_transient(ValueError())
    assert all(0.25 <= agent.backoff(n) <= 4 for n in range(10))  # capped, half fixed
    assert agent.backoff(0, retry_after=9) == 9
    assert (agent.durability, agent.periodic_steps, agent.periodic_seconds) == ("periodic", 3, 2)
    assert agent.max_concurrent == 4 and agent.limits.get("llm") == "openai"
    assert (agent.keep_days, agent.keep_checkpoints, agent.compact_after_days) == (
        30,
        "snapshots",
        1,
    )


def test_a_level_name_is_the_short_form_of_a_durability_policy():
    agent = Agent("x-relaxed", durability="relaxed", register=False)
    assert agent.durability_policy == DurabilityPolicy("relaxed")


def test_policies_are_frozen_and_shared():
    shared = RetryPolicy(max_retries=1)
    one = Agent("x-one", retry=shared, register=False)
    two = Agent("x-two", retry=shared, register=False)
    assert one.retry is two.retry
    with pytest.raises(dataclasses.FrozenInstanceError):
        shared.max_retries = 9  # type: ignore[misc]
    calls = {"llm": "openai"}
    limits = Limits(calls=calls)
    calls["llm"] = "other"  # the policy kept its own copy
    assert limits.get("llm") == "openai"
    with pytest.raises(TypeError):
        limits.calls["llm"] = "other"  # type: ignore[index]


def test_the_fingerprint_is_unchanged_by_the_grouping():
    # The configuration hash that Agent("x-print", max_retries=6, retry_base=0.5,
    # retry_cap=10) had before the policies: its checkpoints are still of this definition.
    agent = Agent("x-print", retry=RetryPolicy(max_retries=6, base=0.5, cap=10), register=False)
    other = Agent("x-print", retry=RetryPolicy(max_retries=7, base=0.5, cap=10), register=False)
    assert agent.fingerprint() == ("6cf39060aaaf6dd3", "")
    assert other.fingerprint() != agent.fingerprint()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: RetryPolicy(max_retries=-1), "RetryPolicy.max_retries must be a whole number"),
        (lambda: RetryPolicy(max_retries=2.5), "RetryPolicy.max_retries must be a whole number"),
        (lambda: RetryPolicy(base=0), "RetryPolicy.base must be a number > 0, not 0"),
        (lambda: RetryPolicy(cap="10"), "RetryPolicy.cap must be a number > 0, not '10'"),
        (lambda: RetryPolicy(base=5, cap=1), "RetryPolicy.cap must be at least base (5)"),
        (lambda: RetryPolicy(transient=(KeyError, "x")), "RetryPolicy.transient must be a tuple"),
        (lambda: DurabilityPolicy("eventual"), "durability must be one of strict, relaxed"),
        (lambda: DurabilityPolicy(every_steps=0), "DurabilityPolicy.every_steps must be a whole"),
        (lambda: DurabilityPolicy(every_seconds=-1), "DurabilityPolicy.every_seconds must be"),
        (lambda: Limits(max_concurrent=0), "Limits.max_concurrent must be a whole number >= 1"),
        (lambda: Limits(calls={"llm": 5}), "Limits.calls must be a mapping of call key"),
        (lambda: Limits(calls=["llm"]), "Limits.calls must be a mapping of call key"),
        (lambda: Retention(keep_days=-1), "Retention.keep_days must be a number >= 0"),
        (lambda: Retention(keep_checkpoints="some"), "Retention.keep_checkpoints must be 'all'"),
        (lambda: Retention(compact_after_days=None), "Retention.compact_after_days must be"),
    ],
)
def test_a_bad_policy_value_is_refused_naming_the_option(make, message):
    with pytest.raises(AgentDefinitionError) as err:
        make()
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"durability": "eventual"}, "agent x-bad: durability must be one of strict, relaxed"),
        ({"retry": 5}, "agent x-bad: retry must be a RetryPolicy, not 5"),
        ({"limits": {"llm": "openai"}}, "agent x-bad: limits must be a Limits, not {'llm'"),
        ({"retention": 30}, "agent x-bad: retention must be a Retention, not 30"),
        ({"max_retries": 3}, "agent x-bad: max_retries= is now retry=RetryPolicy(max_retries=...)"),
        ({"keep_days": 3}, "agent x-bad: keep_days= is now retention=Retention(keep_days=...)"),
        ({"periodic_steps": 3}, 'durability=DurabilityPolicy("periodic", every_steps=...)'),
        ({"max_concurent": 3}, "agent x-bad: unknown option max_concurent="),
    ],
)
def test_an_agent_with_a_bad_option_is_refused_and_not_registered(options, message):
    registry.unregister("x-bad")
    with pytest.raises(AgentDefinitionError) as err:
        Agent("x-bad", **options)
    assert message in str(err.value)
    with pytest.raises(UnknownAgent):
        registry.get("x-bad")
