"""SPEC P6: ``release_many`` gives back leases whose work has not started (what a Worker
does with the rest of its batch when it stops): each row is ready again at once, in its
place, with the attempt its lease counted taken back; a lease no longer held is left alone.
A header update, crash-safe like a lease.

Sizes: ``ARMDB_KILLS_RELEASE`` kills per queue flavour (default 3)."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import armdb
from armdb import Db, QueueConfig
from armdb.errors import NotALease, StaleToken

from .conftest import FakeClock, kill_and_read, spawn_child

PING = np.dtype([("doc", "<u8")])


@dataclass
class Job:
    doc: int


FixedQ = armdb.queue("fq", payload=PING)
VarQ = armdb.queue("vq", payload=Job, var=True)


@pytest.fixture(params=["fixed", "var"])
def flavour(request: Any) -> str:
    return str(request.param)


def open_q(db: Any, flavour: str, lease: float = 30, attempts: int = 5) -> Any:
    cfg = QueueConfig.balanced().lease_timeout(timedelta(seconds=lease)).max_attempts(attempts).build()
    return db.open_queue(FixedQ if flavour == "fixed" else VarQ, cfg)


def make(flavour: str, i: int) -> Any:
    return (i,) if flavour == "fixed" else Job(i)


def doc(flavour: str, payload: Any) -> int:
    return int(payload["doc"]) if flavour == "fixed" else int(payload.doc)


def test_p6_released_rows_are_due_at_once_in_their_place_with_the_attempt_not_counted(db: Db, flavour: str) -> None:
    # SPEC P6: release_many undoes the delivery: same order, same attempt, old tokens stale
    q = open_q(db, flavour)
    for i in range(5):
        q.push(make(flavour, i))
    first = q.lease(3)
    assert [lz.attempt for lz in first] == [1, 1, 1]
    assert q.release_many(first[1:]) == 2
    assert q.stats().leased == 1
    again = q.lease(5)  # due at once: no clock moved
    assert [doc(flavour, lz.payload) for lz in again] == [1, 2, 3, 4]  # in key order, before the rest
    assert [lz.attempt for lz in again] == [1, 1, 1, 1]
    with pytest.raises(StaleToken):
        q.ack(first[1])  # released: its token is stale
    assert q.release_many(first[1:]) == 0  # and releasing it again changes nothing
    assert q.ack_many([first[0], *again]) == 5 and q.len() == 0
    assert q.stats().expired_leases == 0


def test_p6_release_keeps_a_redelivered_row_at_its_attempt(db: Db, clock: FakeClock, flavour: str) -> None:
    # SPEC P6, Q9: a row on its 2nd delivery is released and comes back as the 2nd again; with
    # max_attempts reached, a release is not an expiry: the row is delivered, not dead-lettered
    q = open_q(db, flavour, lease=1, attempts=2)
    q.push(make(flavour, 7))
    (lz,) = q.lease()
    clock.advance(2)
    (lz2,) = q.lease()  # the expired lease, redelivered
    assert lz2.attempt == 2
    assert q.release_many([lz2.token]) == 1  # a token works as well as a Lease
    (lz3,) = q.lease()
    assert lz3.attempt == 2 and q.dead_len() == 0
    q.ack(lz3)


def test_p6_a_stale_token_is_refused(db: Db, clock: FakeClock, flavour: str) -> None:
    # SPEC P6, Q13: a lease that expired and was leased again is not released by its old
    # token: the new holder keeps it (and can ack it); a token of another handle raises
    q = open_q(db, flavour, lease=1)
    q.push(make(flavour, 1))
    q.push(make(flavour, 2))
    old = q.lease(2)
    clock.advance(2)
    new = q.lease(1)
    assert new[0].id == old[0].id and new[0].attempt == 2
    assert q.release_many(old) == 1  # only the second, which nobody took since
    assert q.stats().leased == 1
    q.ack(new[0])
    other = db.open_queue(armdb.queue("other", payload=PING))
    other.push((1,))
    with pytest.raises(StaleToken, match="another queue handle"):
        q.release_many(other.lease(1))
    with pytest.raises(NotALease):
        q.release_many(new[0])  # one Lease, not a list of them
    with pytest.raises(NotALease):
        q.release_many([object()])


def test_p6_a_lease_batch_is_released_whole(db: Db, flavour: str) -> None:
    # SPEC P6, Q32: release_many takes a LeaseBatch as ack_many does
    q = open_q(db, flavour)
    q.push_many([make(flavour, i) for i in range(4)])
    b = q.lease_batch(4)
    assert q.release_many(b) == 4
    assert list(q.lease_batch(4).attempts) == [1, 1, 1, 1]


def test_p6_release_through_a_client(tmp_path: Path) -> None:
    # SPEC P6, P3: through a client, one request; a token this connection does not hold
    # (another client's) raises StaleToken and releases nothing
    db = Db.open(tmp_path / "db")
    try:
        q = open_q(db, "var")
        db.serve()
        with armdb.connect(db.path, timeout=10) as a, armdb.connect(db.path, timeout=10) as b:
            qa, qb = open_q(a, "var"), open_q(b, "var")
            qa.push_many([Job(i) for i in range(6)])
            la = qa.lease(2)
            lb = qb.lease_batch(2)
            with pytest.raises(StaleToken, match="not held by this connection"):
                qb.release_many(la)
            with pytest.raises(StaleToken):
                qb.release_many([lb[0], la[0]])  # all or nothing at the connection
            assert q.stats().leased == 4
            assert qa.release_many(la) == 2
            assert qb.release_many(lb) == 2
            got = qa.lease(6)
            assert [lz.payload.doc for lz in got] == list(range(6)) and {lz.attempt for lz in got} == {1}
            with pytest.raises(StaleToken):
                qb.ack(lb[0])  # released: no longer this connection's
    finally:
        db.shutdown()


def _noop(job: Job) -> None:
    pass


def test_p6_a_worker_releases_the_rest_when_one_lease_was_lost(tmp_path: Path) -> None:
    # SPEC P6, P3: through a client a token the connection no longer holds refuses the
    # whole request; the worker then releases the others one by one
    db = Db.open(tmp_path / "db")
    try:
        q = open_q(db, "var")
        db.serve()
        with armdb.connect(db.path, timeout=10) as c:
            rq = open_q(c, "var")
            rq.push_many([Job(i) for i in range(3)])
            leases = rq.lease(3)
            rq.ack(leases[1])  # lost to this worker: no longer held by the connection
            armdb.Worker(c, VarQ, _noop)._release(rq, leases)
            got = q.lease(3)
            assert [lz.payload.doc for lz in got] == [0, 2] and {lz.attempt for lz in got} == {1}
    finally:
        db.shutdown()


CHILD = """
import armdb
from tests.test_worker_release import make, open_q
db = armdb.Db.open({path!r})
q = open_q(db, {flavour!r})
q.push_many([make({flavour!r}, i) for i in range(20)])
print("pushed", flush=True)
while True:
    got = q.lease(7)
    q.release_many(got)
    print("released", len(got), flush=True)
