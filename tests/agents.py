"""Agents used by the tests. Their LLM and effect calls go over real HTTP to servers the
tests start (``TEST_LLM_URL``, ``TEST_EFFECT_URL``), so counting happens on the receiving
side, across worker processes."""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.request

from durability import END, Agent, RetryPolicy, Transient
from examples.llm import OpenAICompatible


def llm_call(prompt: str) -> dict:
    client = OpenAICompatible(os.environ["TEST_LLM_URL"], "fake-model", api_key="sk-test")
    return client.complete([{"role": "user", "content": prompt}])


def post_effect(what: str, *, idempotency_key: str) -> dict:
    request = urllib.request.Request(
        os.environ["TEST_EFFECT_URL"],
        data=json.dumps({"what": what}).encode(),
        headers={"Idempotency-Key": idempotency_key, "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def blocking_call(seconds: float) -> dict:
    time.sleep(seconds)
    return {"slept": seconds}


# A loop: one LLM call (and optionally one effect) per iteration, N iterations.
loop = Agent(
    "test-loop",
    version="1",
    initial_state=lambda inp: {"i": 0, "answers": []},
    retry=RetryPolicy(max_retries=20, base=0.05, cap=0.5),
)


@loop.step(start=True)
def iterate(state, ctx):
    n = int(ctx.input.get("n", 50))
    reply = ctx.call("llm", llm_call, f"{ctx.input.get('tag', '')}iteration {state['i']}")
    if ctx.input.get("effects"):
        ctx.effect("notify", post_effect, f"iteration {state['i']}")
    if ctx.input.get("block_s") and state["i"] == int(ctx.input.get("block_at", 0)):
        ctx.call("block", blocking_call, float(ctx.input["block_s"]))
    if ctx.input.get("approve_at") is not None and state["i"] == int(ctx.input["approve_at"]):
        decision = ctx.approval("go", {"i": state["i"]})
        state["decision"] = decision.approved
    state["i"] += 1
    state["answers"].append(reply["text"][:40])
    if ctx.input.get("slow_ms"):
        time.sleep(float(ctx.input["slow_ms"]) / 1000)
    return "iterate" if state["i"] < n else END


# Flaky: fails transiently on its first attempts, then succeeds.
flaky = Agent("test-flaky", version="1", retry=RetryPolicy(max_retries=5, base=0.05, cap=0.2))


@flaky.step(start=True)
def attempt(state, ctx):
    if ctx.retry < int(ctx.input.get("failures", 2)):
        raise Transient("service unavailable")
    state["done"] = True
    return END


# Sleeper: a durable timer between two steps.
sleeper = Agent("test-sleeper", version="1")


@sleeper.step(start=True)
def nap(state, ctx):
    state["before"] = ctx.now().isoformat()
    ctx.sleep(float(ctx.input.get("seconds", 1)))
    state["woke"] = True
    return END


# Chat: waits for the user's next message, as long as the conversation goes on.
chat = Agent("test-chat", version="1", initial_state=lambda inp: {"turns": []})


@chat.step(start=True)
def listen(state, ctx):
    said = ctx.wait_for("user")
    reply = ctx.call("llm", llm_call, f"reply to {said}")
    state["turns"].append([said, reply["text"]])
    return END if said == "bye" else "listen"


# Parent: fans out to test-loop children and joins them.
parent = Agent("test-parent", version="1", initial_state=lambda inp: {"sizes": inp["sizes"]})


@parent.step(start=True)
def fan_out(state, ctx):
    children = [
        ctx.spawn("test-loop", {"n": n, "tag": f"child{i}-"}, key=f"child-{i}")
        for i, n in enumerate(state["sizes"])
    ]
    state["results"] = [
        {"status": r["status"], "i": (r["result"] or {}).get("i")} for r in ctx.join(children)
    ]
    return END


# Ticker: nothing but checkpoints (no calls, no effects), slowly.
ticker = Agent("test-ticker", version="1", initial_state=lambda inp: {"i": 0})


@ticker.step(start=True)
def tick(state, ctx):
    time.sleep(float(ctx.input.get("slow_ms", 0)) / 1000)
    state["i"] += 1
    return "tick" if state["i"] < int(ctx.input.get("n", 3)) else END


# What-if: writes four parts; from the third on, the prompt depends on the chosen style.
whatif = Agent(
    "test-whatif",
    version="1",
    initial_state=lambda inp: {"topic": inp["topic"], "style": "plain", "k": 0, "out": []},
)


@whatif.step(start=True)
def write(state, ctx):
    k = state["k"]
    prompt = f"{state['topic']} part {k}"
    if k >= 2:
        prompt += f" in {state['style']} style"
    reply = ctx.call("llm", llm_call, prompt)
    ctx.effect("publish", post_effect, f"{state['topic']} part {k}")
    state["out"].append(reply["text"])
    state["k"] = k + 1
    return "write" if state["k"] < 4 else END


# Versioned: its version comes from the worker's environment (a rolling deploy in a test).
versioned = Agent(
    "test-versioned",
    version=os.environ.get("TEST_AGENT_VERSION", "1"),
    initial_state=lambda inp: {"done": False},
)


@versioned.step(start=True)
def finish(state, ctx):
    time.sleep(0.05)
    state["done"] = True
    return END


# Secrets: one run through every write path with the value of ``TEST_CANARY`` (read with
# ctx.secret) in each: state, a large state value (the blob store), a blob, call arguments
# and result, effect arguments, result and error, a message, a log record, a transient
# error, an approval payload, and the final error. Nothing of it may be written anywhere.
# Retried after 1 to 2 s: long enough for the test to read the run's wait detail.
secrets_agent = Agent(
    "test-secrets", version="1", retry=RetryPolicy(max_retries=3, base=2.0, cap=2.0)
)
secrets_log = logging.getLogger("tests.agents.secrets")


def echo_secret(key: str, greeting: str) -> dict:
    return {"echoed": key, "greeting": greeting}


def send_with_secret(key: str, *, header: str, idempotency_key: str) -> dict:
    return {"sent_with": header, "key": key}


def refuse_with_secret(key: str, *, idempotency_key: str) -> dict:
    raise RuntimeError(f"the remote refused the key {key}")


@secrets_agent.step(start=True)
def leak(state, ctx):
    from durability import operations

    key = ctx.secret("TEST_CANARY")
    secrets_log.warning("step leak holds %s", key)
    state["note"] = f"token {key}"
    state["big"] = key + "y" * 3000  # over the test's DURABILITY_BLOB_BYTES: a blob
    state["blob"] = ctx.put_blob(f"blob of {key}")
    state["echo"] = ctx.call("echo", echo_secret, key, f"hello {key}")
    state["sent"] = ctx.effect("send", send_with_secret, key, header=f"Bearer {key}")
    try:
        ctx.effect("refused", refuse_with_secret, key)
    except RuntimeError as exc:
        secrets_log.warning("effect failed", exc_info=exc)
    operations.send(ctx.run_id, "note", {"text": f"note {key}"}, idempotency_key="note-1")
    state["message"] = ctx.wait_for("note")
    if ctx.retry == 0:
        raise Transient(f"upstream rate limit for key {key}")
    decision = ctx.approval("go", {"note": f"pay with {key}", "api_key": key})
    state["approved"] = decision.approved
    return "explode"


@secrets_agent.step()
def explode(state, ctx):
    key = ctx.secret("TEST_CANARY")
    state["after"] = f"approved with {key}"
    raise RuntimeError(f"the final call failed with {key}")


# A refund and an email after it, for rollbacks: the refund declares how it is undone (a
# reversal), the email cannot be. The amount is looked up (a journaled call) from the file the
# input names, so a branch after a rollback can see another amount than the one it abandoned.
def refund_amount(path: str) -> float:
    if not path:
        return 349.0
    with open(path) as f:
        return float(f.read().strip())


def refund_effect(order: str, amount: float, *, idempotency_key: str) -> dict:
    return post_effect(f"refund {order} {amount:g}", idempotency_key=idempotency_key)


def reverse_refund(receipt: dict, order: str, amount: float, *, idempotency_key: str) -> dict:
    return post_effect(f"reverse {order} {amount:g}", idempotency_key=idempotency_key)


refunds = Agent("test-refund", version="1", initial_state=lambda inp: {"refunds": []})


@refunds.step(start=True)
def look(state, ctx):
    state["amount"] = ctx.call("amount", refund_amount, (ctx.input or {}).get("price_file", ""))
    return "pay"


@refunds.step
def pay(state, ctx):
    # With "labelled", the agent says what the refund is in the customer's terms.
    label = (
        f"refund {state['amount']:g} EUR on order A1" if (ctx.input or {}).get("labelled") else ""
    )
    receipt = ctx.effect(
        "refund", refund_effect, "A1", state["amount"], compensate=reverse_refund, label=label
    )
    state["refunds"].append(receipt)
    return "mail"


@refunds.step
def mail(state, ctx):
    ctx.effect("email", post_effect, f"email about {state['amount']:g} EUR")
    return END
