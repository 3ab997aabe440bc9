"""The lone var ack committed by the compiled ``VarFast.ack`` (its ``_commit_ack``) against
the Python reference it stands for, ``armdb.tx.commit_settle``: the same log records, the
same outcomes (acked, or the same ``StaleToken``), the same state after a reopen, and the
same failure handling (``_fence_after_log``) when applying or syncing fails after the log
append."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import armdb
from armdb import QueueConfig, TxConfig, queue
from armdb import db as dbmod
from armdb.check import check
from armdb.errors import StorageError, TxFailedAfterLog
from armdb.logformat import FLAG_SYNCED_BEFORE, RECORDS_START, parse_records
from armdb.tx import TxSyncFailed

from .conftest import FakeClock

Jobs = queue("jobs", payload=dict, var=True)

ops = st.lists(st.one_of(
    st.tuples(st.just("push"), st.integers(0, 10**6)),
    st.tuples(st.just("lease"), st.none()),
    st.tuples(st.just("ack"), st.integers(0, 5)),  # a held lease, acked (and kept: a second ack is stale)
    st.tuples(st.just("advance"), st.integers(0, 40_000)),  # past the lease: the row is leased again
), max_size=40)


def _open(path: Path, clock: FakeClock, durable: bool) -> tuple[armdb.Db, Any]:
    db = armdb.Db.open(path, clock=clock, tx_config=TxConfig(durable=durable))
    cfg = QueueConfig.balanced().lease_timeout(timedelta(seconds=30)).max_attempts(3).build()
    return db, db.open_queue(Jobs, cfg)


def _log_records(db: armdb.Db, durable: bool) -> list[tuple[int, int, bytes]]:
    """Every record in the Db's log files, as ``(txid, flags, body)``.  The flag that says
    everything before a record was synced depends, in a Db that is not durable, on when
    the flusher last synced the log: compared only in a durable one."""
    out = []
    for name in sorted(os.listdir(db.txlog.dir)):
        if name.endswith(".log"):
            recs, _end, bad = parse_records(Path(db.txlog.dir, name).read_bytes(), RECORDS_START)
            assert bad is None
            out += [(txid, flags if durable else flags & ~FLAG_SYNCED_BEFORE, body) for txid, flags, body in recs]
    return out


def _drive(path: Path, steps: list[tuple[str, Any]], compiled: bool, durable: bool,
           monkeypatch: pytest.MonkeyPatch, record: bool = True) -> list[Any]:
    """Run ``steps`` on a fresh var queue, acking each token through the public (compiled)
    ack or through ``commit_settle``; what each step returned, the log record bodies the
    acks appended (``record``: by a wrapper of ``append_body`` set on the log; else the
    records read back from the log files, so that the compiled ack appends them itself),
    then the queue's state after a reopen."""
    calls: list[int] = []

    def counted(*args: Any) -> None:
        calls.append(1)
        return real_settle(*args)

    real_settle = dbmod.commit_settle
    monkeypatch.setattr(dbmod, "commit_settle", counted)  # handed to the queue at open
    clock = FakeClock()
    db, q = _open(path, clock, durable)
    bodies: list[bytes] = []
    append = db.txlog.append_body

    def recording(body: bytes, parts: Any = None, behind: bool = False) -> int:
        bodies.append(bytes(body))
        return append(body, parts, behind)

    if record:
        db.txlog.append_body = recording  # (an instance attribute: both paths look it up per call)
    out: list[Any] = []
    held: list[Any] = []
    for op, arg in steps:
        if op == "push":
            out.append(q.push({"n": arg, "pad": "x" * (arg % 50)}))
        elif op == "lease":
            got = q.lease(1)
            out.append([(lz.id, lz.payload, lz.attempt) for lz in got])
            held.extend(got)
        elif op == "ack" and held:
            token = held[arg % len(held)].token
            try:
                if compiled:
                    q.ack(token)
                else:
                    q._commit_settle(db, q, token, True)
                out.append("acked")
            except armdb.StaleToken as e:
                out.append(str(e).replace(str(token.handle), "H"))
        elif op == "advance":
            clock.advance(arg / 1000)
    st_ = q.stats()
    out.append((st_.len, st_.ready, st_.leased, st_.pushes, st_.acks, st_.dead_lettered, len(q._payload)))
    out.append(bodies if record else _log_records(db, durable))
    # The compiled path never calls commit_settle for a token it commits; the reference
    # path calls it for every ack.
    out.append(len(calls) if not compiled else 0)
    if compiled:
        assert calls == []
    db.shutdown()
    db, q = _open(path, clock, durable)
    out.append([(j.id, j.state, j.attempts, j.payload) for j in q.peek(1000) + q.peek(1000, dead=True)])
    out.append(len(q._payload))
    db.shutdown()
    assert check(path).ok
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=ops, durable=st.booleans())
def test_q14_compiled_ack_commits_what_commit_settle_commits(tmp_path_factory: pytest.TempPathFactory,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            steps: list[tuple[str, Any]], durable: bool) -> None:
    # SPEC Q14, T2: the same records in the log, the same outcomes and the same rows after
    # a reopen, whichever path committed the acks
    base = tmp_path_factory.mktemp("ack")
    with monkeypatch.context() as m:
        compiled = _drive(base / "c", steps, True, durable, m)
    with monkeypatch.context() as m:
        reference = _drive(base / "p", steps, False, durable, m)
    compiled[-3] = reference[-3]  # (how often commit_settle ran: only the reference calls it)
    assert compiled == reference


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=ops, durable=st.booleans())
@example(steps=[("push", 0), ("lease", None), ("push", 1), ("lease", None), ("ack", 0), ("ack", 1)], durable=False)
@example(steps=[("push", 0), ("lease", None), ("ack", 0), ("push", 1), ("lease", None), ("ack", 1)], durable=True)
def test_t2_compiled_ack_appends_the_records_append_body_appends(tmp_path_factory: pytest.TempPathFactory,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 steps: list[tuple[str, Any]], durable: bool) -> None:
    # SPEC T2, Q14: the compiled ack's own log append (VarFast._log_append, _log_done)
    # leaves the log files TxLog.append_body leaves for commit_settle: the same records,
    # txids and flags, the same outcomes and the same rows after a reopen
    base = tmp_path_factory.mktemp("log")
    with monkeypatch.context() as m:
        compiled = _drive(base / "c", steps, True, durable, m, record=False)
    with monkeypatch.context() as m:
        reference = _drive(base / "p", steps, False, durable, m, record=False)
    compiled[-3] = reference[-3]  # (how often commit_settle ran: only the reference calls it)
    assert compiled == reference


