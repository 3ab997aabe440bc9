"""Queue semantics, rule by rule (SPEC section 4).  Fixed and var flavours where both apply."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest

import armdb
from armdb import Config, ConfigError, FixedConfig, QueueConfig, State
from armdb.errors import (
    DbClosed,
    NotALease,
    PayloadTypeError,
    QueueAlreadyOpen,
    QueueFull,
    SchemaMismatch,
    StaleToken,
)

from .conftest import FakeClock


@dataclass
class Job:
    doc_id: int
    reason: str


PING = np.dtype([("doc", "<u8"), ("flags", "<u4")])
FixedQ = armdb.queue("pings", payload=PING)
VarQ = armdb.queue("jobs", payload=Job, var=True)


def make(flavour: str, i: int):
    return (i, i % 7) if flavour == "fixed" else Job(i, f"r{i}")


def ident(flavour: str, payload) -> int:
    return int(payload["doc"]) if flavour == "fixed" else payload.doc_id


def cfg(**kw) -> QueueConfig:
    b = QueueConfig.balanced().header_config(FixedConfig.balanced().grow_step(1024).build())
    for k, v in kw.items():
        b = getattr(b, k)(v)
    return b.build()


@pytest.fixture(params=["fixed", "var"])
def flavour(request) -> str:
    return request.param


@pytest.fixture
def q(db, flavour):
    return db.open_queue(FixedQ if flavour == "fixed" else VarQ, cfg(max_attempts=3, backoff_secs=[10, 20]))


# -- Q1 declarations --------------------------------------------------------------------------


def test_q1_spec_fields():
    assert VarQ.name == "jobs" and VarQ.payload_name == "jobs.payload" and VarQ.var
    assert FixedQ.payload_name == "pings.payload" and not FixedQ.var
    with pytest.raises(dataclasses.FrozenInstanceError):
        VarQ.name = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    "payload",
    [int, "u8", np.dtype("O"), np.dtype([("a", "O")]), np.dtype(("u1", 4097)), Job, None],
)
def test_q1_fixed_declaration_rejects(payload):
    with pytest.raises(ConfigError, match="payload|dtype|inline"):
        armdb.queue("bad", payload=payload)


def test_q1_fixed_declaration_accepts_max_and_scalar():
    assert armdb.queue("big", payload=np.dtype(("u1", 4096))).dtype.itemsize == 4096
    assert armdb.queue("scalar", payload=np.dtype("<u8")).dtype == np.dtype("<u8")


def test_q1_var_declaration_rejects_unknown_type():
    with pytest.raises(ConfigError, match="var queue's payload"):
        armdb.queue("bad", payload=set, var=True)


def test_q1_fixed_push_forms(db):
    qq = db.open_queue(FixedQ, cfg())
    rec = np.zeros((), dtype=PING)[()]
    rec["doc"] = 5
    qq.push(rec)
    qq.push((6, 1))
    got = sorted(int(lz.payload["doc"]) for lz in qq.lease(5))
    assert got == [5, 6]
    s = db.open_queue(armdb.queue("scal", payload=np.dtype("<u8")), cfg())
    s.push(7)
    (lz,) = s.lease()
    assert lz.payload == 7 and isinstance(lz.payload, np.uint64)


@pytest.mark.parametrize("bad", ["x", (1,), (1, 2, 3), None, 1.5, [1, 2]])
def test_q1_fixed_wrong_payload_writes_nothing(db, bad):
    qq = db.open_queue(FixedQ, cfg())
    with pytest.raises(PayloadTypeError):
        qq.push(bad)
    assert qq.len() == 0 and qq.stats().pushes == 0


@pytest.mark.parametrize("bad", [("x", "y"), {"doc_id": 1}, 5, b"raw"])
def test_q1_var_wrong_type_writes_nothing(db, bad):
    qq = db.open_queue(VarQ, cfg())
    with pytest.raises(PayloadTypeError, match="Job"):
        qq.push(bad)
    assert qq.len() == 0 and qq.stats().payload_writes == 0


def test_q1_var_unencodable_writes_nothing(db):
    qq = db.open_queue(VarQ, cfg())
    with pytest.raises(PayloadTypeError, match="msgpack"):
        qq.push(Job(1, object()))  # type: ignore[arg-type]
    assert qq.len() == 0 and qq.stats().payload_writes == 0
    # The thread's packer dropped the half-packed value: the next payload is whole.
    qq.push(Job(2, "x"))
    (lease,) = qq.lease(1)
    assert lease.payload == Job(2, "x")


@pytest.mark.parametrize(
    "ptype,value",
    [(bytes, b"\x00\xffbody"), (str, "text"), (int, -5), (dict, {"a": [1, 2], "b": None}), (list, [1, "x"])],
)
def test_q1_var_msgpack_types_round_trip(db, ptype, value):
    qq = db.open_queue(armdb.queue(f"v{ptype.__name__}", payload=ptype, var=True), cfg())
    qq.push(value)
    (lz,) = qq.lease()
    assert lz.payload == value and type(lz.payload) is ptype


def test_q1_dataclass_comes_back_as_instance(db):
    qq = db.open_queue(VarQ, cfg())
    qq.push(Job(42, "edited"))
    (lz,) = qq.lease()
    assert lz.payload == Job(42, "edited")


# -- Q2 opening ------------------------------------------------------------------------------


def test_q2_schema_mismatch_on_reopen(db_path, clock):
    with armdb.Db.open(db_path, clock=clock) as d:
        d.open_queue(FixedQ, cfg())
        d.open_queue(VarQ, cfg())
    with armdb.Db.open(db_path, clock=clock) as d:
        with pytest.raises(SchemaMismatch, match="payload schema"):
            d.open_queue(armdb.queue("pings", payload=np.dtype([("doc", "<u4")])), cfg())

        @dataclass
        class Other:
            doc_id: str
            reason: str

        with pytest.raises(SchemaMismatch, match="payload schema"):
            d.open_queue(armdb.queue("jobs", payload=Other, var=True), cfg())
        with pytest.raises(SchemaMismatch, match="fixed queue"):
            d.open_queue(armdb.queue("pings", payload=Job, var=True), cfg())
        with pytest.raises(SchemaMismatch, match="var queue"):
            d.open_queue(armdb.queue("jobs", payload=PING), cfg())

        # Same field names and types under another class name is compatible.
        @dataclass
        class Renamed:
            doc_id: int
            reason: str

        d.open_queue(armdb.queue("jobs", payload=Renamed, var=True), cfg())


def test_q2_already_open_and_collisions(db):
    db.open_queue(VarQ, cfg())
    with pytest.raises(QueueAlreadyOpen, match="already open"):
        db.open_queue(VarQ, cfg())
    db.open_map("taken")
    with pytest.raises(ConfigError, match="map"):
        db.open_queue(armdb.queue("taken", payload=PING), cfg())


# -- Q3 no other write path -------------------------------------------------------------------


def test_q3_queue_collections_cannot_be_opened_as_maps(db, q):
    with pytest.raises(ConfigError):
        db.open_map(q.name)
    with pytest.raises(ConfigError, match="reserved"):
        db.open_map(q.name + ".payload")
    public = {n for n in dir(q) if not n.startswith("_")}
    assert public == {
        "push", "lease", "ack", "nack", "len", "dead_len", "next_delay", "wait_due_timeout", "due",
        "stats", "snapshot", "snapshot_frame", "name", "spec", "config", "peek", "redrive", "purge_dead", "extend",
        "push_many", "lease_batch", "ack_many", "release_many",
    }


# -- Q4-Q6 configuration ----------------------------------------------------------------------


def test_q4_defaults():
    c = QueueConfig.balanced().build()
    assert c.max_attempts == 5
    assert c.backoff_secs == (1, 10, 60, 300)
    assert c.lease_timeout == 30 and c.max_depth is None and c.wakeup_recheck == 5
    assert c.dead_retention is None
    assert [c.backoff_for(k) for k in (1, 2, 4, 9)] == [1, 10, 300, 300]


@pytest.mark.parametrize(
    "setter,value",
    [
        ("max_attempts", 0), ("max_attempts", -1), ("backoff_secs", []), ("backoff_secs", [1, -2]),
        ("lease_timeout", 0), ("lease_timeout", timedelta(seconds=-1)), ("wakeup_recheck", 0),
        ("max_depth", 0), ("max_attempts", 1.5), ("lease_timeout", "30"),
    ],
)
def test_q4_build_validates(setter, value):
    b = getattr(QueueConfig.balanced(), setter)(value)
    with pytest.raises(ConfigError):
        b.build()


def test_q4_setters_return_new_builders_and_accept_timedelta():
    base = QueueConfig.balanced()
    other = base.lease_timeout(timedelta(minutes=2))
    assert base.build().lease_timeout == 30 and other.build().lease_timeout == 120


def test_q5_header_config_reversed_normalised_and_preset():
    c = QueueConfig.balanced().header_config(FixedConfig.balanced().reversed(True).grow_step(10).build()).build()
    assert c.header_config.reversed is False and c.header_config.grow_step == 10
    assert QueueConfig.balanced().build().header_config.grow_step == 100_000


def test_q6_payload_config_passed_unchanged(db):
    pc = Config.balanced().shard_count(2).cache_bytes(1 << 16).build()
    qq = db.open_queue(VarQ, QueueConfig.balanced().payload_config(pc).build())
    assert qq.config.payload_config is pc
    shards = sorted(p.name for p in Path(db.path, "collections", "jobs.payload").iterdir() if p.is_dir())
    assert shards == ["shard-000", "shard-001"]


# -- Q8 keys and rows -------------------------------------------------------------------------


def test_q8_dead_rows_sort_after_live_and_keys_are_due_order(db, clock):
    qq = db.open_queue(FixedQ, cfg())
    a = qq.push((1, 0), delay=50)
    b = qq.push((2, 0))
    (lz,) = qq.lease()
    assert lz.id == b
    qq.nack(lz.token, dead=True)
    clock.advance(100)
    (lz2,) = qq.lease()
    assert lz2.id == a
    snap = qq.snapshot()
    assert list(snap["id"]) == [a, b]  # live rows first, then the dead key class
    assert list(snap["state"]) == [State.LEASED, State.DEAD]


# -- Q9 push, lease, expiry ---------------------------------------------------------------------


def test_q9_push_returns_increasing_ids_and_lease_in_key_order(q, flavour):
    ids = [q.push(make(flavour, i)) for i in range(5)]
    assert ids == sorted(ids) and len(set(ids)) == 5
    got = q.lease(10)
    assert [lz.id for lz in got] == ids
    assert [ident(flavour, lz.payload) for lz in got] == list(range(5))


def test_q9_delay_and_stop_at_future(q, flavour, clock):
    q.push(make(flavour, 1), delay=timedelta(seconds=5))
    q.push(make(flavour, 2), delay=1.0)
    assert q.lease(5) == []
    clock.advance(1)
    assert [ident(flavour, lz.payload) for lz in q.lease(5)] == [2]
    clock.advance(4)
    assert [ident(flavour, lz.payload) for lz in q.lease(5)] == [1]


def test_q9_lease_n_must_be_positive(q):
    for bad in (0, -1, 1.0, True):
        with pytest.raises(ConfigError, match="n >= 1"):
            q.lease(bad)


def test_q9_expired_lease_redelivered_with_attempt_2(q, flavour, clock):
    jid = q.push(make(flavour, 1))
    (first,) = q.lease(lease_timeout=10)
    assert first.attempt == 1
    clock.advance(9.999)
    assert q.lease() == []
    clock.advance(0.001)
    (again,) = q.lease()
    assert again.id == jid and again.attempt == 2
    assert q.stats().expired_leases == 1


def test_q9_lease_timeout_override(q, flavour, clock):
    q.push(make(flavour, 1))
    (lz,) = q.lease(lease_timeout=timedelta(seconds=2))
    assert lz.deadline == datetime.fromtimestamp((clock.ms + 2000) / 1000, tz=timezone.utc)
    with pytest.raises(ConfigError):
        q.lease(lease_timeout=0)


def test_q9_exhausted_expired_lease_is_dead_lettered(q, flavour, clock):
    q.push(make(flavour, 1))
    for attempt in (1, 2, 3):
        (lz,) = q.lease(lease_timeout=1)
        assert lz.attempt == attempt
        clock.advance(1)
    assert q.lease() == []
    assert q.len() == 0 and q.dead_len() == 1
    st = q.stats()
    assert st.dead_lettered == 1 and st.expired_leases == 3


# -- Q10 skip-scan ---------------------------------------------------------------------------------


def test_q10_lease_skips_many_outstanding_leases(db, clock):
    qq = db.open_queue(FixedQ, cfg())
    for i in range(3000):
        qq.push((i, 0))
    leased = qq.lease(3000)
    assert len(leased) == 3000
    last = qq.push((99999, 0))
    (lz,) = qq.lease()
    assert lz.id == last


# -- Q11 lease object --------------------------------------------------------------------------------


def test_q11_lease_fields(q, flavour, clock):
    jid = q.push(make(flavour, 3))
    (lz,) = q.lease()
    assert lz.id == jid and lz.attempt == 1
    assert lz.deadline.tzinfo is timezone.utc
    assert isinstance(lz.token, armdb.LeaseToken)
    if flavour == "fixed":
        assert isinstance(lz.payload, np.void) and lz.payload.dtype == PING
    else:
        assert lz.payload == Job(3, "r3")


def test_q11_fixed_payloads_are_private_writable_records(db, clock):
    # SPEC Q11: leases of a fixed queue come from armdb._core.qshard, whose payload
    # records share arrays of ~64 KiB; each must still be the row's own copy.
    qq = db.open_queue(FixedQ, cfg())
    n = 6000  # more than one array of 12-byte records (65536 // 12 = 5461)
    for i in range(n):
        qq.push((i, i % 7))
    leases = qq.lease(n)
    assert [int(lz.payload["doc"]) for lz in leases] == list(range(n))
    assert [int(lz.payload["flags"]) for lz in leases] == [i % 7 for i in range(n)]
    leases[0].payload["doc"] = 999_999
    leases[5460].payload["flags"] = 42
    assert int(leases[1].payload["doc"]) == 1 and int(leases[5461].payload["flags"]) == 5461 % 7
    clock.advance(31)  # every lease expires; the stored rows never saw the writes
    again = qq.lease(2)
    assert [int(lz.payload["doc"]) for lz in again] == [0, 1] and again[0].attempt == 2


def test_q11_leases_from_several_shards(db, clock):
    # SPEC Q11: the claim of a candidate found by the merged scan builds the same Lease.
    header = FixedConfig.balanced().shard_count(3).grow_step(64).build()
    qq = db.open_queue(FixedQ, QueueConfig.balanced().header_config(header).build())
    ids = [qq.push((i, 1)) for i in range(40)]
    leases = qq.lease(40)
    assert [lz.id for lz in leases] == ids
    assert {lz.token.shard for lz in leases} == {0, 1, 2}
    assert all(int(lz.payload["doc"]) == i and lz.attempt == 1 for i, lz in enumerate(leases))
    for lz in leases:
        qq.ack(lz.token)
    assert len(qq) == 0 and qq.stats().acks == 40


def test_q13_compiled_ack_result_codes(db):
    # SPEC Q13: QueueShard.ack reports why it refused, and refuses without a change.
    from armdb._core.qshard import ABSENT, ACKED, FOREIGN, RELEASED

    qq = db.open_queue(FixedQ, cfg())
    qq.push((1, 1))
    (lz,) = qq.lease()
    t = lz.token
    sh = qq._shards[0]
    with sh.lock:
        assert sh.ack_token(t._replace(handle=t.handle + 1)) == FOREIGN
        assert sh.ack_token(t._replace(shard=1)) == FOREIGN
        assert sh.ack_token(t._replace(seq=-1)) == FOREIGN  # out of range: never issued
        assert sh.ack_token(tuple(t)) == FOREIGN  # not a LeaseToken
        assert sh.ack_token(t._replace(epoch=t.epoch + 1)) == RELEASED
        assert sh.ack(t.due, t.seq, t.epoch + 1) == RELEASED
        assert sh.ack(t.due, t.seq + 1, t.epoch) == ABSENT
        assert len(sh.live) == 1 and sh.acks == 0
        assert sh.ack(t.due, t.seq, t.epoch) == ACKED
        assert sh.ack(t.due, t.seq, t.epoch) == ABSENT
    assert len(qq) == 0 and qq.stats().acks == 1


@pytest.mark.parametrize("durable", [False, True])
def test_q15_compiled_writes_order_the_redo_record_on_durable_stores(db, monkeypatch, durable):
    # SPEC Q15 (slots updated in place): on a durable store the compiled lease and ack
    # sync the redo record before overwriting a live row, as FixedShard.write does (S4).
    from armdb.fixed import FixedShard

    calls: list[int] = []
    real = FixedShard.sync_redo
    monkeypatch.setattr(FixedShard, "sync_redo", lambda self: (calls.append(1), real(self))[1])
    header = FixedConfig.balanced().grow_step(64)
    header = header.sync_interval(0) if durable else header.enable_fsync(False)
    qq = db.open_queue(FixedQ, QueueConfig.balanced().header_config(header.build()).build())
    qq.push((1, 1))  # into a free slot: never ordered
    assert calls == []
    (lz,) = qq.lease()
    qq.ack(lz.token)
    assert len(calls) == (2 if durable else 0)


def test_q15_compiled_writes_run_the_timed_sync(db, monkeypatch):
    # SPEC Q15 with S5's sync_interval: writes made in C still trigger the timed msync
    # (here: they wake the flusher, which runs it; in the writer if there is none).
    from armdb.fixed import FixedShard

    synced: list[int] = []
    real = FixedShard._sync_locked
    monkeypatch.setattr(FixedShard, "_sync_locked", lambda self, **kw: (synced.append(1), real(self, **kw))[1])
    monkeypatch.setattr(FixedShard, "sync", lambda self: None)  # no flusher-thread syncs in between
    header = FixedConfig.balanced().grow_step(64).sync_interval(0.5).build()
    qq = db.open_queue(FixedQ, QueueConfig.balanced().header_config(header).build())
    qq.push((1, 1))
    fixed = qq._shards[0].fixed
    kick = fixed.kick
    assert kick is not None
    fixed.kick = lambda: (synced.append(1), kick())[1]
    with fixed.lock:  # the last sync long ago
        fixed.sf.last_sync -= 1.0
        before = len(synced)
    (lz,) = qq.lease()
    assert len(synced) > before
    with fixed.lock:
        fixed.sf.last_sync += 1000.0  # a sync just happened: the ack's write must not sync
        before = len(synced)
    qq.ack(lz.token)
    assert len(synced) == before


# -- Q13/Q14 tokens and settlement ---------------------------------------------------------------------


def test_q13_stale_after_ack_nack_relase_and_dead(q, flavour, clock):
    q.push(make(flavour, 1))
    (lz,) = q.lease(lease_timeout=1)
    clock.advance(1)
    (lz2,) = q.lease()
    with pytest.raises(StaleToken, match="leased again"):
        q.ack(lz.token)
    with pytest.raises(StaleToken):
        q.nack(lz.token)
    q.nack(lz2.token, delay=0)
    with pytest.raises(StaleToken):
        q.ack(lz2.token)
    (lz3,) = q.lease()
    q.nack(lz3.token, dead=True)
    with pytest.raises(StaleToken, match="dead-lettered"):
        q.ack(lz3.token)
    assert q.dead_len() == 1 and q.len() == 0


def test_q13_stale_after_ack_changes_nothing(q, flavour):
    q.push(make(flavour, 1))
    q.push(make(flavour, 2))
    a, b = q.lease(2)
    q.ack(a.token)
    before = q.snapshot()
    with pytest.raises(StaleToken):
        q.ack(a.token)
    with pytest.raises(StaleToken):
        q.nack(a.token, dead=True)
    assert (q.snapshot() == before).all()
    q.ack(b.token)
    assert q.len() == 0


def test_q13_token_from_other_queue_or_reopen(db_path, clock, flavour):
    spec = FixedQ if flavour == "fixed" else VarQ
    with armdb.Db.open(db_path, clock=clock) as d:
        q1 = d.open_queue(spec, cfg())
        other = d.open_queue(armdb.queue("other", payload=PING), cfg())
        q1.push(make(flavour, 1))
        other.push((1, 1))
        (lz,) = q1.lease()
        (olz,) = other.lease()
        with pytest.raises(StaleToken, match="another queue handle"):
            q1.ack(olz.token)
        with pytest.raises(NotALease):  # a wrong argument, not a stale lease (Q30)
            q1.ack("not a token")  # type: ignore[arg-type]
    with armdb.Db.open(db_path, clock=clock) as d:
        q2 = d.open_queue(spec, cfg())
        with pytest.raises(StaleToken, match="another queue handle"):
            q2.ack(lz.token)
        assert q2.len() == 1


def test_q13_expired_token_still_honoured_if_not_released(q, flavour, clock):
    q.push(make(flavour, 1))
    (lz,) = q.lease(lease_timeout=1)
    clock.advance(5)
    q.ack(lz.token)
    assert q.len() == 0 and q.lease() == []


def test_q14_nack_backoff_delay_and_max_attempts(q, flavour, clock):
    jid = q.push(make(flavour, 1))
    (lz,) = q.lease()
    q.nack(lz.token)  # attempt 1 -> backoff[0] = 10 s
    clock.advance(9.9)
    assert q.lease() == []
    clock.advance(0.1)
    (lz,) = q.lease()
    assert lz.id == jid and lz.attempt == 2
    q.nack(lz.token, delay=timedelta(seconds=1))
    clock.advance(1)
    (lz,) = q.lease()
    assert lz.attempt == 3
    q.nack(lz.token)  # attempts == max_attempts -> dead
    assert q.len() == 0 and q.dead_len() == 1
    st = q.stats()
    assert st.nacks == 3 and st.dead_lettered == 1


def test_q14_ack_removes_var_body(db):
    qq = db.open_queue(VarQ, cfg())
    qq.push(Job(1, "a"))
    (lz,) = qq.lease()
    qq.ack(lz.token)
    store = qq._payload
    assert store is not None and len(store) == 0


# -- Q15/Q16 payload storage ------------------------------------------------------------------------------


def test_q15_fixed_queue_never_compacts(db):
    qq = db.open_queue(FixedQ, cfg())
    for i in range(500):
        qq.push((i, 0))
        (lz,) = qq.lease()
        qq.ack(lz.token)
    assert qq.stats().compaction_bytes == 0


def test_q16_payload_writes(db):
    qq = db.open_queue(VarQ, cfg())
    fq = db.open_queue(FixedQ, cfg())
    qq.push(Job(1, "a"))
    qq.push(Job(2, "b"))
    fq.push((1, 1))
    a, b = qq.lease(2)
    qq.nack(a.token, delay=0)
    qq.ack(b.token)
    (a2,) = qq.lease()
    qq.ack(a2.token)
    assert qq.stats().payload_writes == 2
    assert fq.stats().payload_writes == 0


# -- Q17-Q19 waiting and clocks -----------------------------------------------------------------------------


def test_q17_clock_jumps(q, flavour, clock):
    q.push(make(flavour, 1), delay=10)
    clock.advance(-100)  # backward: later still
    assert q.lease() == []
    clock.advance(200)  # forward: due early
    (lz,) = q.lease(lease_timeout=5)
    clock.advance(-60)  # backward jump extends the lease
    assert q.lease() == []
    clock.advance(65)
    assert q.lease()[0].attempt == 2


def test_q17_waiter_rechecks_after_backward_jump(db, clock):
    qq = db.open_queue(FixedQ, cfg(wakeup_recheck=0.05))
    qq.push((1, 0), delay=3600)
    t = threading.Timer(0.1, clock.advance, args=(3600,))
    t.start()
    start = time.monotonic()
    assert qq.wait_due_timeout(5) is True
    assert time.monotonic() - start < 1.0  # found within a recheck or two, not after the timeout
    t.join()


def test_q18_next_delay(q, flavour, clock):
    assert q.next_delay() is None
    q.push(make(flavour, 1), delay=30)
    assert q.next_delay() == timedelta(seconds=30)
    q.push(make(flavour, 2))
    assert q.next_delay() == timedelta(0)
    (lz,) = q.lease(lease_timeout=10)
    assert q.next_delay() == timedelta(seconds=10)  # the lease deadline comes first
    clock.advance(10)
    assert q.next_delay() == timedelta(0)  # an expired lease is due
    (lz,) = q.lease()
    q.nack(lz.token, dead=True)
    clock.advance(20)
    assert q.next_delay() == timedelta(0)
    (lz,) = q.lease()
    q.ack(lz.token)
    assert q.next_delay() is None  # dead rows do not count
    assert q.dead_len() == 1


def test_q18_next_delay_raises_when_closed(db_path, clock):
    d = armdb.Db.open(db_path, clock=clock)
    qq = d.open_queue(FixedQ, cfg())
    d.shutdown()
    with pytest.raises(DbClosed):
        qq.next_delay()


def test_q18_unreadable_clock_raises(db_path):
    broken = [False]  # Db.open reads the clock once, to check it

    def clock() -> int:
        if broken[0]:
            raise OSError("clock unavailable")
        return 1_700_000_000_000

    with armdb.Db.open(db_path, clock=clock) as d:
        q = d.open_queue(FixedQ, cfg())
        broken[0] = True
        with pytest.raises(OSError, match="clock"):
            q.next_delay()


def test_q19_wait_due_timeout(q, flavour, clock):
    start = time.monotonic()
    assert q.wait_due_timeout(0.2) is False
    assert time.monotonic() - start >= 0.19
    threading.Timer(0.1, q.push, args=(make(flavour, 1),)).start()
    start = time.monotonic()
    assert q.wait_due_timeout(timedelta(seconds=10)) is True
    assert time.monotonic() - start < 2  # the push woke the waiter at once


def test_q19_nack_wakes_a_waiter(q, flavour):
    # SPEC Q19: a nack makes a row ready again; a var queue's nack (a log commit) wakes
    # waiters as a fixed queue's does, instead of leaving them to the 5 s recheck.
    q.push(make(flavour, 1))
    (lz,) = q.lease()
    threading.Timer(0.1, q.nack, args=(lz.token,), kwargs={"delay": 0}).start()
    start = time.monotonic()
    assert q.wait_due_timeout(10) is True
    assert time.monotonic() - start < 2
    assert [x.attempt for x in q.lease()] == [2]


def test_q19_due_resolves_in_asyncio(q, flavour):
    async def main() -> float:
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, lambda: threading.Thread(target=q.push, args=(make(flavour, 1),)).start())
        start = time.monotonic()
        await asyncio.wait_for(q.due(), timeout=5)
        return time.monotonic() - start

    assert asyncio.run(main()) < 2
    assert len(q.lease()) == 1


def test_q19_waiters_end_with_dbclosed(db_path, clock):
    d = armdb.Db.open(db_path, clock=clock)
    qq = d.open_queue(FixedQ, cfg())
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            qq.wait_due_timeout(30)
        except DbClosed as e:
            errors.append(e)

    t = threading.Thread(target=waiter)
    t.start()

    async def main() -> None:
        asyncio.get_running_loop().call_later(0.2, d.shutdown)
        await asyncio.wait_for(qq.due(), timeout=10)

    with pytest.raises(DbClosed):
        asyncio.run(main())
    t.join(5)
    assert not t.is_alive() and len(errors) == 1


# -- Q20 capacity --------------------------------------------------------------------------------------------


def test_q20_max_depth(db, flavour, clock):
    qq = db.open_queue(FixedQ if flavour == "fixed" else VarQ, cfg(max_depth=2))
    qq.push(make(flavour, 1))
    qq.push(make(flavour, 2), delay=100)
    with pytest.raises(QueueFull, match="max_depth"):
        qq.push(make(flavour, 3))
    (lz,) = qq.lease()
    with pytest.raises(QueueFull):  # leased rows are live
        qq.push(make(flavour, 3))
    qq.nack(lz.token, dead=True)  # dead rows are not
    qq.push(make(flavour, 3))
    assert qq.len() == 2 and qq.dead_len() == 1


# -- Q22-Q24 dead letters and retention -----------------------------------------------------------------------


def test_q22_dead_retention_sweeps(db, flavour, clock):
    qq = db.open_queue(FixedQ if flavour == "fixed" else VarQ, cfg(dead_retention=60))
    for i in range(3):
        qq.push(make(flavour, i))
    for lz in qq.lease(3):
        qq.nack(lz.token, dead=True)
        clock.advance(10)
    assert qq.dead_len() == 3
    clock.advance(35)  # first one dead for 65 s, second 55 s
    qq.len()
    qq.push(make(flavour, 9))  # retention runs before each operation
    assert qq.dead_len() == 2
    clock.advance(100)
    db.sweep_expired_now()
    assert qq.dead_len() == 0
    if flavour == "var":
        assert len(qq._payload) == 1  # only the live job's body is left (Q23)


def test_q23_failed_body_delete_is_retried(db, clock, monkeypatch):
    qq = db.open_queue(VarQ, cfg(dead_retention=1))
    qq.push(Job(1, "a"))
    (lz,) = qq.lease()
    qq.nack(lz.token, dead=True)
    clock.advance(2)
    real = qq._payload.delete
    calls = {"n": 0}

    def failing(key):
        calls["n"] += 1
        raise OSError(5, "injected EIO")

    monkeypatch.setattr(qq._payload, "delete", failing)
    with pytest.raises(OSError, match="injected"):
        db.sweep_expired_now()
    assert qq.dead_len() == 0 and qq.stats().retention_retry_pending == 1
    monkeypatch.setattr(qq._payload, "delete", real)
    clock.advance(2)
    db.sweep_expired_now()
    assert qq.stats().retention_retry_pending == 0 and len(qq._payload) == 0


def test_q24_retention_failure_never_fails_queue_ops(db, clock, monkeypatch, caplog):
    qq = db.open_queue(VarQ, cfg(dead_retention=1))
    qq.push(Job(1, "a"))
    (lz,) = qq.lease()
    qq.nack(lz.token, dead=True)
    clock.advance(2)

    def failing(key):
        raise OSError(5, "injected EIO")

    monkeypatch.setattr(qq._payload, "delete", failing)
    with caplog.at_level(logging.WARNING, logger="armdb"):
        qq.push(Job(2, "b"))
        (lz2,) = qq.lease()
        qq.nack(lz2.token, delay=0)
    assert any("retention failed" in r.message or "will retry" in r.message for r in caplog.records)
    assert qq.len() == 1
    with pytest.raises(OSError, match="injected"):
        db.sweep_expired_now()


# -- Q26/Q27 inspection -------------------------------------------------------------------------------------------


def test_q26_stats_fields(q, flavour, clock):
    q.push(make(flavour, 1))
    q.push(make(flavour, 2), delay=100)
    q.push(make(flavour, 3))
    (lz,) = q.lease()
    st = q.stats()
    assert (st.len, st.ready, st.leased, st.delayed, st.dead_len) == (3, 1, 1, 1, 0)
    assert st.shards == 1 and st.slots_allocated == 1024
    assert st.version_vector_bytes == 4096
    assert st.header_file_logical_bytes >= st.header_file_physical_bytes > 0
    assert st.pushes == 3 and st.acks == 0
    d = st.to_dict()
    for field in ("len", "dead_len", "ready", "leased", "delayed", "shards", "slots_allocated",
                  "version_vector_bytes", "header_file_logical_bytes", "header_file_physical_bytes",
                  "payload_writes", "compaction_bytes", "payload_compaction_bytes", "pushes", "acks", "nacks",
                  "dead_lettered", "expired_leases", "repaired_on_open", "retention_retry_pending"):
        assert field in d
    html = st._repr_html_()
    assert "<table" in html and "ready" in html
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.len = 5  # type: ignore[misc]


def test_q26_version_vector_exact_with_queue_preset(db):
    qq = db.open_queue(FixedQ, QueueConfig.balanced().build())
    assert qq.stats().version_vector_bytes == 400_000


def test_q27_snapshot(q, flavour, clock):
    a = q.push(make(flavour, 1))
    b = q.push(make(flavour, 2))
    (lz,) = q.lease(lease_timeout=7)
    snap = q.snapshot()
    assert snap.dtype.names == ("id", "state", "due", "attempts", "epoch", "deadline")
    assert snap["state"].dtype == np.uint8 and snap["due"].dtype == np.dtype("datetime64[ms]")
    assert list(snap["id"]) == [a, b]
    assert list(snap["state"]) == [State.LEASED, State.READY]
    assert snap["deadline"][0] == np.datetime64(clock.ms + 7000, "ms")
    assert np.isnat(snap["deadline"][1])
    assert list(snap["attempts"]) == [1, 0]


# -- Q28 threads -----------------------------------------------------------------------------------------------------


def test_q28_four_threads_each_job_acked_once(db_path):
    jobs_per_thread = 5000
    with armdb.Db.open(db_path) as d:
        qq = d.open_queue(FixedQ, QueueConfig.balanced().lease_timeout(600).build())
        for i in range(4 * jobs_per_thread):
            qq.push((i, 0))
        seen: list[list[int]] = [[] for _ in range(4)]

        def worker(k: int) -> None:
            while True:
                got = qq.lease(16)
                if not got:
                    if qq.len() == 0:
                        return
                    continue
                for lz in got:
                    seen[k].append(int(lz.payload["doc"]))
                    qq.ack(lz.token)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        allseen = [x for s in seen for x in s]
        assert len(allseen) == 4 * jobs_per_thread
        assert sorted(allseen) == list(range(4 * jobs_per_thread))
        assert qq.stats().acks == 4 * jobs_per_thread


def test_q28_multi_shard_lease_key_order(db, clock):
    qq = db.open_queue(
        FixedQ,
        QueueConfig.balanced().header_config(FixedConfig.balanced().shard_count(3).grow_step(64).build()).build(),
    )
    ids = [qq.push((i, 0), delay=(i % 5) / 1000) for i in range(60)]
    clock.advance(1)
    got = qq.lease(60)
    keys = [(lz.token.due, lz.id) for lz in got]
    assert keys == sorted(keys) and sorted(lz.id for lz in got) == ids


def test_reopen_keeps_rows_and_states(db_path, flavour):
    clock = FakeClock()
    spec = FixedQ if flavour == "fixed" else VarQ
    with armdb.Db.open(db_path, clock=clock) as d:
        qq = d.open_queue(spec, cfg())
        ids = [qq.push(make(flavour, i)) for i in range(10)]
        a, b, c = qq.lease(3)
        qq.ack(a.token)
        qq.nack(b.token, dead=True)
    with armdb.Db.open(db_path, clock=clock) as d:
        qq = d.open_queue(spec, cfg())
        assert qq.len() == 8 and qq.dead_len() == 1
        got = qq.lease(10)
        assert [lz.id for lz in got] == ids[3:]  # c is still leased
        new = qq.push(make(flavour, 99))
        assert new > max(ids)
    rep = armdb.check(db_path)
    assert rep.ok, rep.findings


def test_q6_payload_cache_serves_leases(db, monkeypatch):
    qq = db.open_queue(VarQ, cfg(payload_config=Config.balanced().cache_bytes(1 << 20).build()))
    ids = [qq.push(Job(i, "cached")) for i in range(5)]

    def no_disk(key):
        raise AssertionError("lease read the data file although the body was cached")

    monkeypatch.setattr(qq._payload, "get", no_disk)
    got = qq.lease(5)
    assert [lz.payload for lz in got] == [Job(i, "cached") for i in range(5)]
    monkeypatch.undo()
    for lz in got:
        qq.ack(lz.token)
    assert len(qq._cache) == 0 and qq._cache_bytes == 0 and [lz.id for lz in got] == ids


def test_d4_db_stats_and_sweep_expired_now(db, clock):
    qq = db.open_queue(VarQ, cfg(dead_retention=1))
    m = db.open_map("docs")
    m.put("k", 1)
    qq.push(Job(1, "a"))
    (lz,) = qq.lease()
    qq.nack(lz.token, dead=True)
    st = db.stats()
    assert set(st) >= {"jobs", "docs"} and st["jobs"].dead_len == 1
    clock.advance(2)
    db.sweep_expired_now()
    assert qq.dead_len() == 0 and db.stats()["jobs"].dead_len == 0


# -- Q30: a Lease or its token; anything else is a wrong argument, never StaleToken ---------------


def test_q30_ack_and_nack_take_a_lease_or_its_token(db, flavour):
    kind = flavour
    q = db.open_queue(FixedQ if kind == "fixed" else VarQ, cfg())
    for _ in range(4):
        q.push((1, 0) if kind == "fixed" else Job(1, "x"))
    a, b, c, d = q.lease(4)
    q.ack(a)  # the Lease itself
    q.ack(b.token)
    q.nack(c)
    db.tx().ack(q, d).commit()
    assert q.len() == 1 and q.stats().acks == 3 and q.stats().nacks == 1
    with pytest.raises(StaleToken):  # a real stale lease is still StaleToken
        q.ack(a)


@pytest.mark.parametrize("bad", [None, 7, "token", {"id": 1}, (1, 2, 3, 4, 5)])
def test_q30_a_wrong_argument_is_not_a_lease_never_stale_token(db, flavour, bad):
    kind = flavour
    q = db.open_queue(FixedQ if kind == "fixed" else VarQ, cfg())
    q.push((1, 0) if kind == "fixed" else Job(1, "x"))
    (lease,) = q.lease(1)
    for call in (lambda: q.ack(bad), lambda: q.nack(bad), lambda: db.tx().ack(q, bad),
                 lambda: db.tx().nack(q, bad)):
        with pytest.raises(NotALease, match=r"expected a Lease \(or its LeaseToken") as info:
            call()
        assert isinstance(info.value, TypeError) and not isinstance(info.value, StaleToken)
    q.ack(lease)  # nothing changed: the lease still holds
    assert q.len() == 0


@pytest.mark.parametrize("field,value", [("shard", "0"), ("seq", "1"), ("due", None), ("epoch", 1.5),
                                         ("handle", 2.0), ("shard", True)])
def test_q30_an_altered_token_is_refused_with_an_armdb_error(db, flavour, field, value):
    # SPEC Q30, Q13: a LeaseToken whose fields were altered to another type is refused with
    # NotALease, never a bare TypeError, and is never taken for the lease it was made from
    # (the compiled fixed ack once truncated a float epoch and acked); nothing changes.
    q = db.open_queue(FixedQ if flavour == "fixed" else VarQ, cfg())
    q.push((1, 0) if flavour == "fixed" else Job(1, "x"))
    (lease,) = q.lease(1)
    bad = lease.token._replace(**{field: value})
    for call in (lambda: q.ack(bad), lambda: q.nack(bad), lambda: q.extend(bad), lambda: q.ack_many([bad]),
                 lambda: q.release_many([bad]), lambda: db.tx().ack(q, bad).commit(),
                 lambda: db.tx().nack(q, bad).commit()):
        with pytest.raises(NotALease, match="was altered"):
            call()
    assert q.stats().acks == q.stats().nacks == 0
    q.ack(lease)  # nothing changed: the lease still holds
    assert q.len() == 0


# -- payload errors that say what to do, and values users reasonably pass -------------------------------


def test_q1_numpy_scalars_in_a_dataclass_are_taken_as_their_python_value(db):
    @dataclass
    class Stat:
        n: int
        x: float
        ok: bool

    q = db.open_queue(armdb.queue("stats_q", payload=Stat, var=True), cfg())
    q.push(Stat(np.int64(7), np.float32(0.5), np.bool_(True)))
    (lz,) = q.lease()
    assert lz.payload == Stat(7, 0.5, True) and type(lz.payload.n) is int


def test_q1_bytes_like_values_are_accepted_for_a_bytes_queue(db):
    q = db.open_queue(armdb.queue("raw_q", payload=bytes, var=True), cfg())
    q.push(bytearray(b"ab"))
    q.push(memoryview(b"cd"))
    assert sorted(lz.payload for lz in q.lease(2)) == [b"ab", b"cd"]


def test_q1_payload_errors_name_the_field_and_the_shape(db):
    @dataclass
    class Doc:
        id: int
        tags: object

    q = db.open_queue(armdb.queue("docs_q", payload=Doc, var=True), cfg())
    with pytest.raises(PayloadTypeError, match=r"field 'tags' of Doc holds a set"):
        q.push(Doc(1, {"a"}))
    fq = db.open_queue(FixedQ, cfg())
    with pytest.raises(PayloadTypeError, match=r"tuple of 2 fields, not a tuple of 3 \(the fields: doc, flags\)"):
        fq.push((1, 2, 3))
