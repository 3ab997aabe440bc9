"""The compiled walk that lets a write skip its read-back decode (armdb._core.plain).

A payload or map value is stored only if the readers can decode it back (SPEC Q1: what
a lease returns is what was pushed, up to tuples becoming lists).  ``reads_back`` may
answer True only for values whose msgpack encoding decodes; when it answers False the
write path decodes as before, so a False is never wrong, only slower.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from armdb import Db, queue
from armdb._core.plain import reads_back, reads_back_one
from armdb._pack import packb, unpackb
from armdb.errors import PayloadTypeError

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                    st.text(max_size=8), st.binary(max_size=8))
keys = st.one_of(scalars, st.tuples(st.integers(0, 3), st.text(max_size=2)))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.tuples(inner, inner), st.dictionaries(keys, inner, max_size=4)), max_leaves=20)


def _lists(v):
    if isinstance(v, (list, tuple)):
        return [_lists(x) for x in v]
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    return v


@settings(max_examples=400, deadline=None)
@given(values)
def test_q3_a_value_the_walk_accepts_decodes_to_itself(v):
    # SPEC Q1: a payload the walk passes reads back equal (tuples as lists)
    if reads_back_one(v):
        assert unpackb(packb(v)) == _lists(v)
        assert reads_back([v, v])


@pytest.mark.parametrize("v", [
    {(1, 2): "x"},                       # a tuple key: stored as an array, unreadable as a key
    {"a": [{"b": {(1,): 2}}]},           # the same, deep inside
    {"a": msgpack.ExtType(1, b"x")},     # not a plain type: the decode decides
    [1, True.__class__(1), 2.5, object],  # an object (packing refuses it anyway)
])
def test_q3_the_walk_leaves_anything_else_to_the_decode(v):
    # SPEC Q1: the walk never vouches for a value it does not know
    assert not reads_back_one(v)
    assert not reads_back([1, v])


def test_q3_nesting_deeper_than_msgpack_packs_is_not_vouched_for():
    # SPEC Q1: the walk stops below msgpack's nesting limit
    v: list = []
    for _ in range(600):
        v = [v]
    assert not reads_back_one(v)


def test_q3_a_batch_with_one_unreadable_payload_names_it_and_pushes_nothing(tmp_path):
    # SPEC Q1, Q31: the batch path falls back to checking each payload, which names the bad one
    with Db.open(tmp_path / "db") as db:
        q = db.open_queue(queue("docs", payload=dict, var=True))
        with pytest.raises(PayloadTypeError, match="payload 2 of the batch"):
            q.push_many([{"a": 1}, {"b": [1, 2]}, {(1, 2): "x"}])
        assert len(q) == 0
        ids = q.push_many([{"a": (1, 2)}, {"b": {"c": None}}])
        assert [j.payload for j in q.peek(10)] == [{"a": [1, 2]}, {"b": {"c": None}}]
        assert len(ids) == 2