def _failed_ack(path: Path, compiled: bool, where: str) -> tuple[Any, ...]:
    """One ack whose apply (``where="apply"``: the body's tombstone) or log sync
    (``"sync"``, a durable Db) fails after its record was appended."""
    clock = FakeClock()
    db, q = _open(path, clock, where == "sync")
    q.push({"n": 1})
    q.push({"n": 2})
    (lz,) = q.lease(1)
    if where == "apply":
        def failing(key: bytes, gsn: int) -> bool:
            raise OSError(5, "injected")
        q._payload.tomb_locked = failing
    else:
        def failing_sync(end: int) -> None:
            raise StorageError("injected sync failure")
        db.txlog.sync_to = failing_sync
    with pytest.raises((TxFailedAfterLog, TxSyncFailed)) as info:
        if compiled:
            q.ack(lz.token)
        else:
            q._commit_settle(db, q, lz.token, True)
    got: tuple[Any, ...] = (type(info.value), str(info.value).replace(str(lz.token.handle), "H"),
                            q._payload._poisoned is not None, q._shards[lz.token.shard].fixed.poisoned is not None)
    with pytest.raises(StorageError):
        q.push({"n": 3})  # the body store is fenced until the reopen replays the record
    # The process ends without a clean close (a fenced store refuses the close's sync),
    # then the reopen replays the log.
    db._dirlock.release()
    db._closed = True
    db, q = _open(path, clock, False)
    got += (q.len(), len(q._payload), [j.payload for j in q.peek(10)])
    db.shutdown()
    assert check(path).ok
    return got


@pytest.mark.parametrize("where", ["apply", "sync"])
def test_t2_compiled_ack_fails_after_its_log_record_as_commit_settle_does(tmp_path: Path, where: str) -> None:
    # SPEC T2, S12: the same error, the same fences (the header shard and the body store
    # refuse writes), and after the reopen the logged ack applied (apply) or, when its sync
    # failed, whatever the log holds, the same either way
    assert _failed_ack(tmp_path / "c", True, where) == _failed_ack(tmp_path / "p", False, where)
