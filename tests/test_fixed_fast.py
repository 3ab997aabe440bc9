"""The fixed queue's lean paths (issue 17, round 3): the slot CRC's kernels, the index's
batch removal and finger, and the compiled push / lease / ack (``FixedFast``) against
the Python bodies they hand the unusual cases to."""

from __future__ import annotations

import os
import random
import zlib
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import armdb
from armdb import QueueConfig, StaleToken, queue
from armdb._core import fixed as K
from armdb._core.qindex import KeyIndex
from armdb.check import check
from armdb.errors import ConfigError, DbClosed, NotALease, QueueFull

from .conftest import FakeClock

Ping = queue("ping", payload=np.dtype([("doc", "<u8"), ("flags", "<u4")]))
Floaty = queue("floaty", payload=np.dtype([("x", "<f8"), ("n", "<u4")]))


@pytest.fixture(params=[True, False], ids=["clmul", "tables"])
def crc_mode(request: pytest.FixtureRequest):
    was = K.use_clmul()
    K.use_clmul(request.param)
    yield request.param
    K.use_clmul(was)


def test_s4_crc_kernels_equal_zlib_on_every_length_and_offset(crc_mode: bool) -> None:
    # SPEC S4: slot, log and Bitcask CRCs are zlib's CRC-32, whichever kernel computes them
    rnd = random.Random(7)
    data = os.urandom(5000)
    for n in list(range(0, 260)) + [1000, 4096, 4999]:
        for off in (0, 1, 5):
            x = data[off:off + n]
            c = rnd.getrandbits(32)
            assert K.crc32(x) == zlib.crc32(x)
            assert K.crc32(x, c) == zlib.crc32(x, c)
            # the zero-extension map, on more widths than its cache holds
            pad = rnd.choice((0, 1, 15, 60, 121, 700))
            assert K.crc32_padded(x, len(x) + pad, c) == zlib.crc32(x + bytes(pad), c)


def test_s4_slot_writes_carry_the_crc_open_checks(tmp_path: Path, crc_mode: bool) -> None:
    # SPEC S4: every slot a push, lease and ack wrote passes the CRC validation of a reopen
    db = armdb.Db.open(tmp_path / "db")
    q = db.open_queue(Ping)
    q.push_many(np.zeros(50, dtype=Ping.dtype))
    for i in range(20):
        q.push((i, i))
    b = q.lease_batch(30)
    q.ack_many(b)
    (lz,) = q.lease(1)
    q.ack(lz)
    db.shutdown()
    report = check(tmp_path / "db")
    assert report.ok, str(report)
    db = armdb.Db.open(tmp_path / "db")
    assert db.open_queue(Ping).len() == 39
    db.shutdown()


def test_q8_remove_many_matches_one_by_one_removal() -> None:
    # SPEC Q8: a batch removal leaves the index a key-by-key removal would
    rnd = random.Random(3)
    for trial in range(40):
        a, b = KeyIndex(block_size=8), KeyIndex(block_size=8)
        keys = sorted({(rnd.randrange(50), rnd.randrange(10_000)) for _ in range(rnd.randrange(1, 300))})
        for i, (d, s) in enumerate(keys):
            dl = rnd.choice((0, 0, 5 + i))
            a.insert(d, s, i, dl)
            b.insert(d, s, i, dl)
        pick = rnd.sample(keys, rnd.randrange(0, len(keys) + 1))
        if trial % 3 == 0:
            pick.sort()
        gone = [(7777, 1), (51, 3)]  # absent keys
        extra = pick[:2]  # repeated keys
        todo = pick + gone + extra
        out = a.remove_many(np.array([k[0] for k in todo], np.uint64), np.array([k[1] for k in todo], np.uint64))
        want = [b.remove(d, s) for d, s in pick] + [-1] * (len(gone) + len(extra))
        assert out.tolist() == want
        a.check()
        for x, y in zip(a.to_arrays(), b.to_arrays(), strict=True):
            assert x.tolist() == y.tolist()
        assert len(a) == len(b)


def test_q8_finger_never_returns_a_stale_entry() -> None:
    # SPEC Q8: the finger of the last lookup is a hint; after any change a lookup is exact
    rnd = random.Random(5)
    ix = KeyIndex(block_size=4)
    model: dict[tuple[int, int], int] = {}
    for step in range(3000):
        d, s = rnd.randrange(20), rnd.randrange(200)
        op = rnd.random()
        if op < 0.45 and (d, s) not in model:
            ix.insert(d, s, step, 0)
            model[(d, s)] = step
        elif op < 0.75:
            assert ix.remove(d, s) == model.pop((d, s), -1)
        else:
            got = ix.get(d, s)
            assert (got[0] if got else None) == model.get((d, s))
        if model and rnd.random() < 0.3:  # walk a run of neighbours, the finger's case
            ks = sorted(model)
            i = rnd.randrange(len(ks))
            for k in ks[i:i + 5]:
                assert ix.get(*k)[0] == model[k]
    ix.check()