"""


@pytest.mark.crash
def test_p6_kill_during_releases_loses_no_row_and_leaves_no_half_update(tmp_path: Path, flavour: str) -> None:
    # SPEC P6, S3: SIGKILL while leases are taken and released: after the reopen every row
    # is there once, each ready or leased with at most its one counted attempt, check is clean
    rng = random.Random(f"release-{flavour}")
    for r in range(int(os.environ.get("ARMDB_KILLS_RELEASE", "3"))):
        path = tmp_path / f"db{r}"
        p = spawn_child(CHILD.format(flavour=flavour, path=str(path)))
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "pushed"
        time.sleep(rng.uniform(0.01, 0.08))
        out, err = kill_and_read(p)
        assert "Traceback" not in err, err
        assert armdb.check(path).ok
        with Db.open(path) as db:
            q = open_q(db, flavour)
            snap = q.snapshot()
            assert sorted(snap["id"].tolist()) == list(range(1, 21))
            assert int(snap["attempts"].max()) <= 1
            assert q.dead_len() == 0


def test_p6_pg_release_many(pg_dsn: str, pg_namespace: str) -> None:
    # SPEC P6, G1: armdb.pg's queues release the same way (the rule of armdb.transitions)
    from armdb import pg

    with pg.connect(pg_dsn, namespace=pg_namespace) as pdb:
        q = open_q(pdb, "var")
        q.push_many([Job(i) for i in range(3)])
        got = q.lease(3)
        assert q.release_many(got[1:]) == 2
        assert q.release_many(got[1:]) == 0
        again = q.lease(3)
        assert [lz.payload.doc for lz in again] == [1, 2] and {lz.attempt for lz in again} == {1}
        with pytest.raises(StaleToken):
            q.ack(got[1])
        assert q.ack_many([got[0], *again]) == 3
