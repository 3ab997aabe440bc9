"""The one-value plain codec kernels a var queue's push and ``lease(1)`` call from C
(``armdb._core.plainpack.pack_one`` and ``unpack_one``, through their Python doors
``pack_one_plain`` and ``unpack_one_plain``) against what they replace: the codec's
``pack_plain([value])`` and ``unpack_plain([raw])`` (and so msgpack), including None (the
codec's msgpack path) for anything not plain."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import armdb
from armdb import queue
from armdb._core.plainpack import pack_one_plain, pack_plain, unpack_one_plain, unpack_plain

from .test_batch_kernels import _same, values

_P = msgpack.Packer(use_bin_type=True)
bodies = st.one_of(st.binary(max_size=60), values.map(_P.pack))


@settings(max_examples=200, deadline=None)
@given(values)
def test_q1_pack_one_packs_what_pack_plain_packs(v):
    # SPEC Q1: the same bytes as the list kernel and msgpack, or None where it gives None
    got = pack_plain([v])
    assert pack_one_plain(v) == (None if got is None else got[0])
    if got is not None:
        assert got[0] == _P.pack(v)


@settings(max_examples=200, deadline=None)
@given(bodies)
def test_q1_unpack_one_reads_what_unpack_plain_reads(raw):
    # SPEC Q1: the same value, of the same types all the way down, or "not plain" where
    # the list kernel leaves the body to msgpack
    got = unpack_plain([raw])
    ok, x = unpack_one_plain(raw)
    assert ok == (got is not None)
    if ok:
        assert _same(x, got[0])
    else:
        assert x is None


def test_q1_one_value_kernels_leave_what_is_not_plain_to_msgpack():
    for bad in (2**64, -(2**63) - 1, "\ud800", {(1,): 2}, object(), msgpack.ExtType(1, b"x"), {"x": {1, 2}}):
        assert pack_one_plain(bad) is None, bad
    for bad in (b"\xc1", b"\xd4\x01\x00", b"\x92\x01", b"\x01\x02", b"", b"\xc4\x05ab", b"\x82\xa0\x01"):
        assert unpack_one_plain(bad) == (False, None), bad


Things = queue("things", payload=dict, var=True)
Anything = queue("anything", payload=object, var=True)


def test_q9_a_pushed_payload_the_plain_codec_refuses_takes_the_codec_s_path(tmp_path):
    # SPEC Q1, Q9: VarFast packs a payload of the queue's type with pack_one; one it does
    # not take (a set inside, an int past 64 bits) goes to the codec's encode, whose
    # refusal or msgpack bytes are what the user gets, and each leases back as it was pushed
    with armdb.Db.open(tmp_path / "db") as db:
        q = db.open_queue(Things)
        a = q.push({"n": 1, "s": "é" * 40})
        b = q.push({"big": 2**64 - 1})
        with pytest.raises(Exception) as compiled:  # noqa: PT011 - compared with the Python body's
            q.push({"x": {1, 2}})
        with pytest.raises(Exception) as python:  # noqa: PT011
            q._push({"x": {1, 2}}, None)
        assert (type(compiled.value), str(compiled.value)) == (type(python.value), str(python.value))
        got = {lz.id: lz.payload for lz in q.lease(1) + q.lease(1)}
        assert got == {a: {"n": 1, "s": "é" * 40}, b: {"big": 2**64 - 1}}
        o = db.open_queue(Anything)
        c = o.push([1, "x", b"y"])
        (lz,) = o.lease(1)
        assert lz.id == c and lz.payload == [1, "x", b"y"]
