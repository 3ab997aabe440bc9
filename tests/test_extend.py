"""SPEC Q29: ``extend`` moves a lease's deadline; a header update, crash-safe like a lease."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import armdb
from armdb import Db, QueueConfig
from armdb._clock import ms_to_datetime
from armdb.errors import ConfigError, NotALease, StaleToken

from .conftest import FakeClock, kill_and_read, spawn_child

PING = np.dtype([("doc", "<u8")])


@dataclass
class Job:
    doc: int


FixedQ = armdb.queue("fq", payload=PING)
VarQ = armdb.queue("vq", payload=Job, var=True)


def open_q(db: Db, flavour: str, **kw):
    spec = FixedQ if flavour == "fixed" else VarQ
    b = QueueConfig.balanced().lease_timeout(timedelta(seconds=30))
    for k, v in kw.items():
        b = getattr(b, k)(v)
    return db.open_queue(spec, b.build())


def make(flavour: str, i: int):
    return (i,) if flavour == "fixed" else Job(i)


@pytest.fixture(params=["fixed", "var"])
def flavour(request) -> str:
    return request.param


def deadline_of(q, rid: int):
    snap = q.snapshot()
    return snap["deadline"][snap["id"] == rid][0]


def test_q29_extend_moves_the_deadline_and_keeps_the_token(db, clock, flavour):
    q = open_q(db, flavour)
    q.push(make(flavour, 1))
    (lz,) = q.lease()
    clock.advance(20)
    new = q.extend(lz, by=60)
    assert new == ms_to_datetime(clock.ms + 60_000)
    assert deadline_of(q, lz.id) == np.datetime64(clock.ms + 60_000, "ms")
    clock.advance(50)  # past the first deadline, within the extended one
    assert q.lease() == []  # not delivered again
    q.ack(lz)  # the token is still valid
    assert q.len() == 0


def test_q29_default_by_is_the_timeout_the_lease_was_taken_with(db, clock, flavour):
    q = open_q(db, flavour)
    q.push(make(flavour, 1))
    q.push(make(flavour, 2))
    a, = q.lease(1)  # the queue's 30 s
    b, = q.lease(1, lease_timeout=timedelta(seconds=5))
    clock.advance(3)
    assert q.extend(a) == ms_to_datetime(clock.ms + 30_000)
    assert q.extend(b.token) == ms_to_datetime(clock.ms + 5_000)


def test_q29_an_expired_lease_nobody_took_can_be_extended(db, clock, flavour):
    q = open_q(db, flavour)
    q.push(make(flavour, 1))
    (lz,) = q.lease()
    clock.advance(40)  # expired, not leased again
    q.extend(lz, by=10)
    assert q.lease() == []
    clock.advance(11)
    (again,) = q.lease()  # now it expired again and is redelivered
    assert again.attempt == 2
    with pytest.raises(StaleToken):
        q.extend(lz)  # re-leased since: stale, nothing changes
    q.ack(again)


def test_q29_extend_of_a_settled_lease_is_stale(db, clock, flavour):
    q = open_q(db, flavour)
    q.push(make(flavour, 1))
    (lz,) = q.lease()
    q.ack(lz)
    with pytest.raises(StaleToken):
        q.extend(lz)


@pytest.mark.parametrize("by", [0, -1, timedelta(0), 1e30])
def test_q29_bad_by_is_a_config_error(db, clock, by):
    q = open_q(db, "fixed")
    q.push((1,))
    (lz,) = q.lease()
    before = deadline_of(q, lz.id)
    with pytest.raises(ConfigError, match="by"):
        q.extend(lz, by=by)
    with pytest.raises(NotALease):
        q.extend(None)  # type: ignore[arg-type]
    assert deadline_of(q, lz.id) == before


def test_q29_the_extended_deadline_survives_a_reopen(tmp_path: Path, flavour):
    clock = FakeClock()
    with Db.open(tmp_path / "db", clock=clock) as db:
        q = open_q(db, flavour)
        q.push(make(flavour, 1))
        (lz,) = q.lease()
        q.extend(lz, by=3600)
    with Db.open(tmp_path / "db", clock=clock) as db:
        q = open_q(db, flavour)
        clock.advance(600)
        assert q.lease() == []  # the row is leased until the extended deadline
        assert deadline_of(q, lz.id) == np.datetime64(clock.ms - 600_000 + 3_600_000, "ms")


CHILD = """
import armdb
from tests.test_extend import make, open_q
db = armdb.Db.open({path!r})
q = open_q(db, {flavour!r})
q.push(make({flavour!r}, 1))
(lz,) = q.lease()
print("id", lz.id, flush=True)
by = 100
while True:
    dl = q.extend(lz, by=by)
    print("extended", int(dl.timestamp() * 1000), flush=True)
    by += 1
"""


@pytest.mark.crash
def test_q29_kill_finds_the_deadline_of_the_last_extend_that_returned(tmp_path: Path, flavour):
    rng = random.Random(f"extend-{flavour}")
    for r in range(10):
        path = tmp_path / f"db{r}"
        p = spawn_child(CHILD.format(flavour=flavour, path=str(path)))
        assert p.stdout is not None
        rid = int(p.stdout.readline().split()[1])
        time.sleep(rng.uniform(0.005, 0.05))
        out, _err = kill_and_read(p)
        whole = out.split("\n")[:-1]  # the last piece is a line the kill cut short (or empty)
        returned = [int(line.split()[1]) for line in whole if line.startswith("extended")]
        with Db.open(path) as db:
            q = open_q(db, flavour)
            got = int(deadline_of(q, rid).astype("datetime64[ms]").astype(np.int64))
        assert armdb.check(path).ok
        if returned:
            # the last extend that returned, or the one the kill interrupted (a later one)
            assert got >= returned[-1], (got, returned[-3:])
            assert got - returned[-1] <= 60_000
