"""How the LangGraph saver stores channel values (``durability.langgraph.codec``): LangChain's
messages as JSON fields read back exactly as LangGraph's serializer reads them, the rest
through the serializer, and leaves written by earlier versions (every value through the
serializer, base64 inside JSON) still read."""

from __future__ import annotations

import base64
import gc
import uuid
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    ChatMessage,
    ChatMessageChunk,
    FunctionMessage,
    FunctionMessageChunk,
    HumanMessage,
    HumanMessageChunk,
    RemoveMessage,
    SystemMessage,
    SystemMessageChunk,
    ToolMessage,
    ToolMessageChunk,
)
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from durability import canonical, operations
from durability.langgraph import DurableSaver, codec
from durability.langgraph.describe import readable

SERDE = JsonPlusSerializer()
CALL = {"name": "search", "args": {"q": "refund policy"}, "id": "call-1", "type": "tool_call"}
RAW_CALL = {"id": "call-2", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}

# One of each class, with the fields that are easy to lose on the way: ids, names, extra
# and response metadata, tool calls (parsed, raw, invalid, chunked), usage, content blocks.
MESSAGES = [
    HumanMessage("hi", id="h-1", name="ann", additional_kwargs={"x": [1, {"y": None}]}),
    HumanMessage([{"type": "text", "text": "look"}, {"type": "image", "url": "https://x/y"}]),
    AIMessage(
        "",
        id="a-1",
        tool_calls=[CALL],
        usage_metadata={"input_tokens": 3, "output_tokens": 4, "total_tokens": 7},
        response_metadata={"model_name": "m", "finish_reason": "tool_calls"},
    ),
    AIMessage("raw", additional_kwargs={"tool_calls": [RAW_CALL]}),
    AIMessage(
        "bad",
        invalid_tool_calls=[
            {"name": "f", "args": "{oops", "id": "c-3", "error": "e", "type": "invalid_tool_call"}
        ],
    ),
    AIMessage(
        content_blocks=[{"type": "text", "text": "v1"}, {"type": "reasoning", "reasoning": "r"}]
    ),
    AIMessageChunk(
        "part", id="k-1", tool_call_chunks=[{"name": "f", "args": '{"a"', "id": "c", "index": 0}]
    ),
    AIMessageChunk("plain chunk", response_metadata={"model_provider": "p"}),
    HumanMessageChunk("hc"),
    SystemMessageChunk("sc"),
    ChatMessageChunk("cc", role="critic"),
    FunctionMessageChunk("fc", name="fn"),
    ToolMessageChunk("tc", tool_call_id="call-1"),
    SystemMessage("be brief", id="s-1"),
    ChatMessage("c", role="critic"),
    FunctionMessage("f", name="fn"),
    ToolMessage("found", tool_call_id="call-1", artifact={"rows": [1, 2]}, status="error"),
    ToolMessage([{"type": "text", "text": "t"}], tool_call_id="call-1", name="search"),
    RemoveMessage(id="h-1"),
]
# Messages whose fields JSON cannot carry: the whole message goes through the serializer.
ODD = [
    ToolMessage("out", tool_call_id="call-1", artifact=b"\x00raw"),
    AIMessage("x", additional_kwargs={"when": (1, 2)}),
    AIMessage("x", additional_kwargs={codec.TAG: "not a leaf"}),
]


def round_trip(value):
    """``value`` stored and read back as the saver does: encoded, dumped, parsed, decoded."""
    return codec.decode(canonical.loads(canonical.dumps(codec.Encoder(SERDE).encode(value))), SERDE)


def old_leaf(value) -> dict:
    """A value as earlier versions stored every value that was not JSON."""
    kind, data = SERDE.dumps_typed(value)
    return {codec.TAG: kind, "b64": base64.b64encode(data).decode("ascii")}


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_are_json_and_read_back_exactly(message):
    stored = codec.Encoder(SERDE).encode([message])[0]
    assert stored[codec.TAG] == codec.MESSAGE and "b64" not in stored
    assert stored["class"] == type(message).__name__
    (back,) = round_trip([message])
    # As LangGraph's serializer (and so InMemorySaver) gives it back, field for field.
    theirs = SERDE.loads_typed(SERDE.dumps_typed(message))
    assert type(back) is type(message) is type(theirs)
    assert back == message == theirs
    assert back.__dict__ == theirs.__dict__


@pytest.mark.parametrize("message", ODD, ids=lambda m: type(m).__name__)
def test_messages_json_cannot_carry_go_through_the_serializer(message):
    stored = codec.Encoder(SERDE).encode([message])[0]
    assert stored[codec.TAG] != codec.MESSAGE and "b64" in stored
    (back,) = round_trip([message])
    theirs = SERDE.loads_typed(SERDE.dumps_typed(message))
    assert type(back) is type(message) and back.__dict__ == theirs.__dict__


def test_a_decoded_message_shares_nothing_with_the_document():
    # The saver patches the document it read in place at the next checkpoint.
    doc = codec.Encoder(SERDE).encode([MESSAGES[0], MESSAGES[2]])
    kept = canonical.dumps(doc)
    human, ai = codec.decode(doc, SERDE)
    human.additional_kwargs["x"][1]["y"] = "changed"
    ai.tool_calls[0]["args"]["q"] = "changed"
    ai.usage_metadata["input_tokens"] = 99
    assert canonical.dumps(doc) == kept