# -- the compiled push / lease / ack and their hand-backs -----------------------------------


def test_q9_q13_fast_cycle_and_every_hand_back(db: armdb.Db, clock: FakeClock) -> None:
    # SPEC Q9, Q13, Q20: the compiled calls and the Python bodies give the same results
    q = db.open_queue(Ping)
    assert q._fast is not None
    a = q.push((1, 2))
    b = q.push((2, 3), delay=timedelta(seconds=5))  # a delay: the Python body
    c = q.push(np.array((3, 4), dtype=Ping.dtype)[()])  # a record: the codec encodes it
    assert (a, c) == (a, a + 2) and b == a + 1
    with pytest.raises(armdb.PayloadTypeError):
        q.push((1, -5))  # the plain struct refuses it; the codec says why
    with pytest.raises(armdb.PayloadTypeError):
        q.push((1, 2, 3))
    got = q.lease(5)
    assert [lz.id for lz in got] == [a, c]
    assert got[0].payload["doc"] == 1 and got[1].payload["flags"] == 4
    q.ack(got[0])  # a Lease
    q.ack(got[1].token)  # a token
    with pytest.raises(StaleToken, match="already acked"):
        q.ack(got[0].token)
    with pytest.raises(NotALease):
        q.ack("x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        q.lease(0)
    with pytest.raises(ConfigError):
        q.lease(True)  # type: ignore[arg-type]
    clock.advance(6)
    (lz,) = q.lease(1, lease_timeout=timedelta(seconds=1))  # a timeout: the Python body
    assert lz.id == b
    clock.advance(2)
    (again,) = q.lease(1)  # the lease expired: leased again, the old token is stale
    assert again.id == b and again.attempt == 2
    with pytest.raises(StaleToken, match="leased again"):
        q.ack(lz)
    q.ack(again)
    assert q.len() == 0


def test_q21_max_depth_queue_pushes_through_the_checked_body(db: armdb.Db) -> None:
    # SPEC Q21: max_depth is judged on every push, compiled path or not
    q = db.open_queue(Ping, QueueConfig.balanced().max_depth(2).build())
    q.push((1, 1))
    q.push((2, 2))
    with pytest.raises(QueueFull):
        q.push((3, 3))


def test_q35_float_fields_take_the_codec(db: armdb.Db) -> None:
    # SPEC Q35: a dtype with a float field has no plain struct: the codec checks each value
    q = db.open_queue(Floaty)
    q.push((1.5, 2))
    q.push((6, 3))  # an int into a float field: lossless, taken
    with pytest.raises(armdb.PayloadTypeError):
        q.push((1.5, 2.5))
    got = q.lease(2)
    assert [float(lz.payload["x"]) for lz in got] == [1.5, 6.0]


def test_q28_several_shards_push_ack_fast_and_lease_through_the_merge(db_path: Path, clock: FakeClock) -> None:
    # SPEC Q9, Q28: with several shards the lease merges them in key order (Python body)
    db = armdb.Db.open(db_path, clock=clock)
    try:
        q = db.open_queue(Ping, QueueConfig.balanced().header_config(
            armdb.FixedConfig(shard_count=3)).build())
        ids = [q.push((i, 0)) for i in range(7)]
        got = q.lease(7)
        assert [lz.id for lz in got] == ids
        for lz in got:
            q.ack(lz)
        assert q.len() == 0
    finally:
        db.shutdown()


def test_d2_closed_db_refuses_through_the_python_body(db_path: Path) -> None:
    # SPEC D2: after close every call raises DbClosed, compiled path or not
    db = armdb.Db.open(db_path)
    q = db.open_queue(Ping)
    q.push((1, 1))
    (lz,) = q.lease(1)
    db.close()
    with pytest.raises(DbClosed):
        q.push((2, 2))
    with pytest.raises(DbClosed):
        q.lease(1)
    with pytest.raises(DbClosed):
        q.ack(lz)


def test_q32_a_lease_twice_in_a_batch_of_several_shards(db_path: Path, clock: FakeClock) -> None:
    # SPEC Q32: a repeated lease refuses the whole batch, in whichever shard it lives
    db = armdb.Db.open(db_path, clock=clock)
    try:
        q = db.open_queue(Ping, QueueConfig.balanced().header_config(
            armdb.FixedConfig(shard_count=2)).build())
        q.push_many(np.zeros(6, dtype=Ping.dtype))
        got = q.lease(6)
        with pytest.raises(StaleToken, match="twice"):
            q.ack_many([got[0], got[3], got[5], got[3]])
        assert q.ack_many(got) == 6
    finally:
        db.shutdown()


# -- round 4: the public methods are the compiled calls --------------------------------------


def _refusal(call, *args, **kw) -> tuple[type, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(armdb.ArmdbError) as e:
        call(*args, **kw)
    return type(e.value), str(e.value)


def test_q9_public_calls_are_compiled_and_refuse_as_the_python_bodies(db: armdb.Db, clock: FakeClock) -> None:
    # SPEC Q9, Q13, Q30: a fixed queue's push, lease and ack are FixedFast's methods; each
    # refusal is the Python body's, same class and same message
    from armdb._core.qshard import FixedFast
    from armdb.queue import MAX_LEASE, LeaseToken

    q = db.open_queue(Ping)
    assert isinstance(q.push.__self__, FixedFast)  # type: ignore[attr-defined]
    assert isinstance(q.lease.__self__, FixedFast)  # type: ignore[attr-defined]
    assert isinstance(q.ack.__self__, FixedFast)  # type: ignore[attr-defined]
    # the keyword arguments of the documented signatures
    a = q.push(payload=(1, 1))
    b = q.push((2, 2), delay=1.5)
    (lz,) = q.lease(n=1, lease_timeout=timedelta(seconds=3))
    assert lz.id == a and lz.deadline == armdb._clock.ms_to_datetime(clock.ms + 3000)
    q.ack(token=lz)
    clock.advance(2)
    (lb,) = q.lease()
    assert lb.id == b
    # refusals: the compiled call against the Python body, same arguments
    assert _refusal(q.push, (1, -1)) == _refusal(q._push, (1, -1), None)
    assert _refusal(q.push, "x") == _refusal(q._push, "x", None)
    assert _refusal(q.push, (1, 1), delay=-1) == _refusal(q._push, (1, 1), -1)
    for n in (0, -1, True, 1.0, "1", MAX_LEASE + 1):
        assert _refusal(q.lease, n) == _refusal(q._lease, n, None)
    assert _refusal(q.lease, 1, lease_timeout=0) == _refusal(q._lease, 1, 0)
    q.ack(lb)
    tok = lb.token
    bad_tokens: list[object] = [
        lb, tok, "x", None, (tok.handle, 0, tok.due, tok.seq, tok.epoch),  # acked; not leases
        tok._replace(handle=tok.handle + 1),  # another handle
        tok._replace(shard=5), tok._replace(shard=-1), tok._replace(shard=2 ** 80),
        tok._replace(due=-1), tok._replace(seq=2 ** 70), tok._replace(epoch=2 ** 40), tok._replace(epoch=None),
        lb._replace(token=tuple(tok)),  # a Lease whose token is a plain tuple
    ]
    for t in bad_tokens:
        assert _refusal(q.ack, t) == _refusal(q._ack, t), t
    assert isinstance(tok, LeaseToken)
    db.close()
    assert _refusal(q.push, (1, 1)) == _refusal(q._push, (1, 1), None)
    assert _refusal(q.lease, 1) == _refusal(q._lease, 1, None)
    assert _refusal(q.ack, lb) == _refusal(q._ack, lb)


def test_q10_lease_deadlines_equal_the_clock_conversion(db: armdb.Db, clock: FakeClock) -> None:
    # SPEC Q10: the deadline the compiled lease hands out (stepped from the last one) is
    # the datetime of now + lease timeout, whatever the clock did in between
    q = db.open_queue(Ping, QueueConfig.balanced().lease_timeout(timedelta(seconds=7)).build())
    rnd = random.Random(11)
    steps = [0, 1, 1, 999, 1000, 1001, -1, -999, 86_399_999, 86_400_000, -86_400_001, 3, 123_456_789]
    steps += [rnd.randrange(-5_000_000, 5_000_000) for _ in range(200)]
    for step in steps:
        clock.ms += step
        q.push((1, 1))
        (lz,) = q.lease(1)
        assert lz.deadline == armdb._clock.ms_to_datetime(clock.ms + 7000), step
        q.ack(lz)
