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
from armdb._core import plain
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


# -- bodies a client encoded (plain.bodies_decode) ----------------------------------------
#
# The owner stores a client's bodies as they came once it knows each decodes to a payload
# of the queue's type (SPEC P2: the server runs the queue's own rules). ``bodies_decode``
# may answer True only when msgpack's own decode of each body succeeds, with nothing after
# the value, to that outer type; a False sends the batch to the decode, which names what
# is wrong.

_KIND_OF = {dict: plain.KIND_MAP, list: plain.KIND_ARRAY, str: plain.KIND_STR, bytes: plain.KIND_BIN,
            int: plain.KIND_INT, float: plain.KIND_FLOAT, bool: plain.KIND_BOOL}
texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=6)
wire_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), texts, st.binary(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(texts, st.integers(-5, 5), st.binary(max_size=3)), inner,
                                            max_size=4)),
    max_leaves=16)


def _decoded_kind_ok(raw, kind, arity=0):
    """msgpack's verdict on one body: decodes whole, to ``kind``."""
    try:
        v = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001
        return False
    if kind == plain.KIND_ANY:
        return True
    if kind == plain.KIND_FIELDS:
        return type(v) is list and len(v) == arity
    want = {v2: k for k, v2 in _KIND_OF.items()}[kind]
    return type(v) is want


@settings(max_examples=500, deadline=None)
@given(wire_values)
def test_p2_a_body_the_walk_accepts_decodes_whole_to_its_type(v):
    # SPEC P2: every plain value packed by a client passes, and only as its own outer type
    raw = msgpack.packb(v, use_bin_type=True)
    assert plain.bodies_decode([raw], plain.KIND_ANY)
    for kind in (plain.KIND_MAP, plain.KIND_ARRAY, plain.KIND_STR, plain.KIND_BIN, plain.KIND_INT, plain.KIND_FLOAT,
                 plain.KIND_BOOL):
        assert plain.bodies_decode([raw], kind) == _decoded_kind_ok(raw, kind)
    if type(v) is list:
        assert plain.bodies_decode([raw], plain.KIND_FIELDS, len(v))
        assert not plain.bodies_decode([raw], plain.KIND_FIELDS, len(v) + 1)


@settings(max_examples=1500, deadline=None)
@given(wire_values, st.data())
def test_p2_a_damaged_body_is_never_vouched_for(v, data):
    # SPEC P2: cut, extended or with one byte changed, a body the walk still passes is one
    # msgpack decodes whole to the same outer type
    raw = bytearray(msgpack.packb(v, use_bin_type=True))
    how = data.draw(st.sampled_from(["cut", "extend", "flip", "insert"]))
    if how == "cut":
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    elif how == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=4))
    elif how == "flip":
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    else:
        at = data.draw(st.integers(0, len(raw)))
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=3))
    raw = bytes(raw)
    for kind in (plain.KIND_ANY, plain.KIND_MAP, plain.KIND_ARRAY, plain.KIND_STR, plain.KIND_BIN, plain.KIND_INT):
        if plain.bodies_decode([raw], kind):
            assert _decoded_kind_ok(raw, kind), (raw, kind)


@pytest.mark.parametrize("raw", [
    b"",                                   # no value
    b"\x81\xa1a\x01\x00",                  # a value and a byte after it
    b"\x81\x91\x01\x02",                   # an array as a map key: unhashable when decoded
    b"\x81\x80\x01",                       # a map as a map key
    b"\xa3\xed\xa0\x80",                   # a UTF-16 surrogate in UTF-8: refused by Python's decoder
    b"\xa2\xc0\x80",                       # an overlong form
    b"\xa4\xf4\x90\x80\x80",               # above U+10FFFF
    b"\xa1\xe2",                           # a sequence cut inside the string
    b"\xc1",                               # the never-used byte
    b"\xd4\x01\x02",                       # an extension type: left to the decode
    b"\xdd\x00\x00\x00\x05\x01",           # an array announcing more items than follow
    b"\xdb\xff\xff\xff\xff",               # a string announcing 4 GiB
])
def test_p2_the_walk_leaves_bad_or_unusual_bodies_to_the_decode(raw):
    # SPEC P2: a False is never wrong, only slower; these all need the decode's verdict
    assert not plain.bodies_decode([raw], plain.KIND_ANY)
    assert not plain.bodies_decode([msgpack.packb({"a": 1}), raw], plain.KIND_ANY)


def test_p2_a_body_nested_past_the_walks_depth_is_left_to_the_decode():
    # SPEC P2: the walk stops below msgpack's nesting limit
    raw = b"\x91" * 600 + b"\x01"
    assert not plain.bodies_decode([raw], plain.KIND_ANY)
    assert plain.bodies_decode([b"\x91" * 100 + b"\x01"], plain.KIND_ARRAY)


def test_p2_a_client_batch_with_a_bad_body_is_named_and_nothing_is_pushed(tmp_path):
    # SPEC P2, Q31: the fast check passes the good batch as it came; a bad body sends the
    # batch to the per-body check, which names it, and nothing is stored
    with Db.open(tmp_path / "db") as db:
        q = db.open_queue(queue("docs", payload=dict, var=True))
        good = [msgpack.packb({"a": i}) for i in range(3)]
        assert q._push_many_encoded(good) == [1, 2, 3]
        with pytest.raises(PayloadTypeError, match="payload 1 of the batch.*not a dict"):
            q._push_many_encoded([good[0], msgpack.packb([1, 2])])
        with pytest.raises(PayloadTypeError, match="payload 2 of the batch.*not one complete msgpack value"):
            q._push_many_encoded([good[0], good[1], good[2] + b"\x00"])
        assert [j.payload for j in q.peek(10)] == [{"a": 0}, {"a": 1}, {"a": 2}]