def test_leaves_of_earlier_versions_still_read():
    values = {
        "messages": [old_leaf(m) for m in MESSAGES],
        "when": old_leaf(datetime(2026, 1, 2, 3, 4, tzinfo=UTC)),
        "blob": old_leaf(b"\x01\x02"),
    }
    decoded = codec.decode(canonical.loads(canonical.dumps(values)), SERDE)
    assert decoded["messages"] == MESSAGES
    assert [type(m) for m in decoded["messages"]] == [type(m) for m in MESSAGES]
    assert (
        decoded["when"] == datetime(2026, 1, 2, 3, 4, tzinfo=UTC) and decoded["blob"] == b"\x01\x02"
    )
    # ``list`` decodes through a memo: both kinds of leaves, mixed in one state.
    mixed = {"messages": [old_leaf(MESSAGES[0]), *codec.Encoder(SERDE).encode(MESSAGES[1:3])]}
    memo = codec.Memo(SERDE)
    first, again = memo.decode(mixed), memo.decode(mixed)
    assert first == again == {"messages": MESSAGES[:3]}
    assert first["messages"][2] is again["messages"][2]


def test_the_dashboard_shows_both_kinds_readably():
    doc = {
        "values": {
            "messages": [
                old_leaf(HumanMessage("old", id="o-1")),
                *codec.Encoder(SERDE).encode([MESSAGES[2]]),
            ]
        }
    }
    shown = readable(doc)["values"]["messages"]
    assert shown[0] == {"type": "human", "content": "old", "id": "o-1"}
    assert shown[1]["type"] == "ai" and shown[1]["id"] == "a-1"
    assert shown[1]["tool_calls"][0]["args"] == {"q": "refund policy"}
    assert "b64" not in canonical.dumps(shown).decode()


def test_an_unknown_message_class_is_refused_with_its_name():
    leaf = {codec.TAG: codec.MESSAGE, "class": "os.system", "fields": {"content": "x"}}
    with pytest.raises(ValueError, match="'os.system', not a LangChain message class"):
        codec.decode([leaf], SERDE)


@pytest.mark.django_db(transaction=True)
@pytest.mark.smoke
def test_every_message_through_a_fresh_saver_as_in_memory():
    """Stored by one saver, read by a new one (nothing held in memory), as InMemorySaver
    gives them back; the run verifies."""
    cfg = {"configurable": {"thread_id": uuid.uuid4().hex, "checkpoint_ns": ""}}
    checkpoint = empty_checkpoint()
    checkpoint["channel_values"] = {"messages": MESSAGES + ODD, "turns": 3}
    versions = checkpoint["channel_versions"] = {"messages": 1, "turns": 1}
    md = {"source": "update", "step": 0}
    writer, memory = DurableSaver(), InMemorySaver()
    stored = writer.put(cfg, checkpoint, md, versions)
    writer.put_writes(stored, [("messages", [MESSAGES[2], ODD[0]])], "task-1")
    expected = memory.get_tuple(memory.put(cfg, checkpoint, md, versions))
    writer.close()
    reader = DurableSaver()
    found = reader.get_tuple(cfg)
    reader.close()
    values = found.checkpoint["channel_values"]
    assert values == expected.checkpoint["channel_values"]
    assert [type(m) for m in values["messages"]] == [type(m) for m in MESSAGES + ODD]
    assert found.pending_writes == [("task-1", "messages", [MESSAGES[2], ODD[0]])]
    (report,) = operations.verify(DurableSaver().run_of(cfg["configurable"]["thread_id"]).id)
    assert report.ok, str(report)
    gc.collect()


def test_a_write_to_a_join_is_a_route_not_a_channel_written():
    """``join:a+b:c`` is LangGraph's channel for a node that waits for several: the task
    that wrote it routes to ``c``; it wrote none of the graph's channels."""
    from durability.langgraph.describe import _tasks

    rows = [
        ("cp-1", "t-1", "~__pregel_pull, fast", "items", ""),
        ("cp-1", "t-1", "~__pregel_pull, fast", "join:fast+slow:join", ""),
    ]
    (task,) = _tasks(rows, None)["cp-1"]
    assert (task.channels, task.routes, task.summary) == (
        ["items"],
        ["join"],
        "fast wrote items → join",
    )


# What a channel's list goes through from one superstep to the next: messages appended (as
# LangGraph's reducer does, to a copy), one replaced by id, dropped from the front, the list
# changed in place, or the channel gone and back.
STEPS_OF_A_LIST = st.lists(
    st.sampled_from(["append", "append in place", "replace", "drop first", "gone", "same"]),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(STEPS_OF_A_LIST)
def test_an_encoder_that_remembers_encodes_as_a_fresh_one(steps):
    """The encoder a saver keeps per thread (which takes a list's elements kept from its
    previous call as encoded then) gives, call after call, what a new encoder gives; and
    patching a document it gave in place changes nothing it gives later."""
    remembering = codec.Encoder(SERDE)
    messages: list = [AIMessage("first", id="m-0")]
    for n, step in enumerate(steps, start=1):
        if step == "append":
            messages = [*messages, AIMessage(f"m {n}", id=f"m-{n}")]
        elif step == "append in place":
            messages.append(ToolMessage(f"t {n}", tool_call_id="call-1", id=f"t-{n}"))
        elif step == "replace" and messages:
            messages = [*messages[:-1], AIMessage(f"again {n}", id=messages[-1].id)]
        elif step == "drop first":
            messages = messages[1:]
        values = {"turns": n} if step == "gone" else {"messages": messages, "turns": n}
        got = remembering.encode(values)
        assert canonical.dumps(got) == canonical.dumps(codec.Encoder(SERDE).encode(values))
        if "messages" in got:
            got["messages"].append({"patched": "in place"})
            got["messages"][:1] = []
