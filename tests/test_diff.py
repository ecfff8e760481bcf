"""The structural diff: every patch it makes turns the old document into the new one."""

import copy

import jsonpatch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durability import canonical, diff

keys = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10)
)
documents = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(keys, children, max_size=5),
    max_leaves=30,
)


def roundtrip(old, new, strict=False):
    ops = diff.diff(old, new, strict=strict)
    patched = diff.apply(copy.deepcopy(old), canonical.loads(canonical.dumps(ops)))
    return ops, patched


@settings(deadline=None, max_examples=300)
@given(st.dictionaries(keys, documents, max_size=6), st.dictionaries(keys, documents, max_size=6))
def test_strict_patch_reproduces_new_document_exactly(old, new):
    _, patched = roundtrip(old, new, strict=True)
    assert canonical.dumps(patched) == canonical.dumps(new)


@settings(deadline=None, max_examples=300)
@given(st.dictionaries(keys, documents, max_size=6), st.dictionaries(keys, documents, max_size=6))
def test_fast_patch_reproduces_new_document_up_to_number_type(old, new):
    _, patched = roundtrip(old, new)
    assert patched == new


def test_fast_diff_misses_number_type_changes_and_strict_does_not():
    # Nested inside containers compared at C level, 1 == True and 0 == 0.0.
    old, new = {"a": {"x": 1}, "b": [[0]]}, {"a": {"x": True}, "b": [[0.0]]}
    assert diff.diff(old, new) == []
    ops = diff.diff(old, new, strict=True)
    assert {op["path"] for op in ops} == {"/a/x", "/b/0/0"}


def test_append_is_one_add_per_new_element():
    old = {"messages": [{"n": i} for i in range(1000)]}
    new = copy.deepcopy(old)
    new["messages"].append({"n": 1000})
    assert diff.diff(old, new) == [{"op": "add", "path": "/messages/1000", "value": {"n": 1000}}]


def test_insert_at_front_is_not_a_rewritten_list():
    old = {"messages": [{"n": i} for i in range(100)]}
    new = copy.deepcopy(old)
    new["messages"][0:0] = [{"n": -2}, {"n": -1}]
    ops = diff.diff(old, new)
    assert [op["path"] for op in ops] == ["/messages/0", "/messages/1"]
    assert all(op["op"] == "add" for op in ops)


def test_edit_in_the_middle_touches_only_that_path():
    old = {"notes": {"a": {"confidence": 0.6, "text": "x" * 1000}}, "plan": ["a", "b"]}
    new = copy.deepcopy(old)
    new["notes"]["a"]["confidence"] = 0.8
    new["plan"].pop(0)
    ops = diff.diff(old, new)
    assert {"op": "replace", "path": "/notes/a/confidence", "value": 0.8} in ops
    assert {"op": "remove", "path": "/plan/0"} in ops
    assert len(ops) == 2


@pytest.mark.parametrize("key", ["a/b", "m~n", "~/", "", "ünï"])
def test_keys_are_escaped_per_rfc_6901(key):
    old, new = {}, {key: 1}
    ops = diff.diff(old, new)
    assert jsonpatch.apply_patch(old, ops) == new
    assert diff.split_path(ops[0]["path"]) == [key]


def test_replacing_the_root_type():
    assert roundtrip([1, 2], {"a": 1})[1] == {"a": 1}


def test_a_sliding_window_is_one_remove_and_one_add():
    old = {"messages": [{"n": i, "text": "x" * 100} for i in range(1000)]}
    new = copy.deepcopy(old)
    new["messages"].pop(0)
    new["messages"].append({"n": 1000, "text": "y"})
    ops = diff.diff(old, new)
    assert ops == [
        {"op": "remove", "path": "/messages/0"},
        {"op": "add", "path": "/messages/999", "value": {"n": 1000, "text": "y"}},
    ]
    assert roundtrip(old, new)[1] == new


def test_a_window_sliding_the_other_way():
    old = {"m": list(range(50))}
    new = {"m": [-2, -1, *range(47)]}
    ops = diff.diff(old, new)
    assert len(ops) == 5  # three removed at the end, two added in front
    assert roundtrip(old, new)[1] == new


@settings(deadline=None, max_examples=300)
@given(
    st.lists(st.integers(0, 5), max_size=40),
    st.integers(0, 20),
    st.lists(st.integers(0, 5), max_size=5),
    st.lists(st.integers(0, 5), max_size=5),
)
def test_lists_edited_at_both_ends_roundtrip(items, cut, front, back):
    old = {"l": items}
    new = {"l": front + items[cut:] + back}
    assert roundtrip(old, new)[1] == new
    assert roundtrip(old, new, strict=True)[1] == new


@settings(deadline=None, max_examples=300)
@given(st.dictionaries(keys, documents, max_size=6), st.dictionaries(keys, documents, max_size=6))
def test_the_hot_path_applier_agrees_with_jsonpatch(old, new):
    for strict in (False, True):
        ops = canonical.loads(canonical.dumps(diff.diff(old, new, strict=strict)))
        own = diff.apply_own(copy.deepcopy(old), copy.deepcopy(ops))
        library = diff.apply(copy.deepcopy(old), ops)
        assert canonical.dumps(own) == canonical.dumps(library)


