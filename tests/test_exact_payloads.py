"""SPEC Q35: a fixed payload is stored exactly or refused, naming the field.

Before, ``push((6.7, 1.0, b"x"))`` into ``[u8, f4, S8]`` stored ``doc=6`` and a 13-byte
tag was cut to 8, silently.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import armdb
from armdb import QueueConfig
from armdb.errors import PayloadTypeError
from armdb.qspec import FixedCodec

DOC = np.dtype([("doc", "<u8"), ("score", "<f4"), ("tag", "S8")])
Docs = armdb.queue("docs", payload=DOC)


def cfg() -> QueueConfig:
    return QueueConfig.balanced().build()


def _roundtrip(db: armdb.Db, value: object) -> tuple:
    q = db.open_queue(Docs, cfg())
    q.push(value)
    (lease,) = q.lease(1)
    q.ack(lease.token)
    return tuple(lease.payload.tolist())


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ((6.7, 1.0, b"x"), "doc"),  # a fractional float into an integer field
        ((6, 1.0, b"x" * 13), "tag"),  # 13 bytes into 8
        ((-1, 1.0, b"x"), "doc"),  # out of the unsigned range
        ((np.int64(-5), 1.0, b"x"), "doc"),  # a NumPy int NumPy would wrap
        ((6, 1e300, b"x"), "score"),  # overflows f4 to infinity
        ((6, 1.0, "h\u00e9llo"), "tag"),  # not ASCII: cannot be bytes
        ((6, 1.0, 12), "tag"),  # an int is not bytes
    ],
)
def test_q35_lossy_fixed_payload_is_refused_naming_the_field(db, value, field):
    q = db.open_queue(Docs, cfg())
    with pytest.raises(PayloadTypeError, match=rf"does not fit dtype.*{field}"):
        q.push(value)
    assert q.len() == 0 and q.stats().pushes == 0  # nothing written


@pytest.mark.parametrize(
    ("value", "stored"),
    [
        ((6, 1.0, b"x"), (6, 1.0, b"x")),
        ((6, 2, b"abc"), (6, 2.0, b"abc")),  # the int 2 into a float field
        ((6.0, 1.5, b"x"), (6, 1.5, b"x")),  # an integral float into an integer field
        ((np.uint8(7), np.float32(0.5), np.bytes_(b"t")), (7, 0.5, b"t")),
        ((True, 0.0, b""), (1, 0.0, b"")),
        ((2**64 - 1, -0.0, b"12345678"), (2**64 - 1, -0.0, b"12345678")),  # the field's full width
        ((6, 1.0, "ascii"), (6, 1.0, b"ascii")),  # an ASCII str into a bytes field
    ],
)
def test_q35_lossless_fixed_payload_is_accepted(db, value, stored):
    assert _roundtrip(db, value) == stored


def test_q35_float_into_a_narrower_float_field_is_rounded_not_refused(db):
    # Documented choice: f4 means single precision; 0.1 is stored as the nearest f4.
    doc, score, _tag = _roundtrip(db, (1, 0.1, b"x"))
    assert score == float(np.float32(0.1)) and doc == 1


@pytest.mark.parametrize(
    ("dtype", "bad", "good"),
    [
        (np.dtype([("flag", "?"), ("n", "<i2")]), (5, 1), (True, 1)),  # 5 is not a bool
        (np.dtype([("flag", "?"), ("n", "<i2")]), ("yes", 1), (False, -3)),
        (np.dtype([("x", "<f8"), ("n", "<i2")]), (2**60 + 1, 1), (2**52, 1)),  # not exact in f8
        (np.dtype([("n", "<i2"), ("x", "<f8")]), (40000, 1.0), (-32768, 1.0)),
        (np.dtype([("name", "<U4"), ("n", "u1")]), ("toolong", 1), ("four", 255)),
        (np.dtype([("v", "<i4", (3,))]), (([1, 2, 3.5],)), (([1, 2, 3],))),
        (np.dtype([("inner", [("a", "u1"), ("b", "<f8")]), ("c", "u1")]), ((256, 1.0), 1), ((255, 1.5), 0)),
        (np.dtype([("raw", "V4"), ("n", "u1")]), (b"abcde", 1), (b"ab", 1)),  # raw bytes: padded, never cut
    ],
)
def test_q35_every_field_kind(dtype, bad, good):
    codec = FixedCodec(dtype)
    with pytest.raises(PayloadTypeError, match="does not fit dtype"):
        codec.encode(bad)
    stored = np.frombuffer(codec.encode(good), dtype=dtype)
    assert stored.tobytes() == np.array([good], dtype=dtype).tobytes()


_FIELD = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.binary(max_size=12),
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(st.tuples(_FIELD, _FIELD, _FIELD))
@example((0, math.inf, b""))  # an infinity is stored as itself (hypothesis found the old check wrong)
@example((0, 1e300, b""))  # a finite value past float32's range is refused
def test_q35_any_value_is_stored_exactly_or_refused(value):
    codec = FixedCodec(DOC)
    try:
        raw = codec.encode(value)
    except PayloadTypeError:
        return
    doc, score, tag = np.frombuffer(raw, dtype=DOC)[0].tolist()
    assert doc == value[0] and isinstance(value[0], (int, float))
    if isinstance(value[1], float):
        # Rounded to the nearest float32, and an infinity only for an infinity: a finite
        # value too large for the field is refused, never stored as inf.
        assert score == float(np.float32(value[1])) and math.isfinite(score) == math.isfinite(value[1])
    else:
        assert score == value[1]
    assert isinstance(value[2], bytes) and tag == value[2].rstrip(b"\0")
