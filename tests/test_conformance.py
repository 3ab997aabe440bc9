"""One suite, two backends (SPEC G8): the queue, transaction and stream behaviours that
apply to both run against the embedded ``Db`` and ``armdb.pg`` from the parametrised
``backend`` fixture, as msgpack runs one suite against two implementations.

Both backends run on the real clock here (PostgreSQL's clock is the server's), so the
times are short real durations: leases of 0.3 s, backoffs of 0.3 s.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import armdb
import armdb.pg
from armdb import Config, QueueConfig, SchemaRegistry, State, TxConfig
from armdb.errors import (
    ConfigError,
    DbClosed,
    EncryptionKeyRequired,
    NotALease,
    PayloadTypeError,
    QueueAlreadyOpen,
    QueueFull,
    SchemaMismatch,
    StaleToken,
    StreamSourceRequiresTx,
    WrongKey,
)


@dataclass
class Job:
    doc: int
    reason: str


Jobs = armdb.queue("conf_jobs", payload=Job, var=True)
Pings = armdb.queue("conf_pings", payload=np.dtype([("doc", "<u8"), ("flags", "<u4")]))
Outbox = armdb.queue("conf_outbox", payload=dict, var=True)

LOG_KEY = bytes(range(32))


def cfg(**kw: Any) -> QueueConfig:
    b = QueueConfig.balanced().lease_timeout(kw.pop("lease", 0.3)).backoff_secs(kw.pop("backoff", [0.3]))
    for k, v in kw.items():
        b = getattr(b, k)(v)
    return b.build()


class Backend:
    """Opens databases of one kind; every one opened is closed at the end of the test."""

    def __init__(self, kind: str, tmp: Path, dsn: str | None, namespace: str | None) -> None:
        self.kind = kind
        self._tmp = tmp
        self._dsn = dsn
        self._ns = namespace
        self._open: list[Any] = []

    def open(self, *, schema: SchemaRegistry | None = None) -> Any:
        if self.kind == "embedded":
            db: Any = armdb.Db.open(self._tmp / "db", schema=schema, tx_config=TxConfig(log_encryption_key=LOG_KEY))
        else:
            assert self._dsn is not None and self._ns is not None
            db = armdb.pg.connect(self._dsn, namespace=self._ns, schema=schema)
        self._open.append(db)
        return db

    def close_all(self) -> None:
        for db in self._open:
            db.close()


@pytest.fixture(params=["embedded", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "postgres":
        dsn = request.getfixturevalue("pg_dsn")
        ns = request.getfixturevalue("pg_namespace")
        b = Backend("postgres", tmp_path, dsn, ns)
    else:
        b = Backend("embedded", tmp_path, None, None)
    yield b
    b.close_all()


def wait_until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.02)


# -- push, lease, ack (Q9, Q11, Q13, Q14, Q30) ----------------------------------------------------


def test_push_lease_ack_in_key_order(backend: Backend) -> None:
    # SPEC Q9 Q11 Q14
    db = backend.open()
    q = db.open_queue(Jobs, cfg())
    ids = [q.push(Job(i, "x")) for i in range(5)]
    assert ids == sorted(ids) and len(set(ids)) == 5
    assert q.len() == 5 and q.dead_len() == 0
    got = q.lease(3)
    assert [lz.id for lz in got] == ids[:3]
    assert [lz.payload for lz in got] == [Job(i, "x") for i in range(3)]
    assert all(lz.attempt == 1 for lz in got)
    assert got[0].deadline.tzinfo is not None
    for lz in got:
        q.ack(lz)
    assert q.len() == 2
    assert [lz.id for lz in q.lease(10)] == ids[3:]
    assert q.lease(1) == []


def test_fixed_queue_round_trip_and_exact_payloads(backend: Backend) -> None:
    # SPEC Q1 Q35
    db = backend.open()
    q = db.open_queue(Pings, cfg())
    q.push((7, 3))
    with pytest.raises(PayloadTypeError):
        q.push((1.5, 3))
    with pytest.raises(PayloadTypeError):
        q.push((1, 2, 3))
    with pytest.raises(PayloadTypeError):
        q.push((-1, 3))
    (lz,) = q.lease(5)
    assert int(lz.payload["doc"]) == 7 and int(lz.payload["flags"]) == 3
    assert q.len() == 1


def test_var_payload_type_checked(backend: Backend) -> None:
    # SPEC Q1
    db = backend.open()
    q = db.open_queue(Jobs, cfg())
    with pytest.raises(PayloadTypeError):
        q.push({"doc": 1})
    assert q.len() == 0


def test_stale_and_wrong_tokens(backend: Backend) -> None:
    # SPEC Q13 Q30
    db = backend.open()
    q = db.open_queue(Jobs, cfg())
    q.push(Job(1, "a"))
    (lz,) = q.lease()
    q.ack(lz.token)
    with pytest.raises(StaleToken):
        q.ack(lz)
    with pytest.raises(StaleToken):
        q.nack(lz)
    for bad in (lz.id, None, {"id": 1}):
        with pytest.raises(NotALease) as e:
            q.ack(bad)
        assert isinstance(e.value, TypeError) and not isinstance(e.value, StaleToken)
        assert "Lease" in str(e.value) and "LeaseToken" in str(e.value)


def test_token_of_another_queue_is_stale(backend: Backend) -> None:
    # SPEC Q13
    db = backend.open()
    a = db.open_queue(Jobs, cfg())
    b = db.open_queue(Outbox, cfg())
    a.push(Job(1, "a"))
    (lz,) = a.lease()
    with pytest.raises(StaleToken):
        b.ack(lz)
    a.ack(lz)


def test_expired_lease_is_leased_again_and_old_token_fenced(backend: Backend) -> None:
    # SPEC Q9 Q12 Q13 G3
    db = backend.open()
    q = db.open_queue(Jobs, cfg(lease=0.2))
    q.push(Job(1, "a"))
    (first,) = q.lease()
    assert q.lease() == []  # an unexpired lease is never handed out twice
    time.sleep(0.3)
    (second,) = q.lease()
    assert second.id == first.id and second.attempt == 2
    with pytest.raises(StaleToken):
        q.ack(first)
    q.ack(second)
    assert q.len() == 0


def test_expired_token_not_re_leased_is_honoured(backend: Backend) -> None:
    # SPEC Q13
    db = backend.open()
    q = db.open_queue(Jobs, cfg(lease=0.1))
    q.push(Job(1, "a"))
    (lz,) = q.lease()
    time.sleep(0.2)
    q.ack(lz)
    assert q.len() == 0


# -- nack, backoff, dead letters (Q14, Q18, Q22, Q33, Q34) -------------------------------------------


def test_nack_backoff_and_next_delay(backend: Backend) -> None:
    # SPEC Q14 Q18
    db = backend.open()
    q = db.open_queue(Jobs, cfg(backoff=[0.4]))
    assert q.next_delay() is None
    q.push(Job(1, "a"))
    assert q.next_delay() == timedelta(0)
    (lz,) = q.lease()
    d = q.next_delay()
    assert d is not None and timedelta(0) < d <= timedelta(seconds=0.3)  # the lease deadline counts
    q.nack(lz)
    assert q.lease() == []
    d = q.next_delay()
    assert d is not None and timedelta(seconds=0.2) < d <= timedelta(seconds=0.4)
    time.sleep(0.45)
    (again,) = q.lease()
    assert again.attempt == 2
    q.nack(again, delay=0)
    assert q.lease()[0].attempt == 3


def test_max_attempts_dead_letters_on_nack_and_on_expiry(backend: Backend) -> None:
    # SPEC Q9 Q14 Q22
    db = backend.open()
    q = db.open_queue(Jobs, cfg(lease=0.15, backoff=[0], max_attempts=2))
    q.push(Job(1, "nack"))
    q.nack(q.lease()[0])
    q.nack(q.lease()[0])  # second delivery used the last attempt
    assert q.len() == 0 and q.dead_len() == 1
    q.push(Job(2, "expire"))
    q.lease()
    time.sleep(0.2)
    q.lease()  # attempt 2
    time.sleep(0.2)
    assert q.lease() == []  # the expired lease out of attempts is dead-lettered instead
    assert q.dead_len() == 2 and q.len() == 0
    q.push(Job(3, "dead"))
    q.nack(q.lease()[0], dead=True)
    assert q.dead_len() == 3
    st = q.stats()
    assert st.dead_lettered >= 2 and st.nacks == 3


def test_peek_redrive_purge(backend: Backend) -> None:
    # SPEC Q33 Q34
    db = backend.open()
    q = db.open_queue(Jobs, cfg())
    ids = [q.push(Job(i, "p")) for i in range(4)]
    jobs = q.peek(10)
    assert [j.id for j in jobs] == ids and all(j.state == State.READY for j in jobs)
    assert jobs[0].payload == Job(0, "p")
    for lz in q.lease(3):
        q.nack(lz, dead=True)
    assert q.len() == 1 and q.dead_len() == 3
    dead = q.peek(10, dead=True)
    assert [j.id for j in dead] == ids[:3] and all(j.state == State.DEAD for j in dead)
    assert q.redrive([ids[0], 999_999]) == 1
    assert q.len() == 2 and q.dead_len() == 2
    (lz,) = [x for x in q.lease(5) if x.id == ids[0]]
    assert lz.attempt == 1 and lz.payload == Job(0, "p")  # attempts reset, body kept
    assert q.purge_dead([ids[1]]) == 1
    assert q.purge_dead() == 1
    assert q.dead_len() == 0
    with pytest.raises(ConfigError):
        q.redrive(["x"])


def test_redrive_respects_max_depth(backend: Backend) -> None:
    # SPEC Q34
    db = backend.open()
    q = db.open_queue(Jobs, cfg(max_depth=2))
    q.push(Job(1, "a"))
    q.nack(q.lease()[0], dead=True)
    q.push(Job(2, "b"))
    q.push(Job(3, "c"))
    with pytest.raises(QueueFull):
        q.redrive()
    assert q.dead_len() == 1


def test_dead_retention_sweeps(backend: Backend) -> None:
    # SPEC Q22
    db = backend.open()
    q = db.open_queue(Jobs, cfg(dead_retention=0.2))
    q.push(Job(1, "a"))
    q.nack(q.lease()[0], dead=True)
    assert q.dead_len() == 1
    time.sleep(0.3)
    db.sweep_expired_now()
    assert q.dead_len() == 0


def test_extend_keeps_the_token(backend: Backend) -> None:
    # SPEC Q29
    db = backend.open()
    q = db.open_queue(Jobs, cfg(lease=0.3))
    q.push(Job(1, "a"))
    (lz,) = q.lease()
    new = q.extend(lz, by=1.0)
    assert new > lz.deadline
    time.sleep(0.4)
    assert q.lease() == []  # extended: not expired
    q.ack(lz)
    with pytest.raises(StaleToken):
        q.extend(lz)
    with pytest.raises(ConfigError):
        q.extend(lz, by=0)


# -- capacity and transactions (Q20, Q21, T1, T2, T6) ---------------------------------------------------


def test_max_depth_push_and_net_effect_in_tx(backend: Backend) -> None:
    # SPEC Q20 Q21
    db = backend.open()
    q = db.open_queue(Jobs, cfg(max_depth=2))
    q.push(Job(1, "a"))
    q.push(Job(2, "b"))
    with pytest.raises(QueueFull):
        q.push(Job(3, "c"))
    (lz,) = q.lease()
    ids = db.tx().push(q, Job(4, "d")).ack(q, lz).commit()  # ack + push on a full queue, push first
    assert len(ids) == 1 and q.len() == 2
    (lz2,) = q.lease()
    with pytest.raises(QueueFull):
        db.tx().ack(q, lz2).push(q, Job(5, "e")).push(q, Job(6, "f")).commit()
    assert q.len() == 2  # nothing written
    q.ack(lz2)  # the token is still good
    with pytest.raises(QueueFull):
        db.tx().nack(q, q.lease()[0], dead=True).push(q, Job(7, "g")).push(q, Job(8, "h")).commit()


def test_tx_atomic_with_a_map(backend: Backend) -> None:
    # SPEC T1 T2
    db = backend.open()
    q = db.open_queue(Jobs, cfg())
    m = db.open_map("conf_state")
    with db.tx() as t:
        t.put(m, "doc:1", {"v": 1}).push(q, Job(1, "edited"))
    assert m.get("doc:1") == {"v": 1} and q.len() == 1
    (lz,) = q.lease()
    q.ack(lz)
    with pytest.raises(StaleToken):  # a state error raised by commit: nothing written
        db.tx().put(m, "doc:2", {"v": 2}).push(q, Job(2, "x")).ack(q, lz).commit()
    assert m.get("doc:2") is None and q.len() == 0
    with pytest.raises(RuntimeError):
        with db.tx() as t:
            t.put(m, "doc:3", 3)
            raise RuntimeError("abort")
    assert "doc:3" not in m
    db.tx().delete(m, "missing").commit()  # deleting a missing key is a no-op
    assert len(m) == 1 and dict(m.items()) == {"doc:1": {"v": 1}}


def test_tx_settles_and_pushes_return_ids_in_builder_order(backend: Backend) -> None:
    # SPEC T1
    db = backend.open()
    q = db.open_queue(Jobs, cfg())
    o = db.open_queue(Outbox, cfg())
    q.push(Job(1, "a"))
    (lz,) = q.lease()
    ids = db.tx().push(o, {"n": 1}).ack(q, lz).push(q, Job(2, "b")).push(o, {"n": 2}).durable().commit()
    assert len(ids) == 3
    assert [x.payload for x in o.lease(5)] == [{"n": 1}, {"n": 2}]
    assert q.lease()[0].payload == Job(2, "b")
    (lz1,) = q.peek(1)[:1]
    assert lz1.state == State.LEASED


def test_same_token_twice_in_one_tx(backend: Backend) -> None:
    # SPEC T1 Q13
    db = backend.open()
    q = db.open_queue(Jobs, cfg())
    q.push(Job(1, "a"))
    (lz,) = q.lease()
    with pytest.raises(StaleToken):
        db.tx().ack(q, lz).nack(q, lz).commit()
    q.ack(lz)


def test_change_stream_emits_in_the_same_transaction(backend: Backend) -> None:
    # SPEC T6
    seen: list[Any] = []

    def emit(change: Any) -> Any:
        seen.append((change.key, change.old, change.new))
        if change.new == "boom":
            raise ValueError("emit refused")
        return None if change.new is None else [{"key": change.key, "new": change.new}]

    reg = SchemaRegistry().change_stream("conf_docs", Outbox, emit)
    db = backend.open(schema=reg)
    docs = db.open_map("conf_docs")
    with pytest.raises(ConfigError):  # the destination must be open
        db.tx().put(docs, "a", 1).commit()
    out = db.open_queue(Outbox, cfg())
    db.tx().put(docs, "a", 1).put(docs, "a", 2).commit()
    assert seen == [("a", None, 1), ("a", 1, 2)]
    assert [lz.payload for lz in out.lease(5)] == [{"key": "a", "new": 1}, {"key": "a", "new": 2}]
    with pytest.raises(ValueError):
        db.tx().put(docs, "b", "boom").commit()
    assert "b" not in docs and out.len() == 2
    with pytest.raises(StreamSourceRequiresTx):
        docs.put("c", 1)
    db.tx().delete(docs, "a").commit()
    assert seen[-1] == ("a", 2, None) and "a" not in docs


def test_stream_emissions_count_against_max_depth(backend: Backend) -> None:
    # SPEC Q21 T6
    reg = SchemaRegistry().change_stream("conf_src", Outbox, lambda ch: {"k": ch.key})
    db = backend.open(schema=reg)
    src = db.open_map("conf_src")
    out = db.open_queue(Outbox, cfg(max_depth=1))
    db.tx().put(src, 1, "x").commit()
    with pytest.raises(QueueFull):
        db.tx().put(src, 2, "y").commit()
    assert 2 not in src and out.len() == 1


# -- open, schemas, handles (Q2, Q36) -------------------------------------------------------------------


def test_reopen_with_another_schema_or_flavour(backend: Backend) -> None:
    # SPEC Q2
    db = backend.open()
    db.open_queue(Pings, cfg()).push((1, 2))
    with pytest.raises(QueueAlreadyOpen):
        db.open_queue(Pings, cfg())
    db.close()
    db = backend.open()
    with pytest.raises(SchemaMismatch):
        db.open_queue(armdb.queue("conf_pings", payload=np.dtype("<u4")), cfg())
    with pytest.raises(SchemaMismatch):
        db.open_queue(armdb.queue("conf_pings", payload=bytes, var=True), cfg())
    q = db.open_queue(Pings, cfg())
    assert q.len() == 1


def test_dataclass_schema_evolution(backend: Backend) -> None:
    # SPEC Q36
    db = backend.open()
    db.open_queue(Jobs, cfg()).push(Job(1, "old"))
    db.close()

    @dataclass
    class Job2:
        doc: int
        reason: str
        tags: list[str] = field(default_factory=list)

    db = backend.open()
    q = db.open_queue(armdb.queue("conf_jobs", payload=Job2, var=True), cfg())
    q.push(Job2(2, "new", ["t"]))
    assert [lz.payload for lz in q.lease(5)] == [Job2(1, "old", []), Job2(2, "new", ["t"])]

    @dataclass
    class Job3:
        doc: str
        reason: str

    db.close()
    db = backend.open()
    with pytest.raises(SchemaMismatch):
        db.open_queue(armdb.queue("conf_jobs", payload=Job3, var=True), cfg())


def test_token_from_before_a_reopen_is_stale(backend: Backend) -> None:
    # SPEC Q13
    db = backend.open()
    q = db.open_queue(Jobs, cfg())
    q.push(Job(1, "a"))
    (lz,) = q.lease()
    db.close()
    db = backend.open()
    q = db.open_queue(Jobs, cfg())
    with pytest.raises(StaleToken):
        q.ack(lz)


def test_closed_db_raises(backend: Backend) -> None:
    # SPEC D2
    db = backend.open()
    q = db.open_queue(Jobs, cfg())
    db.close()
    db.close()  # a second close is a no-op
    for call in (lambda: q.push(Job(1, "a")), q.lease, q.len, db.tx, lambda: q.wait_due_timeout(0.1)):
        with pytest.raises(DbClosed):
            call()


def test_encrypted_map_and_queue_keys(backend: Backend) -> None:
    # SPEC S10 G5
    key, other = bytes([7]) * 32, bytes([8]) * 32
    enc = Config.balanced().encryption_key(key).build()
    db = backend.open()
    q = db.open_queue(Jobs, QueueConfig.balanced().payload_config(enc).build())
    m = db.open_map("conf_secret", enc)
    q.push(Job(1, "secret"))
    db.tx().put(m, "k", "v").commit()
    assert q.lease()[0].payload == Job(1, "secret") and m.get("k") == "v"
    db.close()
    db = backend.open()
    with pytest.raises(WrongKey):
        db.open_queue(Jobs, QueueConfig.balanced().payload_config(Config.balanced().encryption_key(other).build())
                      .build())
    with pytest.raises((EncryptionKeyRequired, WrongKey)):
        db.open_map("conf_secret")


# -- stats, snapshot, waiting (Q19, Q26, Q27, G4) ---------------------------------------------------------


def test_stats_and_snapshot(backend: Backend) -> None:
    # SPEC Q26 Q27
    db = backend.open()
    q = db.open_queue(Jobs, cfg())
    q.push(Job(1, "a"))
    q.push(Job(2, "b"), delay=60)
    q.push(Job(3, "c"))
    (lz,) = q.lease()
    q.nack(q.lease()[0], dead=True)
    st = q.stats()
    assert (st.len, st.dead_len, st.ready, st.leased, st.delayed) == (2, 1, 0, 1, 1)
    assert st.pushes == 3 and st.nacks == 1 and st.dead_lettered == 1 and st.compaction_bytes == 0
    assert "<table" in st._repr_html_() and st.to_dict()["len"] == 2
    snap = q.snapshot()
    assert sorted(snap["id"].tolist()) == [1, 2, 3] or len(snap) == 3
    by_state = {int(s): int((snap["state"] == s).sum()) for s in (State.READY, State.LEASED, State.DEAD)}
    assert by_state == {State.READY: 1, State.LEASED: 1, State.DEAD: 1}
    leased = snap[snap["state"] == State.LEASED][0]
    assert leased["epoch"] == 1 and leased["attempts"] == 1 and not np.isnat(leased["deadline"])
    ready = snap[snap["state"] == State.READY][0]
    assert np.isnat(ready["deadline"])
    assert lz.token.epoch == 1
    assert "conf_jobs" in db.stats()


def test_wait_due_woken_by_a_push_from_another_thread(backend: Backend) -> None:
    # SPEC Q19 G4
    db = backend.open()
    q = db.open_queue(Jobs, cfg(wakeup_recheck=30))
    assert q.wait_due_timeout(0.1) is False
    t = threading.Timer(0.3, lambda: q.push(Job(1, "wake")))
    start = time.monotonic()
    t.start()
    assert q.wait_due_timeout(10) is True
    assert time.monotonic() - start < 5  # woken by the push, not by the 30 s recheck
    t.join()


def test_async_due(backend: Backend) -> None:
    # SPEC Q19 G4
    db = backend.open()
    q = db.open_queue(Jobs, cfg(wakeup_recheck=30))

    async def main() -> float:
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, lambda: threading.Thread(target=q.push, args=(Job(1, "a"),)).start())
        start = time.monotonic()
        await asyncio.wait_for(q.due(), 10)
        return time.monotonic() - start

    assert asyncio.run(main()) < 5


# -- batches (Q31, Q32) -------------------------------------------------------------------------------


def test_push_many_lease_batch_ack_many(backend: Backend) -> None:
    # SPEC Q31 Q32
    db = backend.open()
    q = db.open_queue(Jobs, cfg(max_depth=10))
    ids = q.push_many([Job(i, "b") for i in range(6)])
    assert ids == sorted(ids) and len(ids) == 6
    with pytest.raises(PayloadTypeError) as e:
        q.push_many([Job(1, "x"), {"not": "a job"}])
    assert "payload 1" in str(e.value)
    with pytest.raises(QueueFull):
        q.push_many([Job(i, "c") for i in range(5)])
    assert q.len() == 6
    batch = q.lease_batch(4)
    assert len(batch) == 4 and batch.ids.tolist() == ids[:4] and batch.attempts.tolist() == [1] * 4
    assert batch.deadlines.dtype == np.dtype("datetime64[ms]") and batch.payloads[0] == Job(0, "b")
    assert [lz.id for lz in batch] == ids[:4]
    q.ack(batch[0])
    with pytest.raises(StaleToken):
        q.ack_many(batch)  # one is stale: none acked
    assert q.len() == 5
    with pytest.raises(NotALease):
        q.ack_many(batch[1])
    assert q.ack_many(list(batch)[1:]) == 3
    assert q.len() == 2


def test_fixed_push_many_takes_an_array(backend: Backend) -> None:
    # SPEC Q31 Q32
    db = backend.open()
    q = db.open_queue(Pings, cfg())
    arr = np.zeros(5, dtype=Pings.dtype)
    arr["doc"] = np.arange(5)
    ids = q.push_many(arr)
    assert ids.dtype == np.uint64 and ids.tolist() == sorted(ids.tolist())
    with pytest.raises(PayloadTypeError):
        q.push_many(np.zeros(2, dtype="<u8"))
    batch = q.lease_batch(10)
    assert batch.payloads.dtype == Pings.dtype and batch.payloads["doc"].tolist() == [0, 1, 2, 3, 4]
    assert q.ack_many(batch) == 5 and q.len() == 0


def test_close_ends_a_waiter_with_db_closed(backend: Backend) -> None:
    # SPEC Q19 D2 G7: a wait in progress ends with DbClosed when the database closes
    db = backend.open()
    q = db.open_queue(Jobs, cfg(wakeup_recheck=30))
    q.wait_due_timeout(0.01)
    got: list[BaseException] = []

    def wait() -> None:
        try:
            q.wait_due_timeout(20)
        except DbClosed as e:
            got.append(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)
    start = time.monotonic()
    db.close()
    t.join(10)
    assert got and time.monotonic() - start < 10