@settings(deadline=None, max_examples=300)
@given(st.dictionaries(keys, documents, max_size=6), st.dictionaries(keys, documents, max_size=6))
def test_applying_to_a_shared_document_leaves_it_and_the_patch_as_they_were(old, new):
    """``shared=True`` (a LangGraph saver's documents, whose messages the next state shares):
    the same result as applying in place, with the document and the operations untouched."""
    for strict in (False, True):
        ops = canonical.loads(canonical.dumps(diff.diff(old, new, strict=strict)))
        before, ops_before = canonical.dumps(old), canonical.dumps(ops)
        shared = diff.apply_own(old, ops, shared=True)
        assert canonical.dumps(old) == before and canonical.dumps(ops) == ops_before
        in_place = diff.apply_own(copy.deepcopy(old), copy.deepcopy(ops))
        assert canonical.dumps(shared) == canonical.dumps(in_place)


def test_a_shared_document_keeps_what_the_patch_does_not_touch():
    kept, edited = {"fields": {"content": "x" * 100}}, {"fields": {"content": "b"}}
    old = {"values": {"messages": [kept, edited]}, "n": 1}
    appended = {"values": {"messages": [kept, edited, {"fields": {"content": "c"}}]}, "n": 2}
    changed = {"values": {"messages": [kept, {"fields": {"content": "d"}}]}, "n": 1}
    for new in (appended, changed):
        ops = canonical.loads(canonical.dumps(diff.diff(old, new)))
        result = diff.apply_own(old, ops, shared=True)
        assert result == new
        assert result["values"]["messages"][0] is kept  # shared, not copied
        assert old == {"values": {"messages": [kept, edited]}, "n": 1}
        assert edited == {"fields": {"content": "b"}}  # the operation inside it copied it


@settings(deadline=None, max_examples=300)
@given(documents, documents)
def test_a_sized_patch_counts_the_canonical_bytes_of_what_it_makes(old, new):
    for strict in (False, True):
        ops = canonical.loads(canonical.dumps(diff.diff(old, new, strict=strict)))
        before = len(canonical.dumps(old))
        patched, size = diff.apply_sized(copy.deepcopy(old), ops, before, shared=True)
        assert size == len(canonical.dumps(patched))


@pytest.mark.parametrize(
    ("old", "ops"),
    [
        ([], [{"op": "add", "path": "/0", "value": "first"}]),
        (["only"], [{"op": "remove", "path": "/0"}]),
        ({}, [{"op": "add", "path": "/a~1b~0é", "value": {"x": [1.5, None]}}]),
        ({"a": 1}, [{"op": "remove", "path": "/a"}]),
        (
            {"a": 1, "b": 2},
            [{"op": "remove", "path": "/b"}, {"op": "add", "path": "/c", "value": 3}],
        ),
        ({"a": "x"}, [{"op": "add", "path": "/a", "value": "longer"}]),
        (
            [1, 2, 3],
            [{"op": "remove", "path": "/1"}, {"op": "replace", "path": "/0", "value": "ü"}],
        ),
        ({"deep": {"l": [[]]}}, [{"op": "add", "path": "/deep/l/0/0", "value": True}]),
        ({"a": 1}, [{"op": "replace", "path": "", "value": ["root"]}]),
    ],
)
def test_a_sized_patch_counts_commas_keys_and_empty_containers(old, ops):
    """Adding to an empty list or object brings no comma, removing the last member takes
    none away; a key is counted as canonical JSON writes it (escaped, UTF-8)."""
    patched, size = diff.apply_sized(copy.deepcopy(old), ops, len(canonical.dumps(old)))
    assert size == len(canonical.dumps(patched))
    assert patched == jsonpatch.apply_patch(copy.deepcopy(old), ops)


@settings(deadline=None, max_examples=300)
@given(documents, documents)
def test_same_is_having_the_same_canonical_bytes(a, b):
    assert diff.same(a, b) == (canonical.dumps(a) == canonical.dumps(b))
    assert diff.same(a, copy.deepcopy(a))


@pytest.mark.parametrize(
    ("a", "b"), [(1, 1.0), (1, True), (0.0, -0.0), ([0.0], [-0.0]), ({"k": 1}, {"k": 1.0})]
)
def test_same_tells_apart_what_python_calls_equal(a, b):
    assert a == b
    assert not diff.same(a, b)
    assert canonical.dumps(a) != canonical.dumps(b)


def test_a_change_of_zero_s_sign_is_a_change():
    old, new = {"x": [0.0, 1]}, {"x": [-0.0, 1]}
    ops = diff.diff(old, new, strict=True)
    patched = diff.apply_own(copy.deepcopy(old), canonical.loads(canonical.dumps(ops)))
    assert canonical.dumps(patched) == canonical.dumps(new)
