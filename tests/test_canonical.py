import math

import pytest

from durability import canonical
from durability.errors import StateNotJSON


def test_canonical_bytes_sort_keys_and_are_stable():
    assert canonical.dumps({"b": 1, "a": [1.5, "é"]}) == b'{"a":[1.5,"\xc3\xa9"],"b":1}'
    assert canonical.sha256_hex(canonical.dumps({"a": 1, "b": 2})) == canonical.sha256_hex(
        canonical.dumps({"b": 2, "a": 1})
    )


@pytest.mark.parametrize(
    "value, where",
    [
        ({"x": math.nan}, "/x"),
        ({"x": [1, math.inf]}, "/x/1"),
        ({"x": (1, 2)}, "/x"),
        ({"x": {1: "a"}}, "/x"),
        ({"x": 2**70}, "/x"),
        ({"x": {1, 2}}, "/x"),
    ],
)
def test_values_json_cannot_carry_exactly_are_refused_with_their_path(value, where):
    with pytest.raises(StateNotJSON) as err:
        canonical.check_json(value, what="state")
    assert where in str(err.value)


def test_datetime_is_refused_rather_than_turned_into_a_string():
    import datetime

    with pytest.raises(StateNotJSON):
        canonical.dumps({"at": datetime.datetime.now()})


def test_hmac_chain_differs_from_plain_chain():
    args = {
        "run_id": "r",
        "seq": 1,
        "step": "s",
        "next_step": "t",
        "schema_version": 1,
        "agent_version": "1",
    }
    plain = canonical.chain_hash("", "h", **args)
    keyed = canonical.chain_hash("", "h", key=b"k", **args)
    assert plain != keyed and len(keyed) == 64
